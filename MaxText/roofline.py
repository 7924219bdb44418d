"""A predicted step time and MFU for a compiled train step: a roofline over the compiler's cost analysis.

A step can go no faster than its FLOPs at the device's peak, nor than its memory traffic at the device's
bandwidth; the estimate is the larger of the two. It ignores communication and how well compute and memory
traffic overlap, so it is an optimistic bound, labelled as an estimate wherever it is printed.

XLA's cost analysis counts the body of a loop once, whatever its trip count, and over-counts the memory
traffic of a scanned body (it charges the stacked buffers it slices). So the cost of a scanned model comes from
two small unrolled probes, with one and with two layer blocks: their difference is one block's cost, the rest
is the embedding, logits and optimizer; the step costs the rest plus num_decoder_layers blocks.
Gradient accumulation is a loop too: the step costs gradient_accumulation_steps times its microbatch's program
(which counts the optimizer's update that many times: a small over-estimate).
"""

import dataclasses

from MaxText import flops


@dataclasses.dataclass(frozen=True)
class Cost:
  """What one device does in a program: FLOPs and bytes of memory traffic."""

  flops: float
  bytes: float

  @classmethod
  def of(cls, cost_analysis) -> "Cost | None":
    """From `compiled.cost_analysis()` (a dict, or a list of one dict in older jax); None without FLOPs."""
    analysis = cost_analysis[0] if isinstance(cost_analysis, (list, tuple)) else cost_analysis
    if not analysis or analysis.get("flops", -1) <= 0:
      return None
    return cls(float(analysis["flops"]), float(analysis.get("bytes accessed", 0.0)))

  def __add__(self, other: "Cost") -> "Cost":
    return Cost(self.flops + other.flops, self.bytes + other.bytes)

  def __sub__(self, other: "Cost") -> "Cost":
    return Cost(self.flops - other.flops, self.bytes - other.bytes)

  def __mul__(self, factor: float) -> "Cost":
    return Cost(self.flops * factor, self.bytes * factor)


def step_cost(one_block: Cost, two_blocks: Cost, num_blocks: int, gradient_accumulation_steps: int) -> Cost:
  """The whole step's cost from unrolled probes with one and two layer blocks (see the module doc)."""
  per_block = two_blocks - one_block
  return ((one_block - per_block) + per_block * num_blocks) * gradient_accumulation_steps


@dataclasses.dataclass(frozen=True)
class StepEstimate:
  """One device's view of one train step."""

  model_tflops: float  # analytic, as MFU counts them (flops.training_tflops_per_device)
  compiled_tflops: float  # what the compiled program executes, recomputation included
  compiled_gbytes: float  # its memory traffic
  peak_tflops: float
  bandwidth_gbps: float

  @property
  def compute_seconds(self) -> float:
    return self.compiled_tflops / self.peak_tflops

  @property
  def memory_seconds(self) -> float:
    return self.compiled_gbytes / self.bandwidth_gbps

  @property
  def step_seconds(self) -> float:
    return max(self.compute_seconds, self.memory_seconds)

  @property
  def bound(self) -> str:
    return "compute" if self.compute_seconds >= self.memory_seconds else "memory bandwidth"

  @property
  def mfu(self) -> float:
    return self.model_tflops / (self.step_seconds * self.peak_tflops) if self.step_seconds else 0.0

  def describe(self) -> str:
    return (
      f"Estimate (roofline over the compiler's cost analysis; ignores communication): {self.step_seconds:.3f} s per "
      f"step, {self.bound} bound ({self.compiled_tflops:.3f} TFLOPs at {self.peak_tflops:g} TFLOP/s, "
      f"{self.compiled_gbytes:.2f} GB at {self.bandwidth_gbps:g} GB/s), MFU {100 * self.mfu:.1f}%"
    )


def estimate(config, cost: Cost | None, device_kind: str, bandwidth_gbps: float) -> StepEstimate | None:
  """The roofline estimate of one train step on one device.

  Args:
    config: the Config the step was compiled for.
    cost: the step's cost per device (step_cost, or Cost.of the compiled step when it has no loops).
    device_kind: the target device's kind (flops.py knows its peak); "cpu" uses flops.CPU_TFLOPS_ESTIMATE.
    bandwidth_gbps: the device's memory bandwidth (aot_targets.Chip).

  Returns:
    The estimate, or None without a cost or a known peak for the device.
  """
  peak = flops.CPU_TFLOPS_ESTIMATE if device_kind == "cpu" else flops.peak_tflops_per_device(device_kind)
  if cost is None or not peak:
    return None
  model_tflops = flops.training_tflops_per_device(config).total_tflops
  return StepEstimate(
    model_tflops=model_tflops,
    # Custom kernels (attention=flash) are opaque to the cost analysis: the model's own FLOPs are a floor.
    compiled_tflops=max(cost.flops / 1e12, model_tflops),
    compiled_gbytes=cost.bytes / 1e9,
    peak_tflops=peak,
    bandwidth_gbps=bandwidth_gbps,
  )
