"""The collectives of a compiled XLA program, read from its HLO text (`compiled.as_text()`).

For each all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute (synchronous, or the -start of an
asynchronous one, or inside a fusion), and for each cross-slice transfer that the TPU compiler hands to the
multi-slice (megascale) runtime as a host send: the bytes one device holds, its replica groups (device ids of the
program's device assignment), how many times one step runs it (the product of the trip counts of the loops around
it), and whether a loop runs it (a scanned layer stack, where it can overlap with the next layer's compute).

Parsing (computations, loops, trip counts) is hlo_text's.
"""

import dataclasses
import math
import re

import numpy as np

from MaxText.aot import hlo_text

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
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


def _balanced(text: str, start: int) -> str:
  """The {...} group that opens at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth == 0:
      return text[start : i + 1]
  return text[start:]


def _mesh_groups(rest: str) -> tuple[tuple[int, ...], ...] | None:
  """The mesh form replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}: the devices (row-major ids over the mesh)
  that differ only along the named axes form a group."""
  match = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
  if not match:
    return None
  axes = re.findall(r"'?([\w]+)'?\s*=\s*(\d+)", match.group(1))
  names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
  grouped = [names.index(a) for a in re.findall(r"'?(\w+)'?", match.group(2)) if a in names]
  kept = [i for i in range(len(names)) if i not in grouped]
  ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(kept + grouped)
  return tuple(tuple(int(i) for i in row) for row in ids.reshape(-1, math.prod(sizes[i] for i in grouped)))


def replica_groups(attributes: str) -> tuple[tuple[int, ...], ...]:
  """replica_groups={{0,1},{2,3}}, the iota form replica_groups=[2,4]<=[4,2]T(1,0), the mesh form
  replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, or source_target_pairs."""
  for key in ("replica_groups=", "source_target_pairs="):
    at = attributes.find(key)
    if at < 0:
      continue
    rest = attributes[at + len(key) :]
    mesh = _mesh_groups(rest)
    if mesh is not None:
      return mesh
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


def collectives(text: str) -> list[Collective]:
  """Every collective of a compiled program's HLO text, with its count per run of the program."""
  program, entry = hlo_text.computations(text)
  if entry is None:
    return []
  found = []
  for name, (count, in_loop) in hlo_text.run_counts(program, entry).items():
    for _, shape, opcode, rest in program[name].instructions:
      kind = opcode.removesuffix("-start")
      if kind in KINDS:
        size = hlo_text.largest_array(shape) if opcode.endswith("-start") else hlo_text.array_bytes(shape)
        groups = replica_groups(rest)
        if kind == "reduce-scatter":
          size *= len(groups[0]) if groups else 1  # the result is one part of the input
        found.append(Collective(kind, size, groups, count, in_loop))
      elif opcode == "send" and (megascale := _MEGASCALE.search(rest)):
        transfer = megascale.group(1).lower().replace("_", "-")
        found.append(Collective(transfer, hlo_text.largest_array(shape), (), count, in_loop, cross_slice=True))
  return found
