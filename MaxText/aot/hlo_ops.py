"""The compute and memory time of a compiled program, operation by operation, read from its HLO text.

A TensorCore runs the operations of its program one at a time (a fusion, a custom kernel, a copy, ...): a
memory-bound fusion (a norm, the rotary embedding, a softmax, the optimizer's update) does not overlap the matmuls
around it. So the computation takes the sum of its operations' times, each the longer of its FLOPs at the peak and
its bytes at the HBM bandwidth, times the trip counts of the loops around it.

Each top-level operation of the entry and of the loop bodies, branches and calls (not the instructions inside a
fusion, which run within it) is read as an Op:
- flops: 2 x output elements x contracted size for each dot and convolution inside it (the kernel positions that
  meet the input, not its padding or dilation holes); 1 per element for elementwise arithmetic and reductions.
- bytes: its operands' and its result's sizes; an operand that a fusion only slices (one layer of a stacked weight)
  counts the slices, and a dynamic-update-slice in place writes the update only.
- cycles: the TPU compiler's own estimate of the operation, window_config.estimated_cycles in its backend_config
  (libtpu writes one for every fusion, copy and other op it emits itself). It covers the MXU's tile granularity, the
  vector units and the layouts: the compiler's first-principles figure, preferred to the roofline when present.
- opaque: a custom kernel (Pallas/Mosaic tpu_custom_call: flash attention) with no FLOPs in the text. The caller
  adds its FLOPs from the model (roofline).
- grouped matmuls (jax.lax.ragged_dot, MoE): the forward and the input gradient compile to a Mosaic kernel with a
  ragged_dot_tiling attribute, which runs the rows its groups hold: 2 x rows x contracted size x output columns, its
  rows being the lhs buffer's or, when the caller knows them, the routed rows (tokens x top-k; the HLO holds only
  the buffer, sized for the worst case). The weight gradient compiles (jax 0.10, libtpu 0.0.42) to a convolution
  over every expert group of the whole buffer, each group masking the rows of the others (a `pred[groups, rows]`
  operand): the TPU runs it dense, and the compiler's cycles say so. Such an op is marked `dense_groups`.
  megablox's Pallas kernels (`gmm` forward and input gradient, `tgmm` weight gradient; megablox=true) carry their own
  cost estimate, 2 x buffer rows x K x N over every row of the buffer, padding included, and no cycles: they are
  costed at that estimate scaled to the routed rows (the kernels skip the row tiles past the groups).

Free: parameters, tuples, bitcasts, constants, control flow (its bodies are counted), asynchronous copies and slices
(DMA engines, beside the TensorCore), and collectives (interconnect costs them).
"""

import dataclasses
import re

import numpy as np

from MaxText.aot import hlo_text

_FREE = {
  "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call", "after-all",
  "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "copy-start", "copy-done", "slice-start",
  "slice-done", "send", "send-done", "recv", "recv-done", "async-start", "async-update", "async-done", "iota",
}  # fmt: skip
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "ragged-all-to-all")
# Bookkeeping custom calls of the TPU compiler: no data moves (layout, allocation, index hints, collective fences).
_FREE_CUSTOM_CALLS = {
  "AllocateBuffer", "AssumeGatherIndicesInBound", "ConcatBitcast", "SliceId", "AsyncCollectiveStart",
  "AsyncCollectiveDone", "GatherScatterIndicesBitpacked",
}  # fmt: skip
_ELEMENTWISE = {
  "add", "subtract", "multiply", "divide", "maximum", "minimum", "exponential", "log", "tanh", "rsqrt", "sqrt",
  "power", "negate", "abs", "select", "compare", "convert", "logistic", "exponential-minus-one", "log-plus-one",
  "cosine", "sine", "clamp", "remainder", "atan2", "erf", "cbrt", "floor", "ceil", "round-nearest-even", "sign",
}  # fmt: skip
_SLICING = {"dynamic-slice", "slice", "gather"}
_CYCLES = re.compile(r'"estimated_cycles"\s*:\s*"(\d+)"')
_GROUPED_KERNEL = re.compile(r"^t?gmm(\.\d+)?$")  # megablox's Pallas kernels, named after their Python functions
_COST_FLOPS = re.compile(r'"cost_estimate"\s*:\s*\{\s*"flops"\s*:\s*"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r"kind=(k\w+)")


@dataclasses.dataclass(frozen=True)
class Op:
  """One top-level operation of the program, as one device runs it.

  Attributes:
    name: its HLO name.
    opcode: fusion, convolution, copy, custom-call, ...
    flops: per run (for an opaque kernel: what its shapes tell, 0 if nothing).
    bytes: of memory traffic per run.
    count: runs per run of the program (the trip counts of the loops around it).
    in_loop: whether a loop runs it.
    cycles: the compiler's estimate per run, in the chip's clock cycles; None if it wrote none.
    opaque: a custom kernel whose FLOPs the text does not give.
  """

  name: str
  opcode: str
  flops: float
  bytes: float
  count: int = 1
  in_loop: bool = False
  cycles: int | None = None
  opaque: bool = False
  dense_groups: tuple[int, int] | None = None  # (expert groups, rows) of a grouped matmul run dense over its groups

  def seconds(self, peak_flops: float, bytes_per_second: float, clock_hz: float = 0.0) -> float:
    """One run's time: the compiler's cycles at the clock, or else the roofline max(FLOPs / peak, bytes / bandwidth)."""
    if self.cycles is not None and clock_hz:
      return self.cycles / clock_hz
    return max(self.flops / peak_flops if peak_flops else 0.0, self.bytes / bytes_per_second if bytes_per_second else 0.0)

  def compute_bound(self, peak_flops: float, bytes_per_second: float) -> bool:
    return self.flops * bytes_per_second >= self.bytes * peak_flops


def _valid_positions(size_in: int, window: int, out: int, pad_low: int, stride: int, lhs_dilate: int, rhs_dilate: int):
  """Kernel positions that meet a real input element, over all output positions of one spatial dimension."""
  outputs = np.arange(out)[:, None] * stride - pad_low
  taps = np.arange(window)[None, :] * rhs_dilate
  at = outputs + taps  # position in the dilated input
  real = (at >= 0) & (at <= (size_in - 1) * lhs_dilate) & (at % lhs_dilate == 0)
  return int(real.sum())


def convolution_flops(instruction: hlo_text.Instruction, shapes: dict[str, str]) -> float:
  """2 x MACs of a convolution: for each output element, the kernel's input features times the kernel positions
  that meet the input (a dot written as a convolution, with heads or expert groups as spatial dimensions)."""
  rest = instruction.rest
  labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", rest)
  operands = instruction.operands
  if not labels or len(operands) < 2 or operands[1] not in shapes or operands[0] not in shapes:
    return 0.0
  lhs, rhs = hlo_text.dims(shapes[operands[0]]), hlo_text.dims(shapes[operands[1]])
  out = hlo_text.dims(instruction.shape)
  lhs_labels, rhs_labels, out_labels = labels.groups()
  if len(lhs) != len(lhs_labels) or len(rhs) != len(rhs_labels) or len(out) != len(out_labels):
    return 0.0
  macs_per_output = rhs[rhs_labels.index("i")]
  window = re.search(r"window=\{([^}]*)\}", rest)
  fields = dict(re.findall(r"(\w+)=([\dx_]+)", window.group(1))) if window else {}

  def field(key: str, n: int, default: int) -> list[int]:
    return [int(x) for x in fields[key].split("x")] if key in fields else [default] * n

  spatial = [c for c in rhs_labels if c.isdigit()]
  n = len(spatial)
  pads = [int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields else [0] * n
  strides, lhs_dilates, rhs_dilates = field("stride", n, 1), field("lhs_dilate", n, 1), field("rhs_dilate", n, 1)
  positions, outputs_spatial = 1.0, 1
  for k, label in enumerate(spatial):
    size_out = out[out_labels.index(label)]
    valid = _valid_positions(
      lhs[lhs_labels.index(label)], rhs[rhs_labels.index(label)], size_out, pads[k], strides[k], lhs_dilates[k],
      rhs_dilates[k],
    )  # fmt: skip
    positions *= valid / size_out  # per output position, on average
    outputs_spatial *= size_out
  return 2.0 * hlo_text.elements(instruction.shape) * macs_per_output * positions


def dot_flops(instruction: hlo_text.Instruction, shapes: dict[str, str]) -> float:
  """2 x output elements x the product of the lhs's contracting dimensions."""
  contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.rest)
  operands = instruction.operands
  if not operands or operands[0] not in shapes:
    return 0.0
  lhs = hlo_text.dims(shapes[operands[0]])
  size = 1
  for d in contracting.group(1).split(",") if contracting and contracting.group(1) else []:
    size *= lhs[int(d)]
  return 2.0 * hlo_text.elements(instruction.shape) * size


def _shapes(computation: hlo_text.Computation) -> dict[str, str]:
  return {i.name: i.shape for i in computation.instructions}


def fused_flops(program: dict[str, hlo_text.Computation], name: str) -> float:
  """FLOPs of one run of a fused computation (and of the fusions nested in it)."""
  computation = program.get(name)
  if computation is None:
    return 0.0
  shapes, total = _shapes(computation), 0.0
  for instruction in computation.instructions:
    opcode = instruction.opcode
    if opcode == "convolution":
      total += convolution_flops(instruction, shapes)
    elif opcode == "dot":
      total += dot_flops(instruction, shapes)
    elif opcode == "fusion":
      total += sum(fused_flops(program, c) for c in hlo_text.callees(opcode, instruction.rest))
    elif opcode in _ELEMENTWISE:
      total += hlo_text.elements(instruction.shape)
    elif opcode == "reduce" and instruction.operands and instruction.operands[0] in shapes:
      total += hlo_text.elements(shapes[instruction.operands[0]])
  return total


def _has_collective(program: dict[str, hlo_text.Computation], name: str) -> bool:
  computation = program.get(name)
  return computation is not None and any(i.opcode.removesuffix("-start") in _COLLECTIVES for i in computation.instructions)


def fused_bytes(program: dict[str, hlo_text.Computation], instruction: hlo_text.Instruction, shapes) -> float:
  """A fusion's memory traffic: each operand read once (only its slices, if the fusion only slices it), and its
  result written (only the update, for a dynamic-update-slice in place)."""
  called = [c for c in hlo_text.callees("fusion", instruction.rest) if c in program]
  if not called:
    return sum(hlo_text.array_bytes(shapes.get(o, "")) for o in instruction.operands) + hlo_text.array_bytes(
      instruction.shape
    )
  body = program[called[0]]
  parameters = {}  # parameter number -> its name in the body
  users: dict[str, list[hlo_text.Instruction]] = {}
  for inner in body.instructions:
    if inner.opcode == "parameter":
      parameters[int(re.match(r"\s*(\d+)", inner.rest).group(1))] = inner.name
    for operand in inner.operands:
      users.setdefault(operand, []).append(inner)
  root = body.instructions[-1] if body.instructions else None
  in_place = root is not None and root.opcode == "dynamic-update-slice" and root.operands
  total = 0.0
  for number, operand in enumerate(instruction.operands):
    inner_name = parameters.get(number)
    uses = users.get(inner_name, []) if inner_name else []
    if in_place and inner_name == root.operands[0]:
      continue  # the buffer updated in place: only the update moves
    if uses and all(u.opcode in _SLICING and u.operands[0] == inner_name for u in uses):
      total += sum(hlo_text.array_bytes(u.shape) for u in uses)
    else:
      total += hlo_text.array_bytes(shapes.get(operand, ""))
  if in_place and len(root.operands) > 1:
    return total + hlo_text.array_bytes(body.by_name[root.operands[1]].shape if root.operands[1] in body.by_name else "")
  return total + hlo_text.array_bytes(instruction.shape)


def _ragged_dot_flops(instruction: hlo_text.Instruction, shapes: dict[str, str], rows: int | None) -> float:
  """A grouped matmul kernel (lhs [buffer rows, K] by groups of [K, N]): 2 x rows x K x N, over the routed rows
  when known (at most the buffer's)."""
  arrays = [hlo_text.dims(shapes[o]) for o in instruction.operands if o in shapes]
  matrices = [d for d in arrays if len(d) >= 2]
  out = hlo_text.dims(instruction.shape)
  if len(matrices) < 2 or len(out) != 2:
    return 0.0
  lhs = matrices[-2]
  return 2.0 * min(lhs[0], rows or lhs[0]) * lhs[-1] * out[-1]


def _grouped_kernel_flops(name: str, estimate: float, shape: str, rows: int | None) -> float:
  """A megablox kernel's FLOPs over the routed rows: its own estimate (2 x buffer rows x K x N) x routed / buffer rows.

  gmm's output is (buffer rows, N); tgmm's is (groups, K, N), its buffer rows the estimate's quotient."""
  out = hlo_text.dims(shape)
  buffer_rows = out[0] if not name.startswith("tgmm") else estimate / (2.0 * out[-2] * out[-1])
  return estimate * min(1.0, (rows or buffer_rows) / buffer_rows) if buffer_rows else estimate


def _dense_groups(program, called: list[str]) -> tuple[int, int] | None:
  """(groups, rows) when a fusion is a grouped matmul written dense over its groups: a convolution over a pred[groups,
  rows] mask of the rows each group owns (how ragged_dot's weight gradient compiles)."""
  for name in called:
    body = program.get(name)
    if body is None or not any(i.opcode == "convolution" for i in body.instructions):
      continue
    for inner in body.instructions:
      mask = hlo_text.ARRAY.search(inner.shape)
      if inner.opcode == "parameter" and mask and mask.group(1) == "pred" and len(hlo_text.dims(inner.shape)) == 2:
        groups, rows = hlo_text.dims(inner.shape)
        return groups, rows
  return None


def _op(program, instruction: hlo_text.Instruction, shapes: dict[str, str], rows: int | None = None) -> Op | None:
  """The Op of one top-level instruction; None when it is free or communication."""
  name, shape, opcode, rest = instruction
  if opcode in _FREE or opcode.removesuffix("-start").removesuffix("-done") in _COLLECTIVES:
    return None
  cycles = _CYCLES.search(rest)
  cycles = int(cycles.group(1)) if cycles else None
  operand_bytes = sum(hlo_text.array_bytes(shapes.get(o, "")) for o in instruction.operands)
  if opcode == "fusion":
    called = hlo_text.callees(opcode, rest)
    if cycles is None and any(_has_collective(program, c) for c in called):
      return None  # a collective fusion (all-reduce-scatter): communication
    flops = sum(fused_flops(program, c) for c in called)
    grouped = _dense_groups(program, called)
    return Op(name, opcode, flops, fused_bytes(program, instruction, shapes), cycles=cycles, dense_groups=grouped)
  if opcode == "custom-call":
    target = _TARGET.search(rest)
    target = target.group(1) if target else ""
    if target in _FREE_CUSTOM_CALLS:
      return None
    moved = operand_bytes + hlo_text.array_bytes(shape)
    if "ragged_dot_tiling" in rest:
      return Op(name, opcode, _ragged_dot_flops(instruction, shapes, rows), moved, cycles=cycles)
    estimate = _COST_FLOPS.search(rest)
    if _GROUPED_KERNEL.match(name) and estimate and len(hlo_text.dims(shape)) >= 2:
      return Op(name, opcode, _grouped_kernel_flops(name, float(estimate.group(1)), shape, rows), moved, cycles=cycles)
    return Op(name, opcode, 0.0, moved, cycles=cycles, opaque=cycles is None and target != "ZeroCrop")
  if opcode == "dynamic-update-slice":  # in place: the update is read and written
    update = shapes.get(instruction.operands[1], "") if len(instruction.operands) > 1 else ""
    return Op(name, opcode, 0.0, 2 * hlo_text.array_bytes(update), cycles=cycles)
  if opcode in _SLICING:
    return Op(name, opcode, 0.0, 2 * hlo_text.array_bytes(shape), cycles=cycles)
  if opcode == "convolution":
    flops = convolution_flops(instruction, shapes)
  elif opcode == "dot":
    flops = dot_flops(instruction, shapes)
  elif opcode in _ELEMENTWISE:
    flops = float(hlo_text.elements(shape))
  else:
    flops = 0.0
  return Op(name, opcode, flops, operand_bytes + hlo_text.array_bytes(shape), cycles=cycles)


def ops(text: str, routed_rows: int | None = None) -> list[Op]:
  """Every top-level operation of a compiled program's HLO text, with its runs per run of the program.

  Args:
    text: the program's HLO text (`compiled.as_text()`).
    routed_rows: the rows one device's grouped matmuls (MoE experts) hold: tokens x top-k; None: their buffers'.
  """
  program, entry = hlo_text.computations(text)
  if entry is None:
    return []
  counts = hlo_text.run_counts(program, entry)
  found = []
  for name in sorted(hlo_text.scheduled(program, entry)):
    count, in_loop = counts[name]
    if count == 0:
      continue
    shapes = _shapes(program[name])
    for instruction in program[name].instructions:
      op = _op(program, instruction, shapes, routed_rows)
      if op is not None:
        found.append(dataclasses.replace(op, count=count, in_loop=in_loop))
  return found


@dataclasses.dataclass(frozen=True)
class SerialTime:
  """A program's operations run one after another on one device: seconds per run of the program.

  Attributes:
    seconds: the sum of every operation's time.
    compute_bound: the part spent in operations whose FLOPs at peak outlast their bytes at bandwidth.
    in_loops: the part spent in loops (the scanned layers, where collectives can overlap).
    from_cycles: the part that the compiler's own cycle estimates give.
    flops, bytes: the program's total FLOPs and bytes of memory traffic.
    opaque_bytes_seconds: the opaque kernels' bytes at bandwidth (their FLOPs are the caller's).
    opaque: how many opaque kernels run per run of the program.
    dense_groups: the part in grouped matmuls run dense over every group (Op.dense_groups).
    dense_groups_by_rows: what those would take over their routed rows only (seconds x rows / (groups x rows)).
  """

  seconds: float = 0.0
  compute_bound: float = 0.0
  in_loops: float = 0.0
  from_cycles: float = 0.0
  flops: float = 0.0
  bytes: float = 0.0
  opaque_bytes_seconds: float = 0.0
  opaque: int = 0
  dense_groups: float = 0.0
  dense_groups_by_rows: float = 0.0


def serial_time(
  found: list[Op], peak_flops: float, bytes_per_second: float, clock_hz: float = 0.0, routed_rows: int | None = None
) -> SerialTime:
  """The sum of the operations' times (Op.seconds) and its parts.

  Args:
    found: ops(...) of the program.
    peak_flops: one device's peak FLOP/s.
    bytes_per_second: its HBM bandwidth.
    clock_hz: the clock that the compiler's cycle estimates count (aot_targets.Chip.clock_ghz); 0: use none.
    routed_rows: as ops'; for dense_groups_by_rows.
  """
  seconds = compute = loops = cycles = flops = moved = opaque_seconds = dense = dense_by_rows = 0.0
  opaque = 0
  for op in found:
    if op.opaque:
      opaque += op.count
      opaque_seconds += op.count * op.bytes / bytes_per_second
      moved += op.count * op.bytes
      continue
    t = op.count * op.seconds(peak_flops, bytes_per_second, clock_hz)
    seconds += t
    compute += t if op.compute_bound(peak_flops, bytes_per_second) else 0.0
    loops += t if op.in_loop else 0.0
    cycles += t if op.cycles is not None and clock_hz else 0.0
    flops += op.count * op.flops
    moved += op.count * op.bytes
    if op.dense_groups:
      groups, rows = op.dense_groups
      dense += t
      dense_by_rows += t * min(rows, routed_rows or rows) / (groups * rows)
  return SerialTime(seconds, compute, loops, cycles, flops, moved, opaque_seconds, opaque, dense, dense_by_rows)
