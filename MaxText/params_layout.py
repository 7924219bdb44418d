"""Params checkpoints in either layer layout: scanned (`decoder/layers`, stacked on param_scan_axis) or per-layer
(`decoder/layers_<i>`). A checkpoint is restored in its own layout, then stacked or unstacked on the devices
into the layout of the run (scan_layers), so load_parameters_path takes either whatever the run uses.
"""

import jax
from jax.sharding import NamedSharding, PartitionSpec

from MaxText import layer_stacking


def is_scanned(params) -> bool:
  """Whether a params tree (arrays, abstract arrays or checkpoint metadata) has scanned layers."""
  return "layers" in params.get("decoder", {})


def _num_blocks(decoder: dict) -> int:
  return sum(1 for k in decoder if k.startswith("layers_") and k[len("layers_") :].isdigit())


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


def in_layout(abstract_params: dict, scanned: bool, num_blocks: int, scan_axis: int) -> dict:
  """The run's abstract params (ShapeDtypeStructs with shardings) in the given layer layout."""
  if is_scanned(abstract_params) == scanned:
    return abstract_params
  decoder = abstract_params["decoder"]
  if scanned:  # per-layer run, scanned checkpoint
    out = {k: v for k, v in decoder.items() if not k.startswith("layers_")}
    out["layers"] = jax.tree.map(lambda a: _with_axis(a, min(scan_axis, a.ndim), num_blocks), decoder["layers_0"])
  else:  # scanned run, per-layer checkpoint
    out = {k: v for k, v in decoder.items() if k != "layers"}
    for i in range(num_blocks):
      out[f"layers_{i}"] = jax.tree.map(lambda a: _with_axis(a, scan_axis, None), decoder["layers"])
  return dict(abstract_params, decoder=out)


def saved_layout(saved_params, abstract_params: dict, scan_axis: int) -> dict:
  """The run's abstract params in the layout of a checkpoint (its metadata tree `saved_params`)."""
  # The run's block count: a checkpoint with other layers then fails check_checkpoint_fits, naming them.
  if is_scanned(abstract_params):
    stacked = jax.tree.leaves(abstract_params["decoder"]["layers"])[0]
    blocks = stacked.shape[min(scan_axis, stacked.ndim - 1)]
  else:
    blocks = _num_blocks(abstract_params["decoder"])
  return in_layout(abstract_params, is_scanned(saved_params), blocks, scan_axis)


def to_run_layout(params: dict, abstract_params: dict, scan_axis: int) -> dict:
  """Restored params (in the checkpoint's layout) in the run's layout, placed on the run's shardings."""
  if is_scanned(params) == is_scanned(abstract_params):
    return params
  shardings = jax.tree.map(lambda a: a.sharding, abstract_params)

  def relayout(p):
    if is_scanned(p):
      decoder = layer_stacking.unstack_layers(p["decoder"], _num_blocks(abstract_params["decoder"]), scan_axis)
    else:
      decoder = layer_stacking.stack_layers(p["decoder"], _num_blocks(p["decoder"]), scan_axis)
    return dict(p, decoder=decoder)

  return jax.jit(relayout, out_shardings=shardings)(params)
