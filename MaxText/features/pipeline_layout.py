"""Keeps checkpoints free of the pipeline layout.

A pipelined run holds each layer stack's params (and their optimizer state) with the layer axis in
pipeline_schedule.Schedule.memory_order, so that the `stage` axis, which splits the layer axis into contiguous
chunks, gives each stage exactly its layer groups. With one repeat of all layers that order is the model's own and
nothing happens here. Otherwise the state is put in memory order after it is initialised or restored (to_memory),
and back in the model's order for every save (to_logical), so a checkpoint is the same whatever the pipeline: it
restores into any number of stages or none, and decode.py, convert_checkpoint.py and
generate_param_only_checkpoint.py read it unchanged.

Cost: each save and restore reorders the stack's params and optimizer state along the layer axis on the devices,
one array at a time (its transient copy is one array, not the state), moving (stages - 1) / stages of each array
over the stage axis.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import feature_protocol
from MaxText.configuration import pipeline_schedule
from MaxText.layers import models


def _schedule(config):
  schedule = pipeline_schedule.resolve(config.get_keys())
  return schedule if schedule is not None and schedule.reorders_layers else None


def _in_stack(path, stack: str) -> bool:
  """Whether a state leaf belongs to the pipelined stack (decoder/<stack>/..., in the params, the optimizer state or
  a model collection)."""
  keys = [getattr(k, "key", None) for k in path]
  return any(a == "decoder" and b == stack for a, b in zip(keys, keys[1:]))


@functools.cache
def _reorder(order: tuple[int, ...], axis: int, sharding):
  return jax.jit(lambda x: jnp.take(x, jnp.asarray(order), axis=axis), out_shardings=sharding)


def _layer_axis(path, x, scan_axis: int) -> int:
  """The params (and their optimizer state) stack a stack's layers on param_scan_axis; the other model collections
  (the fp8 state) on axis 0 (models.STACKED_COLLECTIONS)."""
  names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
  return 0 if x.ndim < 2 or names & set(models.STACKED_COLLECTIONS) else scan_axis


def _reordered(tree, order: tuple[int, ...], scan_axis: int, stack: str):
  def one(path, x):
    if not _in_stack(path, stack) or not hasattr(x, "sharding"):
      return x
    # One at a time: the transient copy is one array, and on XLA:CPU two reorders in flight can interleave their
    # collective-permutes across the devices' threads and deadlock (seen with DeepSeek's many stacked arrays).
    return jax.block_until_ready(_reorder(order, _layer_axis(path, x, scan_axis), x.sharding)(x))

  return jax.tree_util.tree_map_with_path(one, tree)


def to_memory(state, config):
  """A state in the model's layer order (fresh or restored) -> the pipelined run's memory order."""
  schedule = _schedule(config)
  if schedule is None:
    return state
  return _reordered(state, schedule.memory_order(), config.param_scan_axis, schedule.stack)


def to_logical(state, config):
  """The pipelined run's state -> the model's layer order, as checkpoints hold it."""
  schedule = _schedule(config)
  if schedule is None:
    return state
  return _reordered(state, tuple(np.argsort(schedule.memory_order()).tolist()), config.param_scan_axis, schedule.stack)


class PipelineLayout(feature_protocol.Feature):
  """A pipelined run whose schedule reorders the layers holds its state in memory order between on_start and
  logical (every save, and the end of the loop). The other features' own_layout slots (another model, laid out by
  its own config) are left as they are."""

  name = "pipeline_layout"

  def __init__(self, config, others=()):
    self.config = config
    self.own_layout = {name for feature in others for name in feature.own_layout}

  def _apart(self, state, reorder):
    """reorder(state) applied to the state without the own_layout slots, which are then put back unchanged."""
    kept = {name: slot for name, slot in state.slots.items() if name in self.own_layout}
    state = reorder(state.replace(slots={name: slot for name, slot in state.slots.items() if name not in kept}))
    return state.replace(slots=state.slots | kept)

  def on_start(self, state):
    return self._apart(state, lambda s: to_memory(s, self.config))

  def logical(self, state):
    return self._apart(state, lambda s: to_logical(s, self.config))
