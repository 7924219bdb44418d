"""A predicted step time and MFU for a compiled train step: its operations one after another, and communication.

- Computation: every operation of the compiled program (hlo_ops: each fusion, custom kernel, copy, ... with the
  trip counts of the loops around it) takes the TPU compiler's own cycle estimate at the chip's clock, or else the
  roofline max(FLOPs / peak, bytes / HBM bandwidth) of its own FLOPs and bytes; the TensorCore runs them one at a
  time, so their times add up. A memory-bound fusion (a norm, the rotary embedding, the optimizer's update) does not
  hide behind the matmuls. Opaque kernels (flash attention) get the model's attention FLOPs at peak (flops.py),
  or their bytes at bandwidth if longer. The program's FLOPs at peak are a floor (the model's, for kernels the text
  does not describe).
- Communication: every collective of the compiled program (hlo_collectives), with its loops' trip counts, costed on
  the target's links (interconnect: ICI rings within a slice, DCN between slices).
- Overlap: collectives inside a loop (the scanned layers) run while the neighbouring layers compute, so only what
  exceeds the layers' share of the computation shows; collectives outside loops (the embedding's, the final
  gradient reductions across slices) are exposed and add to the step.

Nothing is fitted to measured runs: the figures are the compiler's cost model and the chips' published peak, clock
and bandwidth (aot_targets.CHIPS).
"""

import dataclasses

from MaxText.aot import hlo_ops
from MaxText.training import flops


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
  operations_seconds: float = 0.0  # the operations one after another (hlo_ops); 0: unknown, the totals' roofline
  compute_bound_seconds: float = 0.0  # the part of operations_seconds in compute-bound operations
  from_cycles: float = 0.0  # the part of operations_seconds that the compiler's cycle estimates give

  @property
  def compute_seconds(self) -> float:
    return self.compiled_tflops / self.peak_tflops

  @property
  def memory_seconds(self) -> float:
    return self.compiled_gbytes / self.bandwidth_gbps

  @property
  def computation_seconds(self) -> float:
    if not self.operations_seconds:
      return max(self.compute_seconds, self.memory_seconds)
    return max(self.operations_seconds, self.compute_seconds)

  @property
  def memory_bound_seconds(self) -> float:
    """The computation's time in memory-bound operations (the rest is compute-bound)."""
    if not self.operations_seconds:
      return self.memory_seconds
    return max(0.0, self.operations_seconds - self.compute_bound_seconds)

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
      "compute": self.computation_seconds - self.memory_bound_seconds if self.operations_seconds else self.compute_seconds,
      "memory bandwidth": self.memory_bound_seconds,
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
    operations = ""
    if self.operations_seconds:
      operations = (
        f"operations {self.computation_seconds:.3f} s one after another "
        f"({self.computation_seconds - self.memory_bound_seconds:.3f} s compute-bound, "
        f"{self.memory_bound_seconds:.3f} s memory-bound; "
        f"{100 * self.from_cycles / self.operations_seconds:.0f}% from the compiler's cycle estimates), "
      )
    return [
      f"Step time breakdown: {operations}compute {self.compute_seconds:.3f} s ({self.compiled_tflops:.3f} TFLOPs at "
      f"{self.peak_tflops:g} TFLOP/s), HBM {self.memory_seconds:.3f} s ({self.compiled_gbytes:.2f} GB at "
      f"{self.bandwidth_gbps:g} GB/s), ICI {c.ici_loop + c.ici:.3f} s ({c.ici_loop:.3f} in the layer loops), "
      f"DCN {c.dcn_loop + c.dcn:.3f} s ({c.dcn_loop:.3f} in the layer loops); the loops' collectives overlap "
      f"{100 * self.layers_share:.0f}% of the computation, {self.exposed_loop_seconds:.3f} s of them show",
      f"Estimate: {self.step_seconds:.3f} s per step, {self.bound} bound, MFU {100 * self.mfu:.1f}%",
    ]


def estimate(
  config,
  serial: hlo_ops.SerialTime | None,
  device_kind: str,
  bandwidth_gbps: float,
  comm: Communication | None = None,
) -> StepEstimate | None:
  """The estimate of one train step on one device.

  Args:
    config: the Config the step was compiled for.
    serial: the compiled step's operations one after another (hlo_ops.serial_time at this device's figures).
    device_kind: the target device's kind (flops.py knows its peak); "cpu" uses flops.CPU_TFLOPS_ESTIMATE.
    bandwidth_gbps: the device's memory bandwidth (aot_targets.Chip).
    comm: the step's communication (interconnect.communication); None: none.

  Returns:
    The estimate, or None without operations or a known peak for the device.
  """
  peak = peak_tflops(device_kind)
  if serial is None or not peak or serial.seconds <= 0:
    return None
  step_flops = flops.training_tflops_per_device(config)
  # Opaque kernels (flash attention) hide their FLOPs from the text: the model's attention FLOPs stand for them.
  opaque_tflops = step_flops.attention_tflops if serial.opaque else 0.0
  opaque_seconds = max(opaque_tflops / peak, serial.opaque_bytes_seconds)
  operations = serial.seconds + opaque_seconds
  compute_bound = serial.compute_bound + (opaque_seconds if opaque_tflops / peak >= serial.opaque_bytes_seconds else 0)
  return StepEstimate(
    model_tflops=step_flops.total_tflops,
    # The model's own FLOPs are a floor: kernels that the text does not describe (GPU library calls) do them.
    compiled_tflops=max(serial.flops / 1e12 + opaque_tflops, step_flops.total_tflops),
    compiled_gbytes=serial.bytes / 1e9,
    peak_tflops=peak,
    bandwidth_gbps=bandwidth_gbps,
    layers_share=min(1.0, (serial.in_loops + (opaque_seconds if serial.opaque else 0.0)) / operations),
    comm=comm or Communication(),
    operations_seconds=operations,
    compute_bound_seconds=compute_bound,
    from_cycles=serial.from_cycles,
  )


def peak_tflops(device_kind: str) -> float | None:
  """One device's peak TFLOP/s; "cpu": flops.CPU_TFLOPS_ESTIMATE."""
  return flops.CPU_TFLOPS_ESTIMATE if device_kind == "cpu" else flops.peak_tflops_per_device(device_kind)
