"""Expands a family's tables over layers and experts: which slice of which MaxText array is which HF tensor.

The same plan serves both directions; the MaxText arrays (key path -> shape) come from the model (HF -> MaxText)
or from the checkpoint (MaxText -> HF), in either layout: scanned (`decoder/layers`, layers stacked on
param_scan_axis) or per-layer (`decoder/layers_<i>`). A family with several stacks (DeepSeek's dense_layers, then
moe_layers) numbers HF layers on from one stack to the next.
"""

import dataclasses
import re

import numpy as np

from MaxText.configuration.common_types import STACK_NAMES
from MaxText.errors import UserError
from MaxText.hf_conversion import tables

_PER_LAYER = re.compile(rf"({'|'.join(STACK_NAMES)})_(\d+)")
_MTP_DEPTH = re.compile(r"mtp_(\d+)")
# The modules whose stacks the plan knows, and the prefix of their stacks' names in a Family (vision_layers).
_STACK_PARENTS = {"decoder": "", "vision_encoder": "vision_"}


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


def _stack_of(keys: tuple) -> tuple[str | None, int | None]:
  """(the stack a param belongs to, its block for a per-layer param) or (None, None) outside the stacks."""
  if len(keys) < 3 or keys[0] not in _STACK_PARENTS:
    return None, None
  prefix = _STACK_PARENTS[keys[0]]
  if keys[1] in STACK_NAMES:
    return prefix + keys[1], None
  match = _PER_LAYER.fullmatch(keys[1])
  return (prefix + match.group(1), int(match.group(2))) if match else (None, None)


def rule_for(keys: tuple, family, scan_axis: int):
  """(rule, stack or None, block index or None, layer axis or None) of a MaxText param. A multi-token prediction
  depth's params count as the "mtp" stack, block k - 1."""
  depth = _MTP_DEPTH.fullmatch(keys[1]) if len(keys) > 2 and keys[0] == "decoder" else None
  if depth:
    return {p.maxtext: p for p in family.mtp_params}.get("/".join(keys[2:])), "mtp", int(depth.group(1)) - 1, None
  stack, block = _stack_of(keys)
  if stack is None or stack not in family.stacks:
    return {p.maxtext: p for p in family.global_params}.get("/".join(keys)), None, None, None
  rule = {p.maxtext: p for p in family.layer_table(stack)}.get("/".join(keys[2:]))
  return rule, stack, block, (scan_axis if block is None else None)


def _first_blocks(family, shapes: dict, scan_axis: int) -> dict[str, int]:
  """Each stack's first block, counted over the stacks before it: stack -> offset."""
  blocks = {}
  for keys, shape in shapes.items():
    stack, block = _stack_of(keys)
    if stack is not None:
      count = shape[scan_axis] if block is None else block + 1
      blocks[stack] = max(blocks.get(stack, 0), count)
  offsets, first = {}, 0
  for stack in family.stacks:
    if stack in family.own_numbering:
      offsets[stack] = 0
      continue
    offsets[stack], first = first, first + blocks.get(stack, 0)
  offsets["mtp"] = first  # the depths follow the decoder's layers
  return offsets


def plan(family, shapes: dict, scan_axis: int, tied: bool, where: str) -> list[Array]:
  """The slices of every MaxText array.

  Args:
    family: a tables.Family.
    shapes: {key path below params (tuple of str): shape}.
    scan_axis: param_scan_axis (where scanned layers are stacked).
    tied: logits_via_embedding (no separate logits kernel).
    where: what the shapes describe, for messages.
  """
  arrays, used, stacks = [], set(), set()
  offsets = _first_blocks(family, shapes, scan_axis)
  for keys, shape in shapes.items():
    rule, stack, layer, layer_axis = rule_for(keys, family, scan_axis)
    stacks.add(stack)
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
        hf_layer = None if i is None else (offsets[stack] + i) * family.layers_per_block + rule.layer_offset
        slices.append(Slice(tuple(index), rule.hf.format(i=hf_layer, e=e), rule.op))
    arrays.append(Array(tuple(keys), tuple(shape), tuple(sorted(stacked)), slices))
  tables_used = [family.layer_table(stack) for stack in family.stacks if stack in stacks]
  tables_used += [family.mtp_params] if "mtp" in stacks else []
  wanted = {p for table in [*tables_used, family.global_params] for p in table}
  wanted = {p for p in wanted if not (p.optional or (tied and p.untied_only))}
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
