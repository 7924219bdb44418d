"""How long a step's collectives take on a target's links: a per-chip link table, and ring costs per collective.

Within a TPU slice the chips sit on a 2D (v5e, v6e) or 3D (v4, v5p) grid of ICI links, a torus along a dimension that
wraps around. A collective over a group of chips runs as rings along the grid dimensions its group spans, all at
once: along a dimension that wraps, a ring sends both ways (2 links per chip); along one that does not, it can use
only one way's worth (the ring has to come back along the same line). So the group's bandwidth per chip is the
one-way link bandwidth times the usable links of its spanned dimensions. Between slices every transfer goes over the
data-center network (DCN), at the chip's share of its host's network bandwidth. On a GPU cluster (a3), NVLink joins
the 8 GPUs of a host through NVSwitch and the hosts' NICs join the hosts.

Ring costs, per device holding `size` bytes of a collective over n devices at bandwidth B:
  all-gather, reduce-scatter: (n - 1) / n * size / B;   all-reduce: 2 (n - 1) / n * size / B;
  all-to-all: (n - 1) / n * size / B (each device sends all but its own part);   collective-permute: size / B.
The link figures are aot_targets.CHIPS', next to each chip's HBM.
A group that spans slices is costed hierarchically: within each slice, then across the slices at DCN bandwidth on
1 / (its devices per slice) of the bytes (every chip of a slice sends its own part).
"""

import dataclasses
import time

from MaxText.aot import hlo_collectives, roofline


@dataclasses.dataclass(frozen=True)
class Device:
  """Where one device of the program's device assignment sits: its slice (TPU) or host (GPU), and its chip's
  coordinates in the slice's grid."""

  slice: int
  coords: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Fabric:
  """The links of a target, as one chip sees them.

  Attributes:
    link_gbps: one ICI link's bandwidth each way (NVLink through NVSwitch for GPUs), GB/s.
    dims: the slice's grid of chips, e.g. (4, 4, 4); () for a switched fabric (NVSwitch), where any group gets the
      full link_gbps.
    wrap: whether each dimension wraps around (a torus).
    dcn_gbps: one chip's share of the network between slices (hosts for GPUs), GB/s each way.
  """

  link_gbps: float
  dims: tuple[int, ...]
  wrap: tuple[bool, ...]
  dcn_gbps: float

  def group_bandwidth(self, members: list[Device]) -> float:
    """GB/s per chip of a ring collective over chips of one slice: one link's worth per spanned dimension, two where
    the group spans all of a dimension that wraps around."""
    if not self.dims:
      return self.link_gbps
    links = 0
    for axis, (size, wraps) in enumerate(zip(self.dims, self.wrap)):
      spanned = {d.coords[axis] for d in members} if members and len(members[0].coords) > axis else set()
      if len(spanned) > 1:
        links += 2 if wraps and len(spanned) == size else 1
    return self.link_gbps * max(links, 1)


def fabric(chip, dims: tuple[int, ...] = (), wrap: tuple[bool, ...] = ()) -> Fabric:
  """The links of an aot_targets.Chip on a slice of `dims` chips (() for a switched fabric)."""
  return Fabric(chip.ici_link_gbps, tuple(dims), tuple(wrap) + (False,) * (len(dims) - len(wrap)), chip.dcn_gbps)


_RING_FACTOR = {"all-gather": 1.0, "reduce-scatter": 1.0, "all-reduce": 2.0, "all-to-all": 1.0}


def ring_seconds(kind: str, size: float, n: int, gbps: float) -> float:
  """The closed-form ring time of one collective (see the module doc); 0 for a group of one."""
  if n <= 1 or size <= 0:
    return 0.0
  if kind == "collective-permute":
    return size / (gbps * 1e9)
  return _RING_FACTOR.get(kind, 2.0) * (n - 1) / n * size / (gbps * 1e9)


@dataclasses.dataclass(frozen=True)
class Seconds:
  """One collective's time per run, split into links within a slice and the network between slices."""

  ici: float = 0.0
  dcn: float = 0.0


def collective_seconds(kind: str, size: float, members: list[Device], fabric_: Fabric, num_slices: int) -> Seconds:
  """The time of one run of a collective over `members` (every device of the program when empty).

  Args:
    kind: the collective (hlo_collectives.KINDS).
    size: the bytes one device holds of it (hlo_collectives.Collective.bytes).
    members: the devices of one of its groups (they all cost the same on a regular grid).
    fabric_: the target's links.
    num_slices: the slices of the run, for a group that the compiler left to the multi-slice runtime.
  """
  slices: dict[int, list[Device]] = {}
  for device in members:
    slices.setdefault(device.slice, []).append(device)
  per_slice = max((len(v) for v in slices.values()), default=1)
  ici = ring_seconds(kind, size, per_slice, fabric_.group_bandwidth(next(iter(slices.values()), [])))
  across = len(slices) if slices else num_slices
  dcn = ring_seconds(kind, size / per_slice, across, fabric_.dcn_gbps) if across > 1 else 0.0
  return Seconds(ici, dcn)


def step_seconds(found, placement: list[Device], fabric_: Fabric, num_slices: int) -> dict[str, float]:
  """The step's communication time, {"ici_loop", "ici", "dcn_loop", "dcn"}: in loops (that can overlap with the
  layers' compute) or not.

  Args:
    found: hlo_collectives.collectives(...) of the compiled step.
    placement: the device of each id of the program's device assignment.
    fabric_: the target's links.
    num_slices: the run's slices.
  """
  totals = dict.fromkeys(("ici_loop", "ici", "dcn_loop", "dcn"), 0.0)
  for c in found:
    if c.cross_slice:  # handed to the multi-slice runtime: one chip per slice, each with its own part
      seconds = Seconds(dcn=ring_seconds(c.kind, c.bytes, num_slices, fabric_.dcn_gbps))
    else:
      group = c.groups[0] if c.groups else range(len(placement))
      members = [placement[i] for i in group if i < len(placement)]
      if c.kind == "collective-permute":  # a pair: over the network or one link
        crosses = len({m.slice for m in members}) > 1
        seconds = (
          Seconds(dcn=c.bytes / (fabric_.dcn_gbps * 1e9)) if crosses else Seconds(ici=c.bytes / (fabric_.link_gbps * 1e9))
        )
      else:
        seconds = collective_seconds(c.kind, c.bytes, members, fabric_, num_slices)
    suffix = "_loop" if c.in_loop else ""
    totals["ici" + suffix] += c.count * seconds.ici
    totals["dcn" + suffix] += c.count * seconds.dcn
  return totals


def placement(devices) -> list[Device]:
  """The device of each id of a program compiled for `devices` (the mesh's devices, in order): its slice (a TPU's
  slice_index; a GPU's process, i.e. host) and its chip's coordinates."""
  return [
    Device(
      int(d.process_index if d.platform == "gpu" else getattr(d, "slice_index", 0) or 0),
      tuple(getattr(d, "coords", ()) or ()),
    )
    for d in devices
  ]


def dims_of(topology: str) -> tuple[int, ...]:
  """(4, 4, 4) from a libtpu topology name such as "v4:4x4x4"; () when it names none."""
  shape = topology.rsplit(":", 1)[-1]
  try:
    return tuple(int(x) for x in shape.split("x"))
  except ValueError:
    return ()


def communication(hlo_text: str, target, devices, num_slices: int) -> tuple[roofline.Communication, int, float]:
  """(the step's communication, how many collectives it has, the seconds this took) for a program compiled for
  `devices` (the mesh's, in order) of an aot_targets.Target."""
  start = time.perf_counter()
  found = hlo_collectives.collectives(hlo_text)
  links = fabric(target.chip, dims_of(target.topology), target.wrap) if target.platform == "tpu" else fabric(target.chip)
  seconds = step_seconds(found, placement(devices), links, num_slices)
  return roofline.Communication(**seconds), len(found), time.perf_counter() - start
