"""A predicted step time and MFU for a compiled train step: compute, memory traffic and communication.

- Compute: the compiled program's FLOPs at the chip's peak. Memory: its bytes of HBM traffic at the HBM bandwidth.
  The two overlap (the larger is the roofline of the computation).
- Communication: every collective of the compiled program (hlo_collectives), with its loops' trip counts, costed on
  the target's links (interconnect: ICI rings within a slice, DCN between slices).
- Overlap: collectives inside a loop (the scanned layers) run while the neighbouring layers compute, so only what
  exceeds the layers' share of the computation shows; collectives outside loops (the embedding's, the final
  gradient reductions across slices) are exposed and add to the step.

The estimate assumes the compiler reaches the roofline on each side (every FLOP at peak, every byte at full
bandwidth): it is a bound from first principles, not fitted to measurements.

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


def layers_share(one_block: Cost, two_blocks: Cost, num_blocks: int) -> float:
  """The share of the step's FLOPs that the layer blocks do (the rest: embedding, logits, optimizer)."""
  per_block = (two_blocks - one_block).flops * num_blocks
  total = (one_block - (two_blocks - one_block)).flops + per_block
  return min(max(per_block / total, 0.0), 1.0) if total > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Communication:
  """Seconds per step of the step's collectives: within slices (ICI) or between them (DCN), in loops or not."""

  ici_loop: float = 0.0
  ici: float = 0.0
  dcn_loop: float = 0.0
  dcn: float = 0.0

  @property
  def loop(self) -> float:
    return self.ici_loop + self.dcn_loop


@dataclasses.dataclass(frozen=True)
class StepEstimate:
  """One device's view of one train step."""

  model_tflops: float  # analytic, as MFU counts them (flops.training_tflops_per_device)
  compiled_tflops: float  # what the compiled program executes, recomputation included
  compiled_gbytes: float  # its memory traffic
  peak_tflops: float
  bandwidth_gbps: float
  layers_share: float = 0.0  # of the computation, in the layer loops (where collectives hide)
  comm: Communication = Communication()

  @property
  def compute_seconds(self) -> float:
    return self.compiled_tflops / self.peak_tflops

  @property
  def memory_seconds(self) -> float:
    return self.compiled_gbytes / self.bandwidth_gbps

  @property
  def computation_seconds(self) -> float:
    return max(self.compute_seconds, self.memory_seconds)

  @property
  def exposed_loop_seconds(self) -> float:
    """What the loops' collectives take beyond the layers' computation they overlap with."""
    return max(0.0, self.comm.loop - self.computation_seconds * self.layers_share)

  @property
  def step_seconds(self) -> float:
    return self.computation_seconds + self.exposed_loop_seconds + self.comm.ici + self.comm.dcn

  @property
  def bound(self) -> str:
    parts = {
      "compute": self.compute_seconds,
      "memory bandwidth": self.memory_seconds,
      "ICI": self.comm.ici + self.comm.ici_loop,
      "DCN": self.comm.dcn + self.comm.dcn_loop,
    }
    return max(parts, key=parts.get)

  @property
  def mfu(self) -> float:
    return self.model_tflops / (self.step_seconds * self.peak_tflops) if self.step_seconds else 0.0

  def lines(self) -> list[str]:
    """The breakdown, then the `Estimate ... MFU x%` line."""
    c = self.comm
    return [
      f"Step time breakdown: compute {self.compute_seconds:.3f} s ({self.compiled_tflops:.3f} TFLOPs at "
      f"{self.peak_tflops:g} TFLOP/s), HBM {self.memory_seconds:.3f} s ({self.compiled_gbytes:.2f} GB at "
      f"{self.bandwidth_gbps:g} GB/s), ICI {c.ici_loop + c.ici:.3f} s ({c.ici_loop:.3f} in the layer loops), "
      f"DCN {c.dcn_loop + c.dcn:.3f} s ({c.dcn_loop:.3f} in the layer loops); the loops' collectives overlap "
      f"{100 * self.layers_share:.0f}% of the computation, {self.exposed_loop_seconds:.3f} s of them show",
      f"Estimate: {self.step_seconds:.3f} s per step, {self.bound} bound, MFU {100 * self.mfu:.1f}%",
    ]


def estimate(
  config,
  cost: Cost | None,
  device_kind: str,
  bandwidth_gbps: float,
  layers_share: float = 0.0,
  comm: Communication | None = None,
) -> StepEstimate | None:
  """The estimate of one train step on one device.

  Args:
    config: the Config the step was compiled for.
    cost: the step's cost per device (step_cost, or Cost.of the compiled step when it has no loops).
    device_kind: the target device's kind (flops.py knows its peak); "cpu" uses flops.CPU_TFLOPS_ESTIMATE.
    bandwidth_gbps: the device's memory bandwidth (aot_targets.Chip).
    layers_share: the share of the computation in the layer loops (layers_share()).
    comm: the step's communication (interconnect.step_seconds); None: none.

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
    layers_share=layers_share,
    comm=comm or Communication(),
  )
