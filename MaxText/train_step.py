"""The loss, train_step and eval_step: pure functions shared by train.py, train_compile.py, the benchmarks and tests.

A batch is a dict of (batch, length) int32 arrays: inputs, inputs_position, inputs_segmentation, targets,
targets_segmentation (segmentation 0 marks padding, which carries no loss). Compiling the step ahead of time, and
its memory check, are in aot_compile.py.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.experimental import checkify

from MaxText import dpo, lora_training, routing_bias, sharding
from MaxText.diagnostics import nonfinite, numerics_stats, numerics_taps
from MaxText.layers import context_parallel, models, qlora, quantizations
from MaxText.layers.multi_token_prediction import MTP_LOGITS
from MaxText.optimizers import create_learning_rate_schedule


@struct.dataclass
class StepExtras:
  """The optional inputs of the loss, differentiated with the params (but the reference); a field is None where the
  run does not use it.

  Attributes:
    numerics: the numerics statistics taps' inputs (numerics_stats.Plan.step_inputs); their gradient holds the
      reductions of the activation gradients (numerics_taps).
    fp8_meta: quantization=fp8's scales and amax histories; their "gradient" is their new value (quantizations).
    reference: use_dpo's reference params (dpo.reference_params); the loss holds them constant.
    plan: the numerics statistics plan that made `numerics` (static).
  """

  numerics: dict | None = None
  fp8_meta: dict | None = None
  reference: dict | None = None
  plan: numerics_stats.Plan | None = struct.field(pytree_node=False, default=None)

  def collections(self) -> dict:
    """The model's variable collections besides params."""
    variables = {numerics_taps.COLLECTION: self.numerics, quantizations.FP8_COLLECTION: self.fp8_meta}
    return {name: value for name, value in variables.items() if value is not None}


class LossAux(NamedTuple):
  """What the loss returns besides its value."""

  weights: jax.Array  # the real target tokens (the loss's denominator)
  aux_losses: dict  # aux_loss_names' terms of the loss, summed over tokens as the loss is (0 in eval)
  sown: dict  # the `intermediates` collection: MoE routing statistics, the numerics taps' reductions
  metrics: dict | None = None  # use_dpo: dpo.METRICS summed over pairs (not part of the loss)


class Gradients(NamedTuple):
  """A microbatch's (or the summed microbatches') loss and gradients; the optional fields are None when unused."""

  loss: jax.Array  # the summed loss
  weights: jax.Array
  aux_losses: dict
  params: Any  # the summed loss's gradient
  reductions: dict | None = None  # the numerics statistics' raw reductions (numerics_stats.combine adds them)
  fp8_meta: Any = None  # the new fp8 state (microbatches combine by maximum)
  expert_loads: dict | None = None  # routed_bias: the routers' per-expert loads (routing_bias.loads), summed
  metrics: dict | None = None  # LossAux.metrics, summed


NO_EXTRAS = StepExtras()


def aux_loss_names(config) -> tuple:
  """The terms of the training loss besides the cross-entropy, each also logged as learning/<name>."""
  names = ("moe_lb_loss",) if config.num_experts > 1 else ()
  return names + (("mtp_loss",) if config.mtp_num_layers > 0 else ())


def mtp_loss(sown: dict, batch) -> jax.Array:
  """Multi-token prediction's loss: the mean over depths of depth k's mean cross-entropy, where position i predicts
  token i + 1 + k (targets[i + k]), counted where that target is real, in i's document and inside the sequence."""
  depths = sown["intermediates"]["decoder"][MTP_LOGITS]
  length = batch["targets"].shape[1]
  total = jnp.zeros((), jnp.float32)
  for k, logits in enumerate(depths, start=1):
    targets = jnp.roll(batch["targets"], -k, axis=1)
    target_segments = jnp.roll(batch["targets_segmentation"], -k, axis=1)
    real = (target_segments != 0) & (target_segments == batch["inputs_segmentation"]) & (jnp.arange(length) < length - k)
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    total += jnp.sum(xent * real) / jnp.maximum(jnp.sum(real), 1)
  return total / len(depths)


def loss_fn(model, config, params, batch, dropout_rng, train: bool, extras: StepExtras = NO_EXTRAS):
  """The summed token cross-entropy to differentiate, and its LossAux.

  In training the loss also holds load_balance_loss_weight x the family's MoE balance loss (DecoderFamily.
  balance_loss) and mtp_loss_scaling_factor x multi-token prediction's loss, each x the real tokens: dividing the
  sums by all tokens, as for the cross-entropy, then averages them over microbatches. Eval (train=False) is
  cross-entropy only.
  """
  batch = context_parallel.reorder(context_parallel.from_config(config), batch)  # the layout attention expects

  def forward(params, deterministic):
    return model.apply(
      {"params": params, **extras.collections()},
      batch["inputs"],
      batch["inputs_position"],
      batch["inputs_segmentation"],
      deterministic=deterministic,
      rngs={"dropout": dropout_rng},
      mutable=["intermediates"],
    )  # (B, T, V) float32

  logits, sown = forward(params, not (train and config.enable_dropout))
  if config.use_dpo:
    reference_logits, _ = forward(jax.lax.stop_gradient(extras.reference), True)
    reference_logps = dpo.response_logps(reference_logits, batch)
    pairs_loss, pairs, metrics = dpo.loss(
      dpo.response_logps(logits, batch), reference_logps, batch, config.dpo_beta, config.dpo_label_smoothing
    )
    return pairs_loss, LossAux(pairs, {}, sown, metrics)
  xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # (B, T)
  weights = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  total_weights = jnp.sum(weights)
  aux = {name: jnp.zeros((), jnp.float32) for name in aux_loss_names(config)}
  if train and "moe_lb_loss" in aux:
    balance_loss = models.DECODER_BLOCKS[config.decoder_block].balance_loss
    aux["moe_lb_loss"] = config.load_balance_loss_weight * balance_loss(sown, config) * total_weights
  if train and "mtp_loss" in aux:
    aux["mtp_loss"] = config.mtp_loss_scaling_factor * mtp_loss(sown, batch) * total_weights
  return jnp.sum(xent * weights) + sum(aux.values()), LossAux(total_weights, aux, sown)


def _microbatch_gradients(model, config, params, extras: StepExtras, batch, dropout_rng) -> Gradients:
  loss_of = functools.partial(loss_fn, model, config, batch=batch, dropout_rng=dropout_rng, train=True)
  codes = {}
  if config.enable_lora and config.lora_weight_qtype:  # QLoRA's quantized kernels: frozen and not differentiable
    codes, params = lora_training.split_codes(params)
  reference = extras.reference  # DPO's: constant, and with QLoRA it holds codes, which grad refuses

  def loss_of_both(p, e):
    return loss_of(lora_training.join(codes, p) if codes else p, extras=e.replace(reference=reference))

  (loss, aux), (grads, extras_grads) = jax.value_and_grad(loss_of_both, argnums=(0, 1), has_aux=True)(
    params, extras.replace(reference=None)
  )
  if codes:
    grads = lora_training.join(lora_training.zero_codes(codes), grads)
  reductions = None if extras.plan is None else extras.plan.reductions(aux.sown, extras_grads.numerics)
  loads = routing_bias.loads(aux.sown) if config.routed_bias else None
  return Gradients(loss, aux.weights, aux.aux_losses, grads, reductions, extras_grads.fp8_meta, loads, aux.metrics)


def _add(a: Gradients, b: Gradients) -> Gradients:
  """Two microbatches' Gradients as one: sums, the statistics' reductions combined, the fp8 state's maximum."""
  return Gradients(
    a.loss + b.loss,
    a.weights + b.weights,
    jax.tree.map(jnp.add, a.aux_losses, b.aux_losses),
    jax.tree.map(jnp.add, a.params, b.params),
    None if a.reductions is None else numerics_stats.combine(a.reductions, b.reductions),
    None if a.fp8_meta is None else jax.tree.map(jnp.maximum, a.fp8_meta, b.fp8_meta),
    None if a.expert_loads is None else jax.tree.map(jnp.add, a.expert_loads, b.expert_loads),
    None if a.metrics is None else jax.tree.map(jnp.add, a.metrics, b.metrics),
  )


def summed_gradients(model, config, params, extras: StepExtras, batch, dropout_rng) -> Gradients:
  """The Gradients of the summed loss over all gradient_accumulation_steps microbatches, scanned one at a time.

  Summing per-token losses (not per-microbatch means) makes the result the large batch's gradient. Microbatch i
  takes rows i, i+G, i+2G, ... so that no row leaves the device it was loaded on.
  """
  steps = config.gradient_accumulation_steps
  if steps == 1:
    return _microbatch_gradients(model, config, params, extras, batch, dropout_rng)

  def to_microbatches(x):  # (B, T) -> (G, B/G, T)
    return jnp.swapaxes(x.reshape(x.shape[0] // steps, steps, *x.shape[1:]), 0, 1)

  def accumulate(total, microbatch_and_index):
    microbatch, index = microbatch_and_index
    rng = jax.random.fold_in(dropout_rng, index)
    return _add(total, _microbatch_gradients(model, config, params, extras, microbatch, rng)), None

  zero = jnp.zeros((), jnp.float32)
  nothing = Gradients(
    zero,
    zero,
    {name: zero for name in aux_loss_names(config)},
    jax.tree.map(jnp.zeros_like, params),
    None if extras.plan is None else extras.plan.identity(extras.numerics),
    None if extras.fp8_meta is None else jax.tree.map(lambda m: jnp.full_like(m, -jnp.inf), extras.fp8_meta),
    routing_bias.zero_loads(params, config.param_scan_axis) if config.routed_bias else None,
    dict.fromkeys(dpo.METRICS, zero) if config.use_dpo else None,
  )
  total, _ = jax.lax.scan(accumulate, nothing, (jax.tree.map(to_microbatches, batch), jnp.arange(steps)))
  return total


def _rows_to_train_on(config, batch):
  """With a fractional per_device_batch_size, more rows are loaded than trained on: keep the first ones."""
  rows = config.micro_batch_size_to_train_on * config.gradient_accumulation_steps
  if rows == config.global_batch_size_to_load:
    return batch
  return jax.tree.map(lambda x: x[:rows], batch)


def step_extras(config, state, batch) -> StepExtras:
  """This step's optional inputs: the numerics taps' (gradients of the mean loss: scaled by 1 / real target
  tokens, as the update's) and the fp8 state of train_state.Fp8TrainState."""
  plan, numerics = numerics_stats.create_plan(config, state.params), None
  if plan is not None:
    numerics = plan.step_inputs(state.step, 1.0 / jnp.maximum(jnp.sum(batch["targets_segmentation"] != 0), 1.0))
  reference = dpo.reference_params(config, state)
  return StepExtras(numerics=numerics, fp8_meta=getattr(state, "fp8_meta", None), reference=reference, plan=plan)


def train_step(model, config, state, batch):
  """One optimizer update: loss -> gradient -> update. Returns (new_state, metrics) with scalar metrics for logging.

  With numerics_debug_config's statistics, metrics["numerics"] holds them (numerics_stats.Plan.finalize); with
  nonfinite_action abort or skip, a step with a non-finite loss or gradient does not update the params or the
  optimizer state and metrics["nonfinite"] says where the values are (nonfinite.locate).
  """
  batch = _rows_to_train_on(config, batch)
  extras = step_extras(config, state, batch)
  dropout_rng = jax.random.fold_in(jax.random.PRNGKey(config.init_weights_seed), state.step)
  summed = summed_gradients(model, config, state.params, extras, batch, dropout_rng)
  denominator = jnp.maximum(summed.weights, 1.0)  # An all-padding batch gives zero loss and no update.
  # Back to each parameter's dtype: a float32 denominator would promote bfloat16 grads (weight_dtype=bfloat16),
  # and with them the optimizer state and the params, so that the state would change type at the first step.
  grads = jax.tree.map(lambda g: g if _is_code(g) else (g / denominator).astype(g.dtype), summed.params)
  new_state, finite = _update(config, state, grads, summed)
  return new_state, _metrics(config, state, new_state, summed, grads, finite, extras.plan)


def _is_code(leaf) -> bool:
  """QLoRA's quantized base kernels (frozen; their "gradients" are zeros in their own dtype): left out of the
  gradients' scaling and of the norms, where fp8 and 4-bit codes do not promote (and int8 squares overflow)."""
  return qlora.is_code(leaf)


def _norm(tree):
  """The global norm of a tree's float leaves (QLoRA's codes left out)."""
  return optax.tree.norm(jax.tree.map(lambda x: jnp.zeros((), jnp.float32) if _is_code(x) else x, tree))


def _update(config, state, grads, summed: Gradients):
  """The optimizer's update, or none: (new state, whether the step's loss and gradients are finite or None).

  A batch of padding only (the data ran out on every process) must not move the weights (momentum, weight decay):
  it skips the update and does not count the step. With nonfinite_action abort or skip, a non-finite step keeps the
  params and the optimizer state, and counts as a step.
  """
  has_tokens = summed.weights > 0

  def updated():
    new_state = state.apply_gradients(grads=grads)
    if summed.expert_loads is not None:  # routed_bias: outside the optimizer, after its update
      rate, axis = config.routed_bias_update_rate, config.param_scan_axis
      new_state = new_state.replace(params=routing_bias.update(new_state.params, summed.expert_loads, rate, axis))
    return new_state if summed.fp8_meta is None else new_state.replace(fp8_meta=summed.fp8_meta)

  if config.nonfinite_action == "none":
    return jax.lax.cond(has_tokens, updated, lambda: state), None
  finite = nonfinite.is_finite(summed.loss, _norm(grads))
  kept = lambda: state.replace(step=state.step + has_tokens.astype(state.step.dtype))
  return jax.lax.cond(has_tokens & finite, updated, kept), finite


def _metrics(config, state, new_state, summed: Gradients, grads, finite, plan) -> dict:
  denominator = jnp.maximum(summed.weights, 1.0)
  raw_grad_norm = _norm(grads)
  threshold = config.gradient_clipping_threshold
  metrics = {
    "learning/loss": summed.loss / denominator,
    "learning/total_weights": summed.weights,
    "learning/raw_grad_norm": raw_grad_norm,
    # clip_by_global_norm rescales to exactly the threshold, so the clipped norm needs no second pass.
    "learning/grad_norm": jnp.minimum(raw_grad_norm, threshold) if threshold > 0 else raw_grad_norm,
    "learning/param_norm": _norm(new_state.params),
    "learning/update_norm": _norm(jax.tree.map(jnp.subtract, new_state.params, state.params)),
    "learning/current_learning_rate": create_learning_rate_schedule(config)(state.step),
  }
  for name, value in summed.aux_losses.items():  # learning/loss includes them (what is minimised), as upstream's
    metrics[f"learning/{name}"] = value / denominator
  for name, value in (summed.metrics or {}).items():  # use_dpo: means over the pairs
    metrics[name] = value / denominator
  if finite is not None:
    metrics[nonfinite.SKIPPED] = (~finite).astype(jnp.float32)
    metrics[nonfinite.REPORT] = nonfinite.locate(finite, state.params, grads, config)
  if plan is not None:
    metrics[numerics_stats.METRICS_KEY] = plan.finalize(summed.reductions)
  return metrics


def eval_step(model, config, state, batch):
  """Summed loss and weights of one eval batch (no dropout, no update); use_dpo: also dpo.METRICS, summed over the
  pairs as the loss is (evaluation/dpo/...)."""
  extras = StepExtras(fp8_meta=getattr(state, "fp8_meta", None), reference=dpo.reference_params(config, state))
  total_loss, aux = loss_fn(model, config, state.params, batch, jax.random.PRNGKey(0), False, extras)
  metrics = {"evaluation/total_loss": total_loss, "evaluation/total_weights": aux.weights}
  return metrics | {f"evaluation/{name}": value for name, value in (aux.metrics or {}).items()}


def jit_train_step(model, config, mesh, state_shardings):
  """train_step jitted with the state donated and kept on its shardings, the batch on the data sharding.

  Call the result inside sharding.logical_context(mesh, config), which tracing needs. With max_checkify the step is
  checkified and returns (error, (new_state, metrics)), which aot_compile.throwing_step raises.
  """
  out_shardings = (state_shardings, None)
  if config.max_checkify:
    out_shardings = (None, out_shardings)
  return jax.jit(
    step_function(model, config),
    in_shardings=(state_shardings, sharding.data_sharding(config, mesh)),
    out_shardings=out_shardings,
    donate_argnums=0,
  )


def step_function(model, config):
  """train_step of this model and config as a function of (state, batch), checkified with max_checkify."""
  step = functools.partial(train_step, model, config)
  return _checkified(step, config) if config.max_checkify else step


def _checkified(step, config):
  """max_checkify: the step checks that every token id is in [0, vocab_size) (JAX clamps an out-of-bounds gather
  silently), and that no op makes a NaN or divides by zero (the error names the op and where it is)."""

  def checked_step(state, batch):
    for key in ("inputs", "targets"):
      ids = batch[key]
      in_range = jnp.all((ids >= 0) & (ids < config.vocab_size))
      checkify.check(in_range, f"a token id of the batch's {key} is outside [0, vocab_size={config.vocab_size})")
    return step(state, batch)

  # index_checks would cover every gather and scatter, but checkify cannot trace the batched scatter of
  # take_along_axis's gradient (an IndexError in jax 0.10): the token ids are what an input can put out of bounds.
  return checkify.checkify(checked_step, errors=checkify.user_checks | checkify.nan_checks | checkify.div_checks)


def jit_eval_step(model, config, mesh, state_shardings):
  """eval_step jitted on the train state (as upstream's: DPO's reference and fp8's scales live in it), not donated."""
  return jax.jit(
    functools.partial(eval_step, model, config),
    in_shardings=(state_shardings, sharding.data_sharding(config, mesh)),
    out_shardings=None,
  )
