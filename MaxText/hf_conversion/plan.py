"""Expands a family's tables over layers and experts: which slice of which MaxText array is which HF tensor.

The same plan serves both directions; the MaxText arrays (key path -> shape) come from the model (HF -> MaxText)
or from the checkpoint (MaxText -> HF), in either layout: scanned (`decoder/layers`, layers stacked on
param_scan_axis) or per-layer (`decoder/layers_<i>`).
"""

import dataclasses
import re

import numpy as np

from MaxText.errors import UserError
from MaxText.hf_conversion import tables

_PER_LAYER = re.compile(r"layers_(\d+)$")


@dataclasses.dataclass(frozen=True)
class Slice:
  """One HF tensor and where it goes: array[index] (index: an int on stacked axes, slice(None) elsewhere)."""

  index: tuple
  hf_name: str
  op: str


@dataclasses.dataclass
class Array:
  """A MaxText param (key path below `params`), its full shape, the axes indexed per slice, and its slices."""

  keys: tuple
  shape: tuple
  stacked_axes: tuple
  slices: list

  @property
  def slice_shape(self) -> tuple:
    return tuple(n for axis, n in enumerate(self.shape) if axis not in self.stacked_axes)


def _rule_for(keys: tuple, family, scan_axis: int):
  """(rule, layer index or None, layer axis or None) of a MaxText param."""
  layer_rules = {p.maxtext: p for p in family.layer_params}
  if len(keys) > 2 and keys[0] == "decoder" and keys[1] == "layers":
    return layer_rules.get("/".join(keys[2:])), None, scan_axis
  match = _PER_LAYER.match(keys[1]) if len(keys) > 2 and keys[0] == "decoder" else None
  if match:
    return layer_rules.get("/".join(keys[2:])), int(match.group(1)), None
  return {p.maxtext: p for p in family.global_params}.get("/".join(keys)), None, None


def plan(family, shapes: dict, scan_axis: int, tied: bool, where: str) -> list[Array]:
  """The slices of every MaxText array.

  Args:
    family: a tables.Family.
    shapes: {key path below params (tuple of str): shape}.
    scan_axis: param_scan_axis (where scanned layers are stacked).
    tied: logits_via_embedding (no separate logits kernel).
    where: what the shapes describe, for messages.
  """
  arrays, used = [], set()
  for keys, shape in shapes.items():
    rule, layer, layer_axis = _rule_for(keys, family, scan_axis)
    if rule is None:
      raise UserError(f"{where} has params/{'/'.join(keys)}, which the {family.name} conversion table does not know")
    used.add(rule)
    stacked = []
    if layer_axis is not None:
      stacked.append(layer_axis)
    expert_axis = None
    if rule.experts:
      expert_axis = 0 if layer_axis is None or layer_axis > 0 else 1
      stacked.append(expert_axis)
    layers = range(shape[layer_axis]) if layer_axis is not None else [layer]
    experts = range(shape[expert_axis]) if expert_axis is not None else [None]
    slices = []
    for i in layers:
      for e in experts:
        index = [slice(None)] * len(shape)
        if layer_axis is not None:
          index[layer_axis] = i
        if expert_axis is not None:
          index[expert_axis] = e
        hf_layer = None if i is None else i * family.layers_per_block + rule.layer_offset
        slices.append(Slice(tuple(index), rule.hf.format(i=hf_layer, e=e), rule.op))
    arrays.append(Array(tuple(keys), tuple(shape), tuple(sorted(stacked)), slices))
  wanted = {p for p in family.layer_params + family.global_params if not (tied and p.untied_only)}
  missing = sorted(p.maxtext for p in wanted - used)
  if missing:
    raise UserError(f"{where} lacks {', '.join(missing)} of the {family.name} conversion table (another model or layout?)")
  return arrays


def hf_tensors(arrays: list[Array]) -> list[tuple[str, tuple, str, "Array", Slice]]:
  """(hf name, hf shape, op, array, slice) of every slice, in plan order."""
  out = []
  for array in arrays:
    for s in array.slices:
      out.append((s.hf_name, tables.hf_shape(array.slice_shape, s.op), s.op, array, s))
  return out


def nbytes(shape: tuple, dtype) -> int:
  return int(np.prod(shape)) * np.dtype(dtype).itemsize
