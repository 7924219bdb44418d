"""The loss, train_step and eval_step: pure functions shared by train.py, the benchmarks and tests.

A batch is a dict of (batch, length) int32 arrays: inputs, inputs_position, inputs_segmentation,
targets, targets_segmentation (segmentation 0 marks padding, which carries no loss).
"""

import functools

import jax
import jax.numpy as jnp
import optax

from MaxText import compiled_step_file, max_logging, memory_check, sharding
from MaxText.diagnostics import nonfinite, numerics_stats, numerics_taps
from MaxText.input_pipeline.packing import BATCH_KEYS
from MaxText.layers import moe, quantizations
from MaxText.optimizers import create_learning_rate_schedule


def _loss_terms(model, config, params, batch, dropout_rng, train: bool, numerics=None, fp8_meta=None):
  """The summed loss to differentiate, and (real target tokens, the load-balancing part of that loss).

  The loss is the summed token cross-entropy plus, in training, load_balance_loss_weight x the MoE
  load-balancing loss x the real tokens: dividing the sums by all tokens, as for the cross-entropy, then
  averages it over microbatches. Eval (train=False) is cross-entropy only. With `numerics` (the inputs of the
  numerics statistics taps) the aux also holds the sown collections, where the taps put their reductions.
  `fp8_meta` is quantization=fp8's state (quantizations).
  """
  variables = {"params": params}
  if numerics is not None:
    variables[numerics_taps.COLLECTION] = numerics
  if fp8_meta is not None:
    variables[quantizations.FP8_COLLECTION] = fp8_meta
  logits, sown = model.apply(
    variables,
    batch["inputs"],
    batch["inputs_position"],
    batch["inputs_segmentation"],
    deterministic=not (train and config.enable_dropout),
    rngs={"dropout": dropout_rng},
    mutable=["intermediates"],
  )  # (B, T, V) float32
  xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # (B, T)
  weights = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  total_weights = jnp.sum(weights)
  moe_lb = jnp.zeros((), jnp.float32)
  if train:
    moe_lb = config.load_balance_loss_weight * moe.load_balancing_loss(sown, config.num_experts) * total_weights
  aux = (total_weights, moe_lb) if numerics is None else (total_weights, moe_lb, sown)
  return jnp.sum(xent * weights) + moe_lb, aux


def _rows_to_train_on(config, batch):
  """With a fractional per_device_batch_size, more rows are loaded than trained on: keep the first ones."""
  rows = config.micro_batch_size_to_train_on * config.gradient_accumulation_steps
  if rows == config.global_batch_size_to_load:
    return batch
  return jax.tree.map(lambda x: x[:rows], batch)


def _summed_grads(model, config, params, batch, dropout_rng, plan=None, numerics=None, fp8_meta=None):
  """Gradient of the summed loss over all gradient_accumulation_steps microbatches, scanned one at a time.

  Summing per-token losses (not per-microbatch means) makes the result the large batch's gradient.
  Microbatch i takes rows i, i+G, i+2G, ... so that no row leaves the device it was loaded on.

  Returns (summed loss, (real target tokens, load-balancing loss), grads, reductions, new fp8_meta): with a
  statistics `plan` and its step inputs `numerics`, the loss is also differentiated with respect to the inputs
  (whose gradient holds the activation gradients' reductions, see numerics_taps) and `reductions` are the whole
  batch's raw reductions, else None. With `fp8_meta` (quantization=fp8) it is differentiated with respect to that
  state too, whose "gradient" is its new value (quantizations); microbatches combine them by their maximum (the
  same histories rolled once, each with its own amax at the front), else None.
  """

  def grads_of(microbatch, rng):
    wrt = {"params": params}
    if plan is not None:
      wrt["numerics"] = numerics
    if fp8_meta is not None:
      wrt["fp8_meta"] = fp8_meta

    def loss_of(wrt):
      return _loss_terms(model, config, wrt["params"], microbatch, rng, True, wrt.get("numerics"), wrt.get("fp8_meta"))

    (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(wrt)
    reductions = None
    if plan is not None:
      weights, moe_lb, sown = aux
      aux, reductions = (weights, moe_lb), plan.reductions(sown, grads["numerics"])
    return loss, aux, grads["params"], reductions, grads.get("fp8_meta")

  steps = config.gradient_accumulation_steps
  if steps == 1:
    return grads_of(batch, dropout_rng)

  def to_microbatches(x):  # (B, T) -> (G, B/G, T)
    return jnp.swapaxes(x.reshape(x.shape[0] // steps, steps, *x.shape[1:]), 0, 1)

  def accumulate(carry, microbatch_and_index):
    microbatch, index = microbatch_and_index
    loss, aux, grads, reductions, new_meta = grads_of(microbatch, jax.random.fold_in(dropout_rng, index))
    acc_loss, acc_aux, acc_grads, acc_reductions, acc_meta = carry
    if plan is not None:
      acc_reductions = numerics_stats.combine(acc_reductions, reductions)
    if fp8_meta is not None:
      acc_meta = jax.tree.map(jnp.maximum, acc_meta, new_meta)
    return (
      acc_loss + loss,
      jax.tree.map(jnp.add, acc_aux, aux),
      jax.tree.map(jnp.add, acc_grads, grads),
      acc_reductions,
      acc_meta,
    ), None

  zero = jnp.zeros((), jnp.float32)
  no_meta = None if fp8_meta is None else jax.tree.map(lambda m: jnp.full_like(m, -jnp.inf), fp8_meta)
  init = (
    zero,
    (zero, zero),
    jax.tree.map(jnp.zeros_like, params),
    None if plan is None else plan.identity(numerics),
    no_meta,
  )
  microbatches = jax.tree.map(to_microbatches, batch)
  (total_loss, aux, grads, reductions, new_meta), _ = jax.lax.scan(accumulate, init, (microbatches, jnp.arange(steps)))
  return total_loss, aux, grads, reductions, new_meta


def train_step(model, config, state, batch):
  """One optimizer update. Returns (new_state, metrics) with scalar metrics for logging.

  With numerics_debug_config's statistics, metrics["numerics"] holds them (numerics_stats.Plan.finalize); with
  nonfinite_action abort or skip, a step with a non-finite loss or gradient does not update the params or the
  optimizer state and metrics["nonfinite"] says where the values are (nonfinite.locate).
  """
  batch = _rows_to_train_on(config, batch)
  dropout_rng = jax.random.fold_in(jax.random.PRNGKey(config.init_weights_seed), state.step)
  plan, numerics = numerics_stats.create_plan(config, state.params), None
  if plan is not None:  # gradients of the mean loss: divided by the real target tokens, as `grads` below
    numerics = plan.step_inputs(state.step, 1.0 / jnp.maximum(jnp.sum(batch["targets_segmentation"] != 0), 1.0))
  fp8_meta = getattr(state, "fp8_meta", None)  # train_state.Fp8TrainState (quantization=fp8)
  total_loss, (total_weights, moe_lb), summed_grads, reductions, new_fp8_meta = _summed_grads(
    model, config, state.params, batch, dropout_rng, plan, numerics, fp8_meta
  )
  denominator = jnp.maximum(total_weights, 1.0)  # An all-padding batch gives zero loss and no update.
  # Back to each parameter's dtype: a float32 denominator would promote bfloat16 grads (weight_dtype=bfloat16),
  # and with them the optimizer state and the params, so that the state would change type at the first step.
  grads = jax.tree.map(lambda g: (g / denominator).astype(g.dtype), summed_grads)
  # A batch of padding only (the data ran out on every process) must not move the weights (momentum,
  # weight decay): skip the update, and do not count the step.
  has_tokens = total_weights > 0

  def updated():
    new_state = state.apply_gradients(grads=grads)
    return new_state if fp8_meta is None else new_state.replace(fp8_meta=new_fp8_meta)

  if config.nonfinite_action == "none":
    new_state = jax.lax.cond(has_tokens, updated, lambda: state)
  else:  # A non-finite step keeps the params and the optimizer state, and counts as a step.
    finite = nonfinite.is_finite(total_loss, optax.tree.norm(grads))
    new_state = jax.lax.cond(
      has_tokens & finite,
      updated,
      lambda: state.replace(step=state.step + has_tokens.astype(state.step.dtype)),
    )

  raw_grad_norm = optax.tree.norm(grads)
  threshold = config.gradient_clipping_threshold
  metrics = {
    "learning/loss": total_loss / denominator,
    "learning/total_weights": total_weights,
    "learning/raw_grad_norm": raw_grad_norm,
    # clip_by_global_norm rescales to exactly the threshold, so the clipped norm needs no second pass.
    "learning/grad_norm": jnp.minimum(raw_grad_norm, threshold) if threshold > 0 else raw_grad_norm,
    "learning/param_norm": optax.tree.norm(new_state.params),
    "learning/update_norm": optax.tree.norm(jax.tree.map(jnp.subtract, new_state.params, state.params)),
    "learning/current_learning_rate": create_learning_rate_schedule(config)(state.step),
  }
  if config.num_experts > 1:  # learning/loss includes this term (what is minimised), as upstream MaxText's
    metrics["learning/moe_lb_loss"] = moe_lb / denominator
  if config.nonfinite_action != "none":
    metrics[nonfinite.SKIPPED] = (~finite).astype(jnp.float32)
    metrics[nonfinite.REPORT] = nonfinite.locate(finite, state.params, grads, config)
  if plan is not None:
    metrics[numerics_stats.METRICS_KEY] = plan.finalize(reductions)
  return new_state, metrics


def eval_step(model, config, params, batch):
  """Summed loss and weights of one eval batch (no dropout, no update)."""
  total_loss, (total_weights, _) = _loss_terms(model, config, params, batch, jax.random.PRNGKey(0), False)
  return {"evaluation/total_loss": total_loss, "evaluation/total_weights": total_weights}


def jit_train_step(model, config, mesh, state_shardings):
  """train_step jitted with the state donated and kept on its shardings, the batch on the data sharding.

  Call the result inside sharding.logical_context(mesh, config), which tracing needs.
  """
  return jax.jit(
    functools.partial(train_step, model, config),
    in_shardings=(state_shardings, sharding.data_sharding(config, mesh)),
    out_shardings=(state_shardings, None),
    donate_argnums=0,
  )


def abstract_batch(config, mesh) -> dict:
  """One global train batch as jax.ShapeDtypeStructs on the data sharding: what every input pipeline yields."""
  shape = (config.global_batch_size_to_load, config.max_target_length)
  data_sharding = sharding.data_sharding(config, mesh)
  return {key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=data_sharding) for key in BATCH_KEYS}


def lower_train_step(model, config, mesh, abstract_state):
  """The jitted train step traced on shapes only (for train.py's pre-flight and train_compile.py's AOT compile).

  Args:
    model, config, mesh: as compile_train_step.
    abstract_state: the TrainState of sharded jax.ShapeDtypeStructs; its shardings are the step's.

  Returns:
    A jax.stages.Lowered; `.compile()` compiles it for the mesh's devices (local, or an AOT target's).
  """
  state_shardings = jax.tree.map(lambda x: x.sharding, abstract_state)
  with sharding.logical_context(mesh, config):
    return jit_train_step(model, config, mesh, state_shardings).lower(abstract_state, abstract_batch(config, mesh))


def compile_train_step(model, config, mesh, abstract_state, memory_limit_bytes: int | None = None):
  """The train step compiled ahead of time, after checking that one step fits a device's memory.

  This is train.py's pre-flight check: it needs no allocated state or batch, so a model that cannot fit
  stops before anything is allocated; the loop then calls the executable it returns, so nothing compiles twice.

  Args:
    model: the Transformer (train_state.build's model).
    config: the Config.
    mesh: the device mesh.
    abstract_state: the TrainState of sharded jax.ShapeDtypeStructs (train_state.build's abstract_state).
    memory_limit_bytes: one device's memory; default: what a local device has.

  Returns:
    The compiled step, called as compiled(state, batch) -> (new_state, metrics); it donates `state`.

  Raises:
    UserError: a step needs more memory per device than a device has; the message names the keys that help.
  """
  compiled = lower_train_step(model, config, mesh, abstract_state).compile()
  memory = memory_check.CompiledMemory.from_analysis(compiled.memory_analysis())
  if memory is not None:
    device = jax.local_devices()[0]
    limit = memory_check.device_memory_bytes(device) if memory_limit_bytes is None else memory_limit_bytes
    memory_check.check_fits(
      memory.peak_bytes,
      limit,
      what="one train step needs",
      device_kind=device.device_kind,
      breakdown=memory.breakdown(),
      advice=_memory_advice(config, device.platform),
    )
    of_limit = f" of the {memory_check.format_bytes(limit)} a device has" if limit else ""
    max_logging.log(
      f"One train step needs {memory_check.format_bytes(memory.peak_bytes)} per device{of_limit} ({memory.breakdown()})"
    )
  return compiled


def load_compiled_train_step(model, config, mesh, abstract_state):
  """The step that train_compile.py compiled into config.compiled_trainstep_file, instead of compiling it here.

  Raises:
    UserError: the file is missing, or was compiled for other shapes, config values or devices (named).
  """
  step = functools.partial(train_step, model, config)
  with sharding.logical_context(mesh, config):
    compiled = compiled_step_file.load(
      config.compiled_trainstep_file, config, jax.devices(), step, abstract_state, abstract_batch(config, mesh)
    )
  max_logging.log(f"Loaded the compiled train step from {config.compiled_trainstep_file}")
  return compiled


def _memory_advice(config, platform: str) -> str:
  """The config keys that make a train step smaller, with their values now."""
  keep_batch = "; raise gradient_accumulation_steps to keep the batch" if config.per_device_batch_size >= 2 else ""
  hints = [
    f"lower per_device_batch_size (now {config.per_device_batch_size:.10g}{keep_batch}) or max_target_length "
    f"(now {config.max_target_length})"
  ]
  if config.remat_policy != "full":  # "full" keeps the fewest activations for the backward pass
    hints.append(f"recompute activations with remat_policy=full (now {config.remat_policy})")
  hints.append("shard over more devices (ici_fsdp_parallelism)")
  cpu_sized = "; the README quickstart's keys fit a CPU" if platform == "cpu" else ""
  hints.append(f"or use a smaller model (base_emb_dim, base_mlp_dim, base_num_decoder_layers, vocab_size{cpu_sized})")
  return ", ".join(hints)


def jit_eval_step(model, config, mesh, state_shardings):
  return jax.jit(
    functools.partial(eval_step, model, config),
    in_shardings=(state_shardings.params, sharding.data_sharding(config, mesh)),
    out_shardings=None,
  )
