"""The structure of a compiled XLA program's HLO text (`compiled.as_text()`): its computations, their instructions,
and how many times one run of the program runs each computation (the trip counts of the loops around it).

Shared by hlo_collectives (the step's communication) and hlo_ops (its operations' compute and memory time).

A loop's trip count is XLA's known_trip_count when the compiler wrote one, else the constant its condition compares
the induction variable with (a loop from 0 counting up by 1, which is what scans and fori_loops compile to).
"""

import dataclasses
import functools
import math
import re

DTYPE_BYTES = {
  "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
  "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
  "c128": 16,
}  # fmt: skip
ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_CALLED = re.compile(r"\b(?:calls|body|true_computation|false_computation)=%?([\w.\-]+)")  # not reducers
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CONSTANT = re.compile(r"s(?:32|64)\[\](?:\{[^}]*\})?\s+constant\((\d+)\)")
_OPERAND = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One line of a computation: `name = shape opcode(rest`, where rest holds the operands and the attributes."""

  name: str
  shape: str
  opcode: str
  rest: str

  def __iter__(self):  # unpacks as (name, shape, opcode, rest)
    return iter((self.name, self.shape, self.opcode, self.rest))

  @functools.cached_property
  def operands(self) -> list[str]:
    """The names of its operands, in order."""
    depth = 1
    for i, char in enumerate(self.rest):
      depth += {"(": 1, ")": -1}.get(char, 0)
      if depth == 0:
        return _OPERAND.findall(self.rest[:i])
    return _OPERAND.findall(self.rest)


@dataclasses.dataclass
class Computation:
  instructions: list[Instruction]

  @functools.cached_property
  def by_name(self) -> dict[str, Instruction]:
    return {i.name: i for i in self.instructions}


def array_bytes(shape: str) -> float:
  """Bytes of an HLO shape: an array (bf16[8,128]{1,0}) or a tuple of them; layouts and tiling are ignored."""
  return sum(
    DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in ARRAY.findall(shape)
  )


def largest_array(shape: str) -> float:
  return max((array_bytes(f"{dtype}[{dims}]") for dtype, dims in ARRAY.findall(shape)), default=0.0)


def dims(shape: str) -> tuple[int, ...]:
  """The dimensions of an array shape (its first array for a tuple)."""
  found = ARRAY.search(shape)
  return tuple(int(d) for d in found.group(2).split(",") if d) if found else ()


def elements(shape: str) -> int:
  return math.prod(dims(shape))


def computations(text: str) -> tuple[dict[str, Computation], str | None]:
  """(every computation of the program by name, the entry's name)."""
  found, entry, current = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = found.setdefault(header.group(2), Computation([]))
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
      current.instructions.append(Instruction(*instruction.groups()))
  return found, entry


def trip_count(rest: str, program: dict[str, Computation]) -> int:
  """The trip count of a while loop whose attributes are `rest`."""
  known = _TRIP.search(rest)
  if known:
    return int(known.group(1))
  condition = re.search(r"condition=%?([\w.\-]+)", rest)
  if condition and condition.group(1) in program:
    for _, shape, opcode, line in program[condition.group(1)].instructions:
      constant = _CONSTANT.search(f"{shape} {opcode}({line}")
      if constant:
        return int(constant.group(1))
  return 1


def callees(opcode: str, rest: str) -> list[str]:
  """The computations an instruction runs: fused computations, loop bodies, branches, called functions."""
  found = _CALLED.findall(rest)
  if opcode == "call":  # elsewhere to_apply names a reducer
    found += re.findall(r"to_apply=%?([\w.\-]+)", rest)
  branches = _BRANCHES.search(rest)
  if branches:
    found += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
  return found


def run_counts(program: dict[str, Computation], entry: str) -> dict[str, tuple[int, bool]]:
  """computation -> (times one run of the entry runs it, whether a loop runs it), summed over its call sites."""
  callers = {}  # callee -> [(caller, trip count, called by a while)]
  for name, computation in program.items():
    for _, _, opcode, rest in computation.instructions:
      trip = trip_count(rest, program) if opcode == "while" else 1
      for callee in callees(opcode, rest):
        if callee in program:
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

  return {name: run(name) for name in program}


def scheduled(program: dict[str, Computation], entry: str) -> set[str]:
  """The computations whose instructions the device runs one by one: the entry, and the bodies of its loops,
  branches and calls (not fused computations, whose instructions run inside their fusion, nor reducers)."""
  found, pending = set(), [entry]
  while pending:
    name = pending.pop()
    if name in found or name not in program:
      continue
    found.add(name)
    for _, _, opcode, rest in program[name].instructions:
      if opcode in ("while", "conditional", "call"):
        pending += callees(opcode, rest)
  return found
