"""Runs a decoder stack's pipelined layers on the circular schedule of pipeline_schedule.py, then its other layers.

Every iteration, all stages run at once: `jax.vmap` over the stage axis with `spmd_axis_name="stage"`, whose inputs
and weights are sharded over mesh axis `stage`, so each stage's devices compute their own stage. Then the stages'
outputs move one stage on (`jnp.roll` over the stage axis, which the compiler turns into a collective-permute): the
last stage's output comes round to stage 0, which keeps it in a per-microbatch buffer until that microbatch's next
repeat starts (or, after the last repeat, as the microbatch's output).

The layers are the family's own block, applied functionally to the stack's params (held in
Schedule.memory_order, so that a reshape gives each stage its groups without moving any weight).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from MaxText.configuration.pipeline_schedule import Schedule
from MaxText.layers import dropout, microbatch_combine

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


def _rules_without(rules, drop: tuple[str, ...]):
  """Logical axis rules with the mesh axes `drop` taken out of every target."""
  out = []
  for name, target in rules:
    axes = target if isinstance(target, (list, tuple)) else (target,)
    out.append((name, tuple(a for a in axes if a not in drop)))
  return tuple(out)


def stage_as_data(rules):
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


def join_stack(pipelined, after, schedule: Schedule):
  """The inverse of split_stack for trees stacked on axis 0: [stages, repeats, layers_per_stage, ...] and
  [layers after, ...] (or None) -> [layers, ...] in memory order."""

  def one(p, a=None):
    p = p.reshape(schedule.stages, -1, *p.shape[3:])
    if a is not None:
      p = jnp.concatenate([p, a.reshape(schedule.stages, -1, *a.shape[1:])], axis=1)
    return p.reshape(-1, *p.shape[2:])

  return jax.tree.map(one, pipelined) if after is None else jax.tree.map(one, pipelined, after)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _per_use(tree, count: int, rule):
  """tree's leaves ([stages, repeats, layers_per_stage, ...]) with a copy per microbatch, and one for the bubbles'
  work items, on axis 3. The copies' gradients combine by `rule` (microbatch_combine), not by the sum a broadcast's
  gradient would take: e.g. fp8's new amax history is the largest of the microbatches'."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x[:, :, :, None], (*x.shape[:3], count + 1, *x.shape[3:])), tree)


def _per_use_fwd(tree, count, rule):
  return _per_use(tree, count, rule), None


def _per_use_bwd(count, rule, _, grads):
  layers = jax.tree.map(lambda g: g.reshape(-1, *g.shape[3:])[:, :count], grads)  # the bubbles' copy dropped
  combined = jax.vmap(rule)(layers)  # each layer's microbatches
  return (jax.tree.map(lambda c, g: c.reshape(*g.shape[:3], *c.shape[1:]), combined, grads),)


_per_use.defvjp(_per_use_fwd, _per_use_bwd)


def run(schedule: Schedule, layer, variables: dict, x, positions, segment_ids, deterministic: bool, config, sow):
  """The stack's layers on x (B, T, E): the pipelined ones, then those after them.

  Args:
    schedule: the run's pipeline_schedule.Schedule.
    layer: the family's block, unbound (parent=None), applied as
      layer.apply(variables, x, positions, segment_ids, deterministic, layer_index, rngs=...).
    variables: the stack's model collections, each with its layers in memory order (Schedule.memory_order): the
      params stacked on config.param_scan_axis, the others (fp8 state, quantization recipes, numerics taps) on
      axis 0. A collection with a microbatch_combine rule gets a copy per microbatch.
    config: the run's Config (param_scan_axis, scan_pipeline_iterations, pipeline_fsdp_ag_once).
    sow: whether the layers' sown `intermediates` are collected.
  Returns:
    (y, sown): sown is the layers' `intermediates` as the scanned stack sows them (stacked on axis 0, memory order),
    each statistic combined over the microbatches by its microbatch_combine rule; None when not sow.
  """
  params = variables["params"]
  pipe, after = split_stack(params, schedule, config.param_scan_axis)
  others = {name: split_stack(tree, schedule, 0) for name, tree in variables.items() if name != "params"}
  if config.pipeline_fsdp_ag_once:
    rows = x.shape[0] // schedule.microbatches
    sample = (x[:rows], positions[:rows], segment_ids[:rows], deterministic, 0)
    pipe = _gathered_over_fsdp(pipe, layer, sample)
  pipe = {"params": pipe}
  for name, (tree, _) in others.items():
    rule = microbatch_combine.rule(name)
    pipe[name] = tree if rule is None else _per_use(tree, schedule.microbatches, rule)
  inputs = (x, positions, segment_ids, deterministic)
  y, sown = _pipeline(schedule, layer, pipe, *inputs, config.scan_pipeline_iterations, sow)
  if schedule.pipelined_layers == schedule.num_layers:
    return y, None if sown is None else join_stack(sown, None, schedule)
  after = {"params": after, **{name: tree for name, (_, tree) in others.items()}}
  with nn.logical_axis_rules(stage_as_data(nn.get_logical_axis_rules())):
    y, sown_after = _layers_after(schedule, layer, after, y, positions, segment_ids, deterministic, sow)
  return y, None if sown is None else join_stack(sown, sown_after, schedule)


def _apply_layers(layer, variables, x, positions, segment_ids, deterministic: bool, indices, sow: bool):
  """x through the layers whose collections are stacked on axis 0 of `variables`, with their model indices:
  (y, each layer's sown intermediates stacked on axis 0, or None). A layer's dropout masks come from its index
  (dropout.layer), as in the scanned stack."""

  def one(h, variables_and_index):
    v, index = variables_and_index
    if not sow:
      return layer.apply(v, h, positions, segment_ids, deterministic, index), None
    h, state = layer.apply(v, h, positions, segment_ids, deterministic, index, mutable=["intermediates"])
    return h, state.get("intermediates", {})

  return jax.lax.scan(one, x, (variables, indices))


def _layers_after(schedule: Schedule, layer, after, x, positions, segment_ids, deterministic: bool, sow: bool):
  """The layers after the pipelined ones, on every stage, the batch split over stage too."""
  x = nn.with_logical_constraint(x, MICROBATCH_AXES[1:])
  indices = schedule.first_block + schedule.pipelined_layers + jnp.arange(schedule.num_layers - schedule.pipelined_layers)
  return _apply_layers(layer, after, x, positions, segment_ids, deterministic, indices, sow)


def _pipeline(schedule: Schedule, layer, pipe, x, positions, segment_ids, deterministic: bool, scanned, sow):
  """The pipelined layers on x (B, T, E), as schedule says (see pipeline_schedule's doc for the work items): (y, the
  sown intermediates as [stages, repeats, layers_per_stage, ...], combined over microbatches, or None)."""
  stages, micro, repeats, delay = schedule.stages, schedule.microbatches, schedule.repeats, schedule.delay
  per_stage = schedule.layers_per_stage
  # The embedding splits the rows over the batch axes and then stage (base.yml puts stage last, so a device's rows
  # are a part of its rows without stage): gathering them over stage only is what the pipeline's inputs cost.
  x = nn.with_logical_constraint(x, MICROBATCH_AXES[1:])
  positions, segment_ids = (nn.with_logical_constraint(a, MICROBATCH_AXES[1:3]) for a in (positions, segment_ids))
  inputs = nn.with_logical_constraint(_microbatches(x, micro), MICROBATCH_AXES)
  positions, segment_ids = (_microbatches(a, micro) for a in (positions, segment_ids))
  stage_ids = jnp.arange(stages)
  per_use = {name for name in pipe if name != "params" and microbatch_combine.rule(name) is not None}

  def stage(variables, h, pos, seg, repeat, item, stage_id, sown):
    """One stage's work item `item` (a bubble when outside [0, micro x repeats)): its layers' output, and its sown
    buffer with their statistics filed under (repeat, microbatch)."""
    valid = (item >= 0) & (item < micro * repeats)
    slot = jnp.where(valid, item % micro, micro)  # the per-use collections' copy: the bubbles have their own
    variables = {
      name: jax.tree.map(lambda w: w[:, slot], tree) if name in per_use else tree for name, tree in variables.items()
    }
    indices = schedule.first_block + (repeat * stages + stage_id) * per_stage + jnp.arange(per_stage)
    rows = item % micro + micro * jnp.arange(h.shape[0])  # the microbatch's rows of the batch (_microbatches)
    with dropout.microbatch_rows(x.shape[0], rows):
      y, new = _apply_layers(layer, variables, h, pos, seg, deterministic, indices, sow)
    if sow:
      mb = item % micro
      sown = jax.tree.map(lambda b, n: b.at[repeat, :, mb].set(jnp.where(valid, n, b[repeat, :, mb])), sown, new)
    return y, sown

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
    # history[k]: the stages' outputs k + 1 iterations ago; buffer: (stages, micro, rows, T, E); sown: per stage
    history, buffer, sown = carry
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
    args = (weights, stage_in, positions[items % micro], segment_ids[items % micro], repeat, items, stage_ids)
    out, sown = jax.vmap(stage, spmd_axis_name="stage")(*args, sown)
    out = nn.with_logical_constraint(out, STATE_AXES)
    return ((out,) + history[:-1], buffer, sown), None

  state = nn.with_logical_constraint(jnp.zeros((stages, *inputs.shape[1:]), x.dtype), STATE_AXES)
  buffer = nn.with_logical_constraint(jnp.zeros((stages, *inputs.shape), x.dtype), BUFFER_AXES)
  sown = _sown_buffer(schedule, layer, pipe, per_use, inputs, positions, segment_ids, sow)
  sow = sown is not None
  carry = ((state,) * delay, buffer, sown)
  if scanned:
    carry, _ = jax.lax.scan(iteration, carry, jnp.arange(schedule.iterations))
  else:
    for t in range(schedule.iterations):
      carry, _ = iteration(carry, jnp.int32(t))
  history, buffer, sown = carry
  for k in range(delay):  # the last work items, which no iteration has taken off the last stage yet
    buffer = arrive(buffer, jnp.roll(history[k], 1, axis=0), jnp.int32(micro * repeats - 1 - k))
  outputs = nn.with_logical_constraint(buffer[0], MICROBATCH_AXES)  # stage 0's, on every stage
  y = nn.with_logical_constraint(microbatch_combine.rows(outputs), EMBEDDING_AXES)
  if sown is None:
    return y, None
  # [stages, repeats, per_stage, micro, ...] -> each layer's microbatches combined by their rules
  layers = jax.tree.map(lambda b: b.reshape(-1, *b.shape[3:]), sown)
  combined = jax.vmap(microbatch_combine.combined)(layers)
  return y, jax.tree.map(lambda c: c.reshape(stages, repeats, per_stage, *c.shape[1:]), combined)


def _sown_buffer(schedule: Schedule, layer, pipe, per_use, inputs, positions, segment_ids, sow: bool):
  """Zeros for every stage's sown statistics: [stages, repeats, layers_per_stage, microbatches, ...]; None: none."""
  if not sow:
    return None

  def one_layer():
    lead = {name: (0, 0, 0, 0) if name in per_use else (0, 0, 0) for name in pipe}
    variables = {name: jax.tree.map(lambda w, i=lead[name]: w[i], tree) for name, tree in pipe.items()}
    args = (inputs[0], positions[0], segment_ids[0], True, 0)
    return layer.apply(variables, *args, mutable=["intermediates"])[1].get("intermediates", {})

  shapes = jax.eval_shape(one_layer)
  if not jax.tree.leaves(shapes):
    return None
  lead = (schedule.stages, schedule.repeats, schedule.layers_per_stage, schedule.microbatches)
  return jax.tree.map(lambda s: jnp.zeros((*lead, *s.shape), s.dtype), shapes)
