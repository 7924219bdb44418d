"""Params checkpoints in either layer layout: scanned (`decoder/layers`, stacked on param_scan_axis) or per-layer
(`decoder/layers_<i>`); likewise for each stack of a family with several (DeepSeek's dense_layers and moe_layers),
and for a multimodal model's vision encoder (`vision_encoder/layers`), which scan_layers lays out as the decoder.
A checkpoint is restored in its own layout, then stacked or unstacked on the devices into the layout of the run
(scan_layers), so load_parameters_path takes either whatever the run uses.
"""

import re

import jax
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.checkpoints import layer_stacking
from MaxText.configuration.common_types import STACK_NAMES

_PER_LAYER = re.compile(rf"({'|'.join(STACK_NAMES)})_(\d+)")
_STACKED = ("decoder", "vision_encoder")  # the modules whose layers scan_layers stacks


def is_scanned(params) -> bool:
  """Whether a params tree (arrays, abstract arrays or checkpoint metadata) has scanned layers."""
  return any(name in params.get("decoder", {}) for name in STACK_NAMES)


def _unrolled_stacks(decoder: dict) -> dict[str, int]:
  """The stacks of a per-layer decoder tree: name -> blocks (<name>_0 .. <name>_{n-1})."""
  stacks = {}
  for key in decoder:
    match = _PER_LAYER.fullmatch(key)
    if match:
      stacks[match.group(1)] = stacks.get(match.group(1), 0) + 1
  return stacks


def _scanned_stacks(decoder: dict, scan_axis: int) -> dict[str, int]:
  """The stacks of a scanned decoder tree (abstract arrays): name -> blocks, from the stacked axis."""
  stacks = {}
  for name in STACK_NAMES:
    if name in decoder:
      stacked = jax.tree.leaves(decoder[name])[0]
      stacks[name] = stacked.shape[min(scan_axis, stacked.ndim - 1)]
  return stacks


def _with_axis(abstract, axis: int, size: int | None):
  """The abstract array with `size` inserted at `axis` (or, with size None, that axis removed); sharding follows."""
  shape = list(abstract.shape)
  sharding = abstract.sharding
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec)) if isinstance(sharding, NamedSharding) else None
  if size is None:
    del shape[axis]
    if spec is not None:
      del spec[axis]
  else:
    shape.insert(axis, size)
    if spec is not None:
      spec.insert(axis, None)
  if spec is not None:
    sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
  return jax.ShapeDtypeStruct(tuple(shape), abstract.dtype, sharding=sharding)


def in_layout(abstract_params: dict, scanned: bool, stacks: dict[str, dict[str, int]], scan_axis: int) -> dict:
  """The run's abstract params (ShapeDtypeStructs with shardings) in the given layer layout; stacks: module -> stack
  name -> blocks."""
  if is_scanned(abstract_params) == scanned:
    return abstract_params
  return dict(abstract_params, **{m: _module_in_layout(abstract_params[m], scanned, stacks[m], scan_axis) for m in stacks})


def _module_in_layout(module: dict, scanned: bool, stacks: dict[str, int], scan_axis: int) -> dict:
  decoder = dict(module)
  for stack, blocks in stacks.items():
    if scanned:  # per-layer run, scanned checkpoint
      first = decoder[f"{stack}_0"]
      decoder = {k: v for k, v in decoder.items() if not (_PER_LAYER.fullmatch(k) and k.startswith(f"{stack}_"))}
      decoder[stack] = jax.tree.map(lambda a, n=blocks: _with_axis(a, min(scan_axis, a.ndim), n), first)
    else:  # scanned run, per-layer checkpoint
      stacked = decoder.pop(stack)
      for i in range(blocks):
        decoder[f"{stack}_{i}"] = jax.tree.map(lambda a: _with_axis(a, scan_axis, None), stacked)
  return decoder


def _stacks(abstract_params: dict, scan_axis: int) -> dict[str, dict[str, int]]:
  """module -> its stacks (name -> blocks), of each module that has layers."""
  scanned = is_scanned(abstract_params)
  modules = [m for m in _STACKED if m in abstract_params]
  return {
    m: _scanned_stacks(abstract_params[m], scan_axis) if scanned else _unrolled_stacks(abstract_params[m]) for m in modules
  }


def saved_layout(saved_params, abstract_params: dict, scan_axis: int) -> dict:
  """The run's abstract params in the layout of a checkpoint (its metadata tree `saved_params`)."""
  # The run's block counts: a checkpoint with other layers then fails check_checkpoint_fits, naming them.
  return in_layout(abstract_params, is_scanned(saved_params), _stacks(abstract_params, scan_axis), scan_axis)


def to_run_layout(params: dict, abstract_params: dict, scan_axis: int) -> dict:
  """Restored params (in the checkpoint's layout) in the run's layout, placed on the run's shardings."""
  if is_scanned(params) == is_scanned(abstract_params):
    return params
  shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
  stacks = _stacks(abstract_params, scan_axis)

  def relayout(p):
    change = layer_stacking.unstack_all if is_scanned(p) else layer_stacking.stack_all
    return dict(p, **{m: change(p[m], stacks[m], scan_axis) for m in stacks})

  return jax.jit(relayout, out_shardings=shardings)(params)
