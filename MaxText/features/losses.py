"""Terms of the training loss besides the objective, each a feature: the MoE balance loss and multi-token prediction's
loss. Each is summed as the objective's loss is (its mean x the objective's weights), so that dividing by the weights
averages it over microbatches; each is logged as learning/<name>."""

import jax
import jax.numpy as jnp
import optax

from MaxText import feature_protocol
from MaxText.layers import context_parallel, models
from MaxText.layers.multi_token_prediction import MTP_LOGITS


class MoeBalanceLoss(feature_protocol.Feature):
  """load_balance_loss_weight x the family's MoE balance loss (DecoderFamily.balance_loss), in MoE models."""

  name = "moe_balance_loss"

  def __init__(self, config):
    self.config = config
    self.balance_loss = models.DECODER_BLOCKS[config.decoder_block].balance_loss

  def loss_terms(self, ctx: feature_protocol.StepContext) -> dict:
    value = self.config.load_balance_loss_weight * self.balance_loss(ctx.sown, self.config) * ctx.weights
    return {"moe_lb_loss": value}


class MtpLoss(feature_protocol.Feature):
  """mtp_num_layers > 0: mtp_loss_scaling_factor x multi-token prediction's loss."""

  name = "mtp_loss"

  def __init__(self, config):
    self.scale = config.mtp_loss_scaling_factor
    self.layout = context_parallel.from_config(config)

  def loss_terms(self, ctx: feature_protocol.StepContext) -> dict:
    return {"mtp_loss": self.scale * mtp_loss(ctx.sown, ctx.batch, self.layout) * ctx.weights}


def mtp_loss(sown: dict, batch, layout: context_parallel.ContextParallel = context_parallel.NONE) -> jax.Array:
  """Multi-token prediction's loss: the mean over depths of depth k's mean cross-entropy, where position i predicts
  token i + 1 + k (targets[i + k]), counted where that target is real, in i's document and inside the sequence.
  The logits and the batch are in `layout` (context parallelism's); the shifts are in the data's order."""
  depths = [context_parallel.in_data_order(layout, d) for d in sown["intermediates"]["decoder"][MTP_LOGITS]]
  batch = {name: context_parallel.in_data_order(layout, x) for name, x in batch.items()}
  length = batch["targets"].shape[1]
  total = jnp.zeros((), jnp.float32)
  for k, logits in enumerate(depths, start=1):
    targets = jnp.roll(batch["targets"], -k, axis=1)
    target_segments = jnp.roll(batch["targets_segmentation"], -k, axis=1)
    real = (target_segments != 0) & (target_segments == batch["inputs_segmentation"]) & (jnp.arange(length) < length - k)
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    total += jnp.sum(xent * real) / jnp.maximum(jnp.sum(real), 1)
  return total / len(depths)


def _checkpoint_hint(saved: set, wanted: set) -> str:
  """A checkpoint with multi-token prediction depths that the model lacks names the key that makes them."""
  depths = {k.split("/")[2] for k in saved if k.startswith("params/decoder/mtp_")}
  depths -= {k.split("/")[2] for k in wanted if k.startswith("params/decoder/mtp_")}
  return f"the checkpoint has multi-token prediction depths: set mtp_num_layers={len(depths)}" if depths else ""


feature_protocol.register_checkpoint_hint(_checkpoint_hint)
