"""Compiles the train step ahead of time, and judges it: for this host's devices (train.py's pre-flight, with the
memory verdict and its advice), from a file that train_compile.py wrote (compiled_trainstep_file), or for a
compile_topology target (memory verdict and roofline).

The step, the state's shardings and the batch shapes are train.py's own (training_setup.build and
lower_train_step); for a target only the devices differ: the target's, described by aot_targets.
"""

import dataclasses
import os
import re
import time

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from MaxText import feature_protocol, max_logging
from MaxText.aot import compiled_step_file, hlo_ops, interconnect, roofline
from MaxText.errors import UserError
from MaxText.input_pipeline.packing import BATCH_KEYS
from MaxText.layers import remat
from MaxText.runtime import aot_targets, memory_check, sharding
from MaxText.runtime.mesh import create_device_mesh
from MaxText.training import flops, jit_steps, training_setup

# --- this host's devices ---------------------------------------------------------------------------------------


def abstract_batch(config, mesh, features=()) -> dict:
  """One global train batch as jax.ShapeDtypeStructs on the data sharding: what every input pipeline yields, with the
  keys that the features' host_batch adds (each feature's batch_shapes)."""
  shape = (config.global_batch_size_to_load, config.max_target_length)
  shapes = feature_protocol.apply_all(features, "batch_shapes", {key: (shape, jnp.int32) for key in BATCH_KEYS})
  data_sharding = sharding.data_sharding(config, mesh)
  return {key: jax.ShapeDtypeStruct(shape, dtype, sharding=data_sharding) for key, (shape, dtype) in shapes.items()}


def lower_train_step(setup, config, mesh):
  """The jitted train step traced on shapes only (for train.py's pre-flight and train_compile.py's AOT compile).

  Args:
    setup, config, mesh: as compile_train_step; setup.abstract_state's shardings are the step's.

  Returns:
    A jax.stages.Lowered; `.compile()` compiles it for the mesh's devices (local, or an AOT target's).
  """
  state_shardings = jax.tree.map(lambda x: x.sharding, setup.abstract_state)
  with sharding.logical_context(mesh, config):
    return jit_steps.jit_train_step(setup.model, config, setup.features, mesh, state_shardings).lower(
      setup.abstract_state, abstract_batch(config, mesh, setup.features)
    )


def compile_train_step(setup, config, mesh, memory_limit_bytes: int | None = None):
  """The train step compiled ahead of time, after checking that one step fits a device's memory.

  This is train.py's pre-flight check: it needs no allocated state or batch, so a model that cannot fit
  stops before anything is allocated; the loop then calls the executable it returns, so nothing compiles twice.

  Args:
    setup: training_setup.build's (the model, the features, the abstract state of sharded jax.ShapeDtypeStructs).
    config: the Config.
    mesh: the device mesh.
    memory_limit_bytes: one device's memory; default: what a local device has.

  Returns:
    The compiled step, called as compiled(state, batch) -> (new_state, metrics); it donates `state`.

  Raises:
    UserError: a step needs more memory per device than a device has; the message names the keys that help.
  """
  compiled = lower_train_step(setup, config, mesh).compile()
  _check_memory(config, compiled, memory_limit_bytes)
  return throwing_step(config, compiled)


def throwing_step(config, compiled):
  """The compiled step as the loop calls it: with max_checkify, one that raises checkify's error (one line naming the
  op and the step) instead of returning it."""
  if not config.max_checkify:
    return compiled

  def step(state, batch):
    error, (new_state, metrics) = compiled(state, batch)
    try:
      error.throw()
    except checkify.JaxRuntimeError as found:
      message = " ".join(str(found).split())
      raise UserError(f"max_checkify: step {int(new_state.step) - 1}: {message}{_where(found)}") from None
    return new_state, metrics

  return step


def _where(found: Exception) -> str:
  """' (at <file>:<line> in <function>)': the MaxText code whose op failed a check, innermost first."""
  info = getattr(found.__cause__, "traceback_info", None)
  for frame in getattr(info, "frames", ()):
    if f"{os.sep}MaxText{os.sep}" in frame.file_name and "site-packages" not in frame.file_name:
      return f" (at {frame.file_name}:{frame.line_num} in {frame.function_name})"
  return ""


def _check_memory(config, compiled, memory_limit_bytes: int | None) -> None:
  memory = memory_check.CompiledMemory.from_analysis(compiled.memory_analysis())
  if memory is not None:
    device = jax.local_devices()[0]
    limit = memory_check.device_memory_bytes(device) if memory_limit_bytes is None else memory_limit_bytes
    memory_check.check_fits(
      memory.peak_bytes,
      limit,
      what="one train step needs",
      device_kind=device.device_kind,
      breakdown=memory.breakdown(),
      advice=_memory_advice(config, device.platform),
    )
    of_limit = f" of the {memory_check.format_bytes(limit)} a device has" if limit else ""
    max_logging.log(
      f"One train step needs {memory_check.format_bytes(memory.peak_bytes)} per device{of_limit} ({memory.breakdown()})"
    )


def load_compiled_train_step(setup, config, mesh):
  """The step that train_compile.py compiled into config.compiled_trainstep_file, instead of compiling it here.

  Raises:
    UserError: the file is missing, or was compiled for other shapes, config values or devices (named).
  """
  step = jit_steps.step_function(setup.model, config, setup.features)
  with sharding.logical_context(mesh, config):
    compiled = compiled_step_file.load(
      config.compiled_trainstep_file,
      config,
      jax.devices(),
      step,
      setup.abstract_state,
      abstract_batch(config, mesh, setup.features),
    )
  max_logging.log(f"Loaded the compiled train step from {config.compiled_trainstep_file}")
  return throwing_step(config, compiled)


def _memory_advice(config, platform: str) -> str:
  """The config keys that make a train step smaller, with their values now."""
  keep_batch = "; raise gradient_accumulation_steps to keep the batch" if config.per_device_batch_size >= 2 else ""
  hints = [
    f"lower per_device_batch_size (now {config.per_device_batch_size:.10g}{keep_batch}) or max_target_length "
    f"(now {config.max_target_length})"
  ]
  if config.remat_policy != "full":  # "full" keeps the fewest activations for the backward pass
    hints.append(f"recompute activations with remat_policy=full (now {config.remat_policy})")
  hints.append("shard over more devices (ici_fsdp_parallelism)")
  cpu_sized = "; the README quickstart's keys fit a CPU" if platform == "cpu" else ""
  hints.append(f"or use a smaller model (base_emb_dim, base_mlp_dim, base_num_decoder_layers, vocab_size{cpu_sized})")
  return ", ".join(hints)


# --- a compile_topology target ----------------------------------------------------------------------------------

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
  num_collectives: int = 0
  num_operations: int = 0  # runs of top-level operations per step (hlo_ops)
  serial: hlo_ops.SerialTime | None = None  # the step's operations one after another
  parse_seconds: float = 0.0

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
  num_params = feature_protocol.parameter_count(setup.features, setup.abstract_state.params)
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
  text = compiled.as_text()
  comm, outcome.num_collectives, outcome.parse_seconds = interconnect.communication(
    text, target, list(mesh.devices.flat), config.num_slices
  )
  start = time.perf_counter()
  found = hlo_ops.ops(text, _routed_rows(config))
  chip = target.chip
  peak = roofline.peak_tflops(chip.device_kind) or 0.0
  outcome.serial = hlo_ops.serial_time(
    found, peak * 1e12, chip.memory_bandwidth_gbps * 1e9, chip.clock_ghz * 1e9, _routed_rows(config)
  )
  outcome.estimate = roofline.estimate(config, outcome.serial, chip.device_kind, chip.memory_bandwidth_gbps, comm)
  outcome.num_operations = sum(op.count for op in found)
  outcome.parse_seconds += time.perf_counter() - start
  return outcome


def _routed_rows(config) -> int | None:
  """The rows one device's experts multiply per microbatch: its tokens times the experts each token goes to (with
  expert parallelism a device receives as many, on average, as it sends); None without MoE."""
  if config.num_experts <= 1:
    return None
  return int(config.per_device_batch_size * config.max_target_length * config.num_experts_per_tok)


def _lowered(config, mesh):
  """train.py's model, state layout and step, traced for the mesh (the compiled step's verdict covers the state)."""
  setup = training_setup.build(config, mesh, check_memory=False)
  return setup, lower_train_step(setup, config, mesh)


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
      named = remat.offloaded(config)
      what = f"offloaded activations: {', '.join(named)}" if named else "offloaded activations"
      lines.append(f"  host memory     {_gib(outcome.host_bytes):>12}  ({what}; not counted above)")
  lines.append(verdict(outcome))
  lines.append(flops.describe(flops.training_tflops_per_device(config)))
  if outcome.estimate is not None:
    lines.append(
      f"Operations: {outcome.num_operations} runs of operations and {outcome.num_collectives} collectives in the "
      f"compiled step, read in {outcome.parse_seconds:.1f} s"
    )
    lines += outcome.estimate.lines()
  serial = outcome.serial
  if serial is not None and serial.dense_groups > 0.05 * serial.seconds:
    lines.append(
      f"Grouped matmuls: {serial.dense_groups:.3f} s of the step run dense over every expert group (ragged_dot's weight "
      f"gradient compiles to a masked convolution); over their routed rows only they would take "
      f"{serial.dense_groups_by_rows:.3f} s"
    )
  return lines
