"""The collectives of a compiled XLA program, read from its HLO text (`compiled.as_text()`).

For each all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute (synchronous, or the -start of an
asynchronous one, or inside a fusion), and for each cross-slice transfer that the TPU compiler hands to the
multi-slice (megascale) runtime as a host send: the bytes one device holds, its replica groups (device ids of the
program's device assignment), how many times one step runs it (the product of the trip counts of the loops around
it), and whether a loop runs it (a scanned layer stack, where it can overlap with the next layer's compute).

A loop's trip count is XLA's known_trip_count when the compiler wrote one, else the constant its condition compares
the induction variable with (a loop from 0 counting up by 1, which is what scans and fori_loops compile to).
"""

import dataclasses
import functools
import math
import re

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {
  "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
  "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
  "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_CALLED = re.compile(r"\b(?:calls|body|true_computation|false_computation)=%?([\w.\-]+)")  # not reducers
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CONSTANT = re.compile(r"s(?:32|64)\[\](?:\{[^}]*\})?\s+constant\((\d+)\)")
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the step, as one device sees it.

  Attributes:
    kind: one of KINDS.
    bytes: what one device holds of it: the gathered result (all-gather), the input to scatter (reduce-scatter),
      the reduced buffer (all-reduce), the exchanged buffer (all-to-all), or the buffer sent (collective-permute).
    groups: the replica groups, device ids of the program's device assignment (empty: every device); for a
      collective-permute, its (source, target) pairs.
    count: how many times one step runs it.
    in_loop: whether a loop runs it.
    cross_slice: a transfer between slices that the compiler left to the multi-slice runtime (TPU megascale).
  """

  kind: str
  bytes: float
  groups: tuple[tuple[int, ...], ...]
  count: int
  in_loop: bool
  cross_slice: bool = False

  @property
  def group_size(self) -> int:
    return len(self.groups[0]) if self.groups else 0


def array_bytes(shape: str) -> float:
  """Bytes of an HLO shape: an array (bf16[8,128]{1,0}) or a tuple of them; layouts and tiling are ignored."""
  return sum(
    DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in _ARRAY.findall(shape)
  )


def _largest_array(shape: str) -> float:
  return max((array_bytes(f"{dtype}[{dims}]") for dtype, dims in _ARRAY.findall(shape)), default=0.0)


def _balanced(text: str, start: int) -> str:
  """The {...} group that opens at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth == 0:
      return text[start : i + 1]
  return text[start:]


def replica_groups(attributes: str) -> tuple[tuple[int, ...], ...]:
  """replica_groups={{0,1},{2,3}}, the iota form replica_groups=[2,4]<=[4,2]T(1,0), or source_target_pairs."""
  for key in ("replica_groups=", "source_target_pairs="):
    at = attributes.find(key)
    if at < 0:
      continue
    rest = attributes[at + len(key) :]
    if rest.startswith("["):  # iota: [groups, size]<=[reshape dims]T(permutation)
      match = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
      shape = [int(x) for x in match.group(1).split(",")]
      ids = np.arange(math.prod(int(x) for x in match.group(2).split(","))).reshape(
        [int(x) for x in match.group(2).split(",")]
      )
      if match.group(3):
        ids = ids.transpose([int(x) for x in match.group(3).split(",")])
      return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape[0], -1))
    text = _balanced(rest, 0)
    groups = tuple(tuple(int(i) for i in g.split(",") if i.strip()) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1]))
    return tuple(g for g in groups if g)
  return ()


@dataclasses.dataclass
class _Computation:
  instructions: list[tuple[str, str, str, str]]  # (name, shape, opcode, rest of the line)


def _computations(text: str) -> tuple[dict[str, _Computation], str | None]:
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = computations.setdefault(header.group(2), _Computation([]))
      if header.group(1):
        entry = header.group(2)
      continue
    if current is None:
      continue
    if line.strip() == "}":
      current = None
      continue
    instruction = _INSTRUCTION.match(line)
    if instruction:
      current.instructions.append(instruction.groups())
  return computations, entry


def _trip_count(rest: str, computations: dict[str, _Computation]) -> int:
  known = _TRIP.search(rest)
  if known:
    return int(known.group(1))
  condition = re.search(r"condition=%?([\w.\-]+)", rest)
  if condition and condition.group(1) in computations:
    for _, shape, opcode, line in computations[condition.group(1)].instructions:
      constant = _CONSTANT.search(f"{shape} {opcode}({line}")
      if constant:
        return int(constant.group(1))
  return 1


def _callees(opcode: str, rest: str) -> list[str]:
  callees = _CALLED.findall(rest)
  if opcode == "call":  # elsewhere to_apply names a reducer, which runs no collective
    callees += re.findall(r"to_apply=%?([\w.\-]+)", rest)
  branches = _BRANCHES.search(rest)
  if branches:
    callees += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
  return callees


def _multipliers(computations, entry) -> dict[str, tuple[int, bool]]:
  """computation -> (times one run of the entry runs it, whether a loop runs it), summed over its call sites."""
  callers = {}  # callee -> [(caller, trip count, called by a while)]
  for name, computation in computations.items():
    for _, _, opcode, rest in computation.instructions:
      trip = _trip_count(rest, computations) if opcode == "while" else 1
      for callee in _callees(opcode, rest):
        if callee in computations:
          callers.setdefault(callee, []).append((name, trip, opcode == "while"))

  @functools.cache
  def run(name: str) -> tuple[int, bool]:
    if name == entry:
      return 1, False
    total, looped = 0, False
    for caller, trip, is_while in callers.get(name, []):
      count, in_loop = run(caller)
      total += count * trip
      looped = looped or (count > 0 and (in_loop or is_while))
    return total, looped

  return {name: run(name) for name in computations}


def collectives(text: str) -> list[Collective]:
  """Every collective of a compiled program's HLO text, with its count per run of the program."""
  computations, entry = _computations(text)
  if entry is None:
    return []
  found = []
  for name, (count, in_loop) in _multipliers(computations, entry).items():
    for _, shape, opcode, rest in computations[name].instructions:
      kind = opcode.removesuffix("-start")
      if kind in KINDS:
        size = _largest_array(shape) if opcode.endswith("-start") else array_bytes(shape)
        groups = replica_groups(rest)
        if kind == "reduce-scatter":
          size *= len(groups[0]) if groups else 1  # the result is one part of the input
        found.append(Collective(kind, size, groups, count, in_loop))
      elif opcode == "send" and (megascale := _MEGASCALE.search(rest)):
        transfer = megascale.group(1).lower().replace("_", "-")
        found.append(Collective(transfer, _largest_array(shape), (), count, in_loop, cross_slice=True))
  return found
