"""Runs a decoder stack's pipelined layers on the circular schedule of pipeline_schedule.py, then its other layers.

Every iteration, all stages run at once: `jax.vmap` over the stage axis with `spmd_axis_name="stage"`, whose inputs
and weights are sharded over mesh axis `stage`, so each stage's devices compute their own stage. Then the stages'
outputs move one stage on (`jnp.roll` over the stage axis, which the compiler turns into a collective-permute): the
last stage's output comes round to stage 0, which keeps it in a per-microbatch buffer until that microbatch's next
repeat starts (or, after the last repeat, as the microbatch's output).

The layers are the family's own block, applied functionally to the stack's params (held in
Schedule.memory_order, so that a reshape gives each stage its groups without moving any weight).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from MaxText.configuration.pipeline_schedule import Schedule

STATE_AXES = ("activation_stage", "activation_batch", "activation_length", "activation_embed")
MICROBATCH_AXES = (None, "activation_batch", "activation_length", "activation_embed")
BUFFER_AXES = ("activation_stage", None, "activation_batch", "activation_length", "activation_embed")
EMBEDDING_AXES = ("activation_embed_and_logits_batch", "activation_length", "activation_embed")
_FSDP_AXES = ("fsdp", "fsdp_transpose")


def _layer_axis(x, scan_axis: int) -> int:
  return scan_axis if x.ndim > 1 else 0  # as nn.scan stacks a layer's params (layer_stacking does the same)


def split_stack(params, schedule: Schedule, scan_axis: int):
  """The stack's params (memory order, stacked on scan_axis) -> (pipelined, after): the pipelined layers as
  [stages, repeats, layers_per_stage, ...] (sharded over stage) and the layers after them as [layers, ...]."""
  stages, per_chunk = schedule.stages, schedule.num_layers // schedule.stages
  piped = schedule.pipelined_layers // schedule.stages

  def pipelined(x):
    x = jnp.moveaxis(x, _layer_axis(x, scan_axis), 0)
    chunks = x.reshape(stages, per_chunk, *x.shape[1:])
    chunks = jax.lax.with_sharding_constraint(chunks, PartitionSpec("stage", *[PartitionSpec.UNCONSTRAINED] * x.ndim))
    return chunks[:, :piped].reshape(stages, schedule.repeats, schedule.layers_per_stage, *x.shape[1:])

  def after(x):
    x = jnp.moveaxis(x, _layer_axis(x, scan_axis), 0)
    return x.reshape(stages, per_chunk, *x.shape[1:])[:, piped:].reshape(-1, *x.shape[1:])

  return jax.tree.map(pipelined, params), jax.tree.map(after, params)


def _microbatches(a, count: int):
  """(B, ...) -> (count, B / count, ...): microbatch m holds rows m, m + count, ..., so the rows' split over the batch
  axes stays as it is (each device's rows are its rows of every microbatch)."""
  return a.reshape(a.shape[0] // count, count, *a.shape[1:]).swapaxes(0, 1)


def _rows(a):
  """The inverse of _microbatches: (count, B / count, ...) -> (B, ...)."""
  return a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _rules_without(rules, drop: tuple[str, ...]):
  """Logical axis rules with the mesh axes `drop` taken out of every target."""
  out = []
  for name, target in rules:
    axes = target if isinstance(target, (list, tuple)) else (target,)
    out.append((name, tuple(a for a in axes if a not in drop)))
  return tuple(out)


def _stage_as_data(rules):
  """Logical axis rules where the batch axes also split over stage, last (for the layers after the pipeline)."""
  out = []
  for name, target in rules:
    axes = tuple(target) if isinstance(target, (list, tuple)) else (target,)
    if "batch" in name and "data" in axes and "stage" not in axes:
      axes = axes + ("stage",)
    out.append((name, axes))
  return tuple(out)


def _gathered_over_fsdp(pipe, layer, sample):
  """pipeline_fsdp_ag_once: the pipelined weights constrained to be whole over fsdp (one all-gather per step)."""
  boxed = jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(0), *sample)["params"])
  names = nn.get_partition_spec(boxed)
  rules = _rules_without(nn.get_logical_axis_rules(), _FSDP_AXES)
  return jax.tree.map(
    lambda w, spec: nn.with_logical_constraint(w, ("activation_stage", None, None, *spec), rules=rules), pipe, names
  )


def run(schedule: Schedule, layer, params, x, positions, segment_ids, deterministic: bool, rng, config):
  """The stack's layers on x (B, T, E): the pipelined ones, then those after them.

  Args:
    schedule: the run's pipeline_schedule.Schedule.
    layer: the family's block, unbound (parent=None), applied as
      layer.apply({"params": p}, x, positions, segment_ids, deterministic, layer_index, rngs=...).
    params: the stack's params in memory order (Schedule.memory_order), stacked on config.param_scan_axis.
    rng: the dropout key (None when deterministic).
    config: the run's Config (param_scan_axis, scan_pipeline_iterations, pipeline_fsdp_ag_once).
  """
  pipe, after = split_stack(params, schedule, config.param_scan_axis)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  if config.pipeline_fsdp_ag_once:
    rows = x.shape[0] // schedule.microbatches
    sample = (x[:rows], positions[:rows], segment_ids[:rows], deterministic, 0)
    pipe = _gathered_over_fsdp(pipe, layer, sample)
  y = _pipeline(schedule, layer, pipe, x, positions, segment_ids, deterministic, rng, config.scan_pipeline_iterations)
  if schedule.pipelined_layers == schedule.num_layers:
    return y
  rng = jax.random.fold_in(rng, schedule.iterations)  # no iteration of the pipeline has this key
  with nn.logical_axis_rules(_stage_as_data(nn.get_logical_axis_rules())):
    return _layers_after(schedule, layer, after, y, positions, segment_ids, deterministic, rng)


def _apply_layers(layer, weights, x, positions, segment_ids, deterministic: bool, indices, rng):
  """x through the layers whose params are stacked on axis 0 of `weights`, with their model indices."""

  def one(h, weights_and_index):
    w, index = weights_and_index
    rngs = {} if deterministic else {"dropout": jax.random.fold_in(rng, index)}
    return layer.apply({"params": w}, h, positions, segment_ids, deterministic, index, rngs=rngs), None

  return jax.lax.scan(one, x, (weights, indices))[0]


def _layers_after(schedule: Schedule, layer, after, x, positions, segment_ids, deterministic: bool, rng):
  """The layers after the pipelined ones, on every stage, the batch split over stage too."""
  x = nn.with_logical_constraint(x, MICROBATCH_AXES[1:])
  indices = schedule.pipelined_layers + jnp.arange(schedule.num_layers - schedule.pipelined_layers)
  return _apply_layers(layer, after, x, positions, segment_ids, deterministic, indices, rng)


def _pipeline(schedule: Schedule, layer, pipe, x, positions, segment_ids, deterministic: bool, rng, scanned: bool):
  """The pipelined layers on x (B, T, E), as schedule says (see pipeline_schedule's doc for the work items)."""
  stages, micro, repeats, delay = schedule.stages, schedule.microbatches, schedule.repeats, schedule.delay
  per_stage = schedule.layers_per_stage
  # The embedding splits the rows over the batch axes and then stage (base.yml puts stage last, so a device's rows
  # are a part of its rows without stage): gathering them over stage only is what the pipeline's inputs cost.
  x = nn.with_logical_constraint(x, MICROBATCH_AXES[1:])
  positions, segment_ids = (nn.with_logical_constraint(a, MICROBATCH_AXES[1:3]) for a in (positions, segment_ids))
  inputs = nn.with_logical_constraint(_microbatches(x, micro), MICROBATCH_AXES)
  positions, segment_ids = (_microbatches(a, micro) for a in (positions, segment_ids))
  stage_ids = jnp.arange(stages)

  def stage(weights, h, pos, seg, repeat, stage_id, key):
    indices = (repeat * stages + stage_id) * per_stage + jnp.arange(per_stage)
    return _apply_layers(layer, weights, h, pos, seg, deterministic, indices, key)

  is_first = (stage_ids == 0)[:, None, None, None]

  def arrive(buffer, shifted, done):
    """Each stage files what it received under work item `done`'s microbatch (when done >= 0): on stage 0 that is the
    last stage's output, which the microbatch's next repeat starts from. Every stage keeps its own buffer, so this
    moves nothing; only stage 0's is read."""
    slot = done % micro
    kept = jax.lax.dynamic_index_in_dim(buffer, slot, 1, keepdims=False)
    buffer = jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(done >= 0, shifted, kept), slot, 1)
    return nn.with_logical_constraint(buffer, BUFFER_AXES)

  def iteration(carry, t):
    history, buffer = carry  # history[k]: the stages' outputs k + 1 iterations ago; buffer: (stages, micro, rows, T, E)
    shifted = jnp.roll(history[-1], 1, axis=0)  # stage s receives stage s - 1's output, stage 0 the last stage's
    buffer = arrive(buffer, shifted, t - delay * stages)  # shifted[0] finished work item t - delay x stages
    # Stage 0 starts work item t: a new microbatch in the first repeat, else the microbatch's previous repeat.
    fresh = jax.lax.dynamic_index_in_dim(inputs, t % micro, 0, keepdims=False)
    again = jax.lax.dynamic_index_in_dim(buffer, t % micro, 1, keepdims=False)
    first = jnp.where(t < micro, fresh[None], again)
    stage_in = nn.with_logical_constraint(jnp.where(is_first, first, shifted), STATE_AXES)
    items = t - delay * stage_ids
    repeat = jnp.clip(items // micro, 0, repeats - 1)
    weights = jax.tree.map(lambda w: jax.vmap(lambda w_s, r: w_s[r])(w, repeat), pipe)
    keys = jax.random.split(jax.random.fold_in(rng, t), stages)
    args = (weights, stage_in, positions[items % micro], segment_ids[items % micro], repeat, stage_ids, keys)
    out = nn.with_logical_constraint(jax.vmap(stage, spmd_axis_name="stage")(*args), STATE_AXES)
    return ((out,) + history[:-1], buffer), None

  state = nn.with_logical_constraint(jnp.zeros((stages, *inputs.shape[1:]), x.dtype), STATE_AXES)
  buffer = nn.with_logical_constraint(jnp.zeros((stages, *inputs.shape), x.dtype), BUFFER_AXES)
  carry = ((state,) * delay, buffer)
  if scanned:
    carry, _ = jax.lax.scan(iteration, carry, jnp.arange(schedule.iterations))
  else:
    for t in range(schedule.iterations):
      carry, _ = iteration(carry, jnp.int32(t))
  history, buffer = carry
  for k in range(delay):  # the last work items, which no iteration has taken off the last stage yet
    buffer = arrive(buffer, jnp.roll(history[k], 1, axis=0), jnp.int32(micro * repeats - 1 - k))
  outputs = nn.with_logical_constraint(buffer[0], MICROBATCH_AXES)  # stage 0's, on every stage
  return nn.with_logical_constraint(_rows(outputs), EMBEDDING_AXES)
