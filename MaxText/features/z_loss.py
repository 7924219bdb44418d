"""z-loss (z_loss_multiplier > 0): z_loss_multiplier x logsumexp(logits)^2 added to the training loss, per counted
target token (PaLM's auxiliary loss, which keeps the softmax normaliser log Z near 0 and the logits from drifting).

The term counts the tokens the cross-entropy counts (targets_segmentation != 0: the loss mask of SFT and padding
alike) and is normalised as the objective is: its mean over those tokens x the objective's weights, so that dividing
by the weights (the train step's mean) gives the mean over the counted tokens. With the cross-entropy that is the
sum over the counted tokens, which gradient accumulation sums over microbatches like the cross-entropy's. Logged as
learning/z_loss (included in learning/loss); the eval loss leaves it out, as it does the other loss terms.
"""

import jax
import jax.numpy as jnp

from MaxText import feature_protocol

NAME = "z_loss"


def summed_z_loss(logits: jax.Array, targets_segmentation: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum over the counted tokens of logsumexp(logits)^2, the number of counted tokens).

  Args:
    logits: (B, T, V) logits.
    targets_segmentation: (B, T); 0 marks a token the loss does not count.
  """
  log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # (B, T)
  counted = (targets_segmentation != 0).astype(jnp.float32)
  return jnp.sum(jnp.square(log_z) * counted), jnp.sum(counted)


class ZLoss(feature_protocol.Feature):
  """z_loss_multiplier x logsumexp(logits)^2 per counted token, as a loss term."""

  name = NAME

  def __init__(self, config):
    self.multiplier = config.z_loss_multiplier

  def loss_terms(self, ctx: feature_protocol.StepContext) -> dict:
    total, tokens = summed_z_loss(ctx.logits, ctx.batch["targets_segmentation"])
    # The mean over the counted tokens x the objective's weights: with the cross-entropy (its weights are these
    # tokens) exactly `total`; with another objective (DPO counts pairs) the token mean weighted as its loss is.
    return {NAME: self.multiplier * total / jnp.maximum(tokens, 1.0) * ctx.weights}
