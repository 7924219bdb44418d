"""Will it fit? What a compiled program or a set of arrays needs per device, against what a device has.

The checks run before anything is allocated: train_state.build checks the arrays a path keeps (the whole
train state, or only the params), and train.py checks the compiled train step (arguments, temporaries and
new outputs, from the compiler's memory analysis). The verdict is a function of the numbers only, so a step
compiled for another topology (train_compile.py) can be checked against that target's memory.
"""

import dataclasses
import math
import os

import jax

from MaxText.errors import UserError

GIB = 2**30


def format_bytes(num_bytes: int) -> str:
  """GiB, or MiB below 1 GiB, with two decimals: '39.46 GiB', '3.25 MiB'."""
  if abs(num_bytes) >= GIB:
    return f"{num_bytes / GIB:.2f} GiB"
  return f"{num_bytes / 2**20:.2f} MiB"


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """Per-device bytes of one compiled program, from `compiled.memory_analysis()`."""

  argument_bytes: int  # inputs (for the train step: the state and the batch); live for the whole call
  output_bytes: int
  alias_bytes: int  # outputs written into donated argument buffers: counted once, as arguments
  temp_bytes: int  # activations kept for the backward pass and the compiler's scratch space
  code_bytes: int  # the program itself (on TPU/GPU it sits in device memory)

  @classmethod
  def from_analysis(cls, analysis) -> "CompiledMemory | None":
    """From a CompiledMemoryStats; None where the backend gives no analysis."""
    if analysis is None:
      return None
    return cls(
      argument_bytes=int(analysis.argument_size_in_bytes),
      output_bytes=int(analysis.output_size_in_bytes),
      alias_bytes=int(analysis.alias_size_in_bytes),
      temp_bytes=int(analysis.temp_size_in_bytes),
      code_bytes=int(analysis.generated_code_size_in_bytes),
    )

  @property
  def new_output_bytes(self) -> int:
    return self.output_bytes - self.alias_bytes

  @property
  def peak_bytes(self) -> int:
    """All arguments, outputs that do not reuse a donated argument, temporaries and code are live at once."""
    return self.argument_bytes + self.new_output_bytes + self.temp_bytes + self.code_bytes

  def breakdown(self) -> str:
    return (
      f"{format_bytes(self.argument_bytes)} arguments, {format_bytes(self.temp_bytes)} temporaries, "
      f"{format_bytes(self.new_output_bytes)} outputs not donated"
    )


def device_memory_bytes(device) -> int | None:
  """The memory one device may use: its allocator's limit, or on CPU the host's RAM shared by the local devices.

  Args:
    device: a jax.Device.

  Returns:
    Bytes, or None when the device does not say (then nothing is checked).
  """
  stats = device.memory_stats()
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  if device.platform == "cpu":
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(jax.local_device_count(), 1)
  return None


def bytes_per_device(abstract_tree) -> int:
  """Bytes that the leaves of a tree of sharded jax.ShapeDtypeStructs (or arrays) occupy on one device."""
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for x in jax.tree.leaves(abstract_tree)
    if getattr(x, "sharding", None) is not None
  )


def check_fits(
  needed_bytes: int, limit_bytes: int | None, *, what: str, device_kind: str, advice: str, breakdown: str = ""
) -> None:
  """The verdict: a UserError naming both numbers and what would help, when the need exceeds the limit.

  Args:
    needed_bytes: bytes per device (CompiledMemory.peak_bytes, bytes_per_device).
    limit_bytes: one device's memory (device_memory_bytes, or a target's); None skips the check.
    what: what needs the memory, with its verb (e.g. "one train step needs", "the params need").
    device_kind: the device, as jax names it (e.g. "TPU v5 lite", "cpu").
    advice: the config keys that would help, as the end of the sentence.
    breakdown: where the bytes go (CompiledMemory.breakdown()), shown in parentheses.
  """
  if limit_bytes is None or needed_bytes <= limit_bytes:
    return
  detail = f" ({breakdown})" if breakdown else ""
  raise UserError(
    f"{what} {format_bytes(needed_bytes)} per device{detail} but a {device_kind} device has "
    f"{format_bytes(limit_bytes)}: {advice}"
  )
