"""Compiles train.py's train step for a compile_topology target and judges it: memory verdict and roofline.

The step, the state's shardings and the batch shapes are train.py's own (train_state.build and
train_step.lower_train_step); only the devices differ: the target's, described by aot_targets.
"""

import dataclasses
import re
import time

import jax

from MaxText import aot_targets, common_types, flops, max_logging, memory_check, roofline, train_state, train_step
from MaxText.mesh import create_device_mesh

GIB = 2**30
_SIZE = r"([\d.]+)([KMGT])"
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclasses.dataclass
class Outcome:
  """One compile for a target: the executable (None when the compiler ran out of memory) and its verdict."""

  config: object
  target: aot_targets.Target
  devices: list
  num_params: int
  compile_seconds: float
  memory_limit_bytes: int | None
  compiled: object = None
  memory: memory_check.CompiledMemory | None = None
  host_bytes: int = 0  # what the step keeps in host memory (remat_policy=minimal_offloaded)
  compiler_error: str = ""  # the compiler's out-of-memory message
  estimate: roofline.StepEstimate | None = None

  @property
  def fits(self) -> bool:
    """The TPU compiler checks the program against the chip's memory itself (an out-of-memory is a compile error),
    and its acceptance decides: the published 22B/52B (v4) and 32B (v5e) runs, which ran on their chips upstream,
    compile while their analysed parts add up to more than the chip. Other compilers do not check: the sum decides."""
    if self.compiler_error:
      return False
    if self.target.platform == "tpu" or self.memory is None or self.memory_limit_bytes is None:
      return True
    return self.memory.peak_bytes <= self.memory_limit_bytes

  @property
  def over_the_sum(self) -> bool:
    """Accepted by the TPU compiler although the analysed parts add up to more than the chip."""
    return (
      self.fits
      and self.memory is not None
      and bool(self.memory_limit_bytes)
      and (self.memory.peak_bytes > self.memory_limit_bytes)
    )

  def excess_bytes(self) -> int | None:
    """Bytes per device over the limit (at least this many, from the compiler's message); None if unknown."""
    if self.compiler_error:
      return _excess_from_message(self.compiler_error)
    if self.memory is None or self.memory_limit_bytes is None:
      return None
    return self.memory.peak_bytes - self.memory_limit_bytes


def _bytes(number: str, unit: str) -> int:
  return int(float(number) * _UNITS[unit])


def _excess_from_message(message: str) -> int | None:
  """The excess that an XLA out-of-memory message states (TPU: 'Exceeded hbm capacity by 4.75G', or
  'required for HLO temporaries (50.95G) exceeds available HBM (15.75G)')."""
  found = re.search(rf"[Ee]xceeded \w+ capacity by {_SIZE}", message)
  if found:
    return _bytes(*found.groups())
  found = re.search(rf"\({_SIZE}\) exceeds available \w+ \({_SIZE}\)", message)
  if found:
    need, unit, have, have_unit = found.groups()
    return _bytes(need, unit) - _bytes(have, have_unit)
  found = re.search(rf"Used {_SIZE} of {_SIZE}", message)
  if found:
    need, unit, have, have_unit = found.groups()
    return _bytes(need, unit) - _bytes(have, have_unit)
  return None


def is_out_of_memory(error: Exception) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "out of memory" in text.lower()


def memory_limit(target: aot_targets.Target, devices) -> int | None:
  """One device's memory: the chip's (TPU, GPU), or this host's share for cpu-N."""
  if target.chip.memory_bytes is not None:
    return target.chip.memory_bytes
  return memory_check.device_memory_bytes(devices[0])


def compile_for_target(config) -> Outcome:
  """Builds train.py's model, state and step for config.compile_topology and compiles it for that target.

  Args:
    config: a Config made with pyconfig.initialize(..., for_compile_topology=True).

  Returns:
    The Outcome; an out-of-memory from the compiler is an Outcome that does not fit, not an exception.
  """
  target = aot_targets.lookup(config.compile_topology)
  devices = aot_targets.devices(target, config.num_slices)
  mesh = create_device_mesh(config, devices)
  start = time.perf_counter()
  setup, lowered = _lowered(config, mesh)
  num_params = sum(x.size for x in jax.tree.leaves(setup.abstract_state.params))
  outcome = Outcome(config, target, devices, num_params, 0.0, memory_limit(target, devices))
  try:
    compiled = lowered.compile()
  except Exception as error:  # pylint: disable=broad-except
    if not is_out_of_memory(error):
      raise
    outcome.compiler_error = " ".join(str(error).split())
    outcome.compile_seconds = time.perf_counter() - start
    return outcome
  outcome.compile_seconds = time.perf_counter() - start
  outcome.compiled = compiled
  analysis = compiled.memory_analysis()
  outcome.memory = memory_check.CompiledMemory.from_analysis(analysis)
  if analysis is not None:
    outcome.host_bytes = int(getattr(analysis, "host_temp_size_in_bytes", 0)) + int(
      getattr(analysis, "host_argument_size_in_bytes", 0)
    )
  cost = _step_cost(config, mesh, compiled)
  outcome.estimate = roofline.estimate(config, cost, target.chip.device_kind, target.chip.memory_bandwidth_gbps)
  return outcome


def _lowered(config, mesh):
  """train.py's model, state layout and step, traced for the mesh (the compiled step's verdict covers the state)."""
  setup = train_state.build(config, mesh, check_memory=False)
  return setup, train_step.lower_train_step(setup.model, config, mesh, setup.abstract_state)


def _step_cost(config, mesh, compiled) -> roofline.Cost | None:
  """The step's cost per device; scanned layers are costed by two unrolled probes (see roofline's doc)."""
  if not config.scan_layers:
    cost = roofline.Cost.of(compiled.cost_analysis())
    return cost * config.gradient_accumulation_steps if cost else None
  block = common_types.DECODER_LAYERS_PER_BLOCK.get(config.decoder_block, 1)
  probes = []
  for blocks in (1, 2):
    probe = config.replace(scan_layers=False, num_decoder_layers=blocks * block)
    try:
      probes.append(roofline.Cost.of(_lowered(probe, mesh)[1].compile().cost_analysis()))
    except Exception as error:  # pylint: disable=broad-except  # an estimate must not fail the verdict
      max_logging.warn(f"no step-time estimate: compiling a {blocks * block}-layer probe failed: {error}")
      return None
  if None in probes:
    return None
  return roofline.step_cost(*probes, config.num_decoder_layers // block, config.gradient_accumulation_steps)


def _in_gib(num_bytes: int) -> str:  # the verdict's unit, whatever the size
  return f"{num_bytes / GIB:.2f} GiB"


def _gib(num_bytes: int) -> str:
  return memory_check.format_bytes(num_bytes)


def verdict(outcome: Outcome) -> str:
  """The verdict line: `fits` with the headroom, or `does not fit` with the excess (and the compiler's message)."""
  limit = outcome.memory_limit_bytes
  of_device = f"a {outcome.target.chip.device_kind} device" + (f" ({_in_gib(limit)})" if limit else "")
  if outcome.fits:
    if outcome.over_the_sum:
      return (
        f"Verdict: fits, with no headroom to spare on {of_device}: the TPU compiler accepted it (it checks the program "
        f"against the chip's memory), though the analysed parts add up to {_in_gib(outcome.memory.peak_bytes)}"
      )
    if outcome.memory is None or limit is None:
      return f"Verdict: fits (the compiler raised no out-of-memory; it gave no memory analysis to measure {of_device})"
    return f"Verdict: fits, with {_in_gib(limit - outcome.memory.peak_bytes)} of headroom per device on {of_device}"
  excess = outcome.excess_bytes()
  amount = f" by {'at least ' if outcome.compiler_error else ''}{_in_gib(excess)} per device" if excess is not None else ""
  if outcome.compiler_error:
    compiler = f"; the compiler says: {outcome.compiler_error}"
  else:
    compiler = " (by the compiler's memory analysis; this compiler does not check memory itself)"
  return f"Verdict: does not fit{amount} on {of_device}{compiler}"


def report(outcome: Outcome) -> list[str]:
  """The lines train_compile.py prints: target, memory analysis, verdict, analytic FLOPs and the estimate."""
  config, target = outcome.config, outcome.target
  slices = f" x {config.num_slices} slices" if config.num_slices > 1 else ""
  axes = zip(config.mesh_axes, config.ici_parallelism, config.dcn_parallelism)
  mesh = ", ".join(
    f"{axis}={ici * dcn}" + (f" ({dcn} across slices)" if dcn > 1 else "") for axis, ici, dcn in axes if ici * dcn > 1
  )
  lines = [
    f"Target: {target.name}{slices} = {len(outcome.devices)} devices ({target.chip.device_kind}), mesh {mesh or 'of 1'}",
    f"Model: {outcome.num_params:,} parameters; global batch {config.global_batch_size_to_train_on} "
    f"rows of {config.max_target_length} tokens (per_device_batch_size={config.per_device_batch_size:g}), "
    f"remat_policy={config.remat_policy}, attention={config.attention}",
    f"Compile time: {outcome.compile_seconds:.1f} s",
  ]
  memory = outcome.memory
  if memory is not None:
    limit = outcome.memory_limit_bytes
    lines += [
      "Memory per device (compiler's analysis):",
      f"  arguments       {_gib(memory.argument_bytes):>12}  (train state and batch)",
      f"  outputs         {_gib(memory.new_output_bytes):>12}  (not written into donated arguments)",
      f"  temporaries     {_gib(memory.temp_bytes):>12}  (activations and scratch)",
      f"  generated code  {_gib(memory.code_bytes):>12}",
      f"  total           {_gib(memory.peak_bytes):>12}" + (f" of {_gib(limit)}" if limit else ""),
    ]
    if outcome.host_bytes:
      lines.append(f"  host memory     {_gib(outcome.host_bytes):>12}  (offloaded activations, not counted above)")
  lines.append(verdict(outcome))
  lines.append(flops.describe(flops.training_tflops_per_device(config)))
  if outcome.estimate is not None:
    lines.append(outcome.estimate.describe())
  return lines
