"""Trains a decoder LM:  python3 MaxText/train.py MaxText/configs/base.yml run_name=demo [key=value ...]

Builds the mesh, the sharded model and optimizer state, the input pipeline and a jitted train_step from
one validated config, then logs a line per step (loss, step time, TFLOP/s, tokens/s, MFU) to the
console, TensorBoard and an optional metrics file.
"""

import os
import sys
import time

if __package__ in (None, ""):  # Run as `python3 MaxText/train.py`: import MaxText from this checkout.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxText import pyconfig  # pylint: disable=wrong-import-position
from MaxText.errors import UserError  # pylint: disable=wrong-import-position
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=wrong-import-position


def _log_run_start(config, features, state) -> None:
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText import feature_protocol, max_logging  # pylint: disable=import-outside-toplevel
  from MaxText.training import flops

  device = jax.devices()[0]
  max_logging.log(
    f"System: jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} x {device.device_kind}, "
    f"process {jax.process_index()} of {jax.process_count()}"
  )
  max_logging.log("Config (value  # source):\n" + config.to_yaml())
  max_logging.log(f"Number of parameters: {feature_protocol.describe_parameters(features, state.params)}")
  step_flops = flops.training_tflops_per_device(config)
  max_logging.log(flops.describe(step_flops))
  if jax.default_backend() == "cpu" and step_flops.total_tflops > 1:
    max_logging.warn(
      f"a step of this model needs {step_flops.total_tflops:.1f} TFLOPs per device; CPU devices do about "
      f"{flops.CPU_TFLOPS_ESTIMATE} TFLOP/s, so expect about {step_flops.total_tflops / flops.CPU_TFLOPS_ESTIMATE:,.0f} s "
      "per step (the README quickstart has CPU-sized model keys)"
    )


def _prepare_run_dir(config) -> None:
  """Creates the run directory and writes the resolved config there, before any heavy work."""
  import jax  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel

  if jax.process_index() != 0:
    return
  try:
    epath.Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    (epath.Path(config.run_dir) / "config.yml").write_text(config.to_yaml())
  except OSError as e:
    raise UserError(f"cannot write the run directory {config.run_dir} (base_output_directory): {e.strerror or e}") from None


def train_loop(config):
  """Trains until config.steps (or an early stop: step_loop) and returns the final train state."""
  # pylint: disable=import-outside-toplevel
  from MaxText import max_logging
  from MaxText.aot import aot_compile
  from MaxText.checkpoints import checkpointing
  from MaxText.configuration import pipeline_schedule
  from MaxText.input_pipeline.input_pipeline_interface import create_data_iterator
  from MaxText.runtime import goodput, peer_monitor
  from MaxText.runtime.mesh import create_device_mesh
  from MaxText.training import emergency_checkpoint, starting_state, step_loop, training_setup
  from MaxText.training.evaluation import check_eval_data

  _prepare_run_dir(config)
  peer_monitor.set_resume_note(lambda: checkpointing.resume_note(config))  # for the line on a lost process
  events = goodput.recorder(config)
  events.event("job_start")
  mesh = create_device_mesh(config)
  if schedule := pipeline_schedule.resolve(config.get_keys()):
    max_logging.log(schedule.line())
  check_eval_data(config, mesh)  # a wrong eval split, glob or file stops the run now, not at step eval_interval
  setup = training_setup.build(config, mesh)
  data_iterator = create_data_iterator(config, mesh)  # data and tokenizer mistakes stop the run before the compile
  manager = local_tier = None
  try:
    started = time.perf_counter()
    if config.compiled_trainstep_file:  # compiled ahead of time by train_compile.py
      p_train_step = aot_compile.load_compiled_train_step(setup, config, mesh)
    else:  # Pre-flight: compile the step and check its memory before the state is allocated or restored.
      p_train_step = aot_compile.compile_train_step(setup, config, mesh)
    events.phase("compile", time.perf_counter() - started)
    manager = checkpointing.create_checkpoint_manager(config)
    local_tier = emergency_checkpoint.create(config)
    started = time.perf_counter()
    state, data_state = emergency_checkpoint.initial_state(
      config, setup.features, manager, local_tier, setup.abstract_state, lambda: setup.init_state(config, mesh)
    )
    if data_state is not None:
      checkpointing.restore_data_position(config, data_iterator, data_state)
    state = starting_state.start(setup.features, state)  # e.g. a reference model taken at step 0
    done = int(state.step)
    if done > 0:
      events.phase("restore", time.perf_counter() - started)
    events.event("resume", step=done)
    if done >= config.steps:
      max_logging.log(
        f"Run {config.run_name} is already complete: {done} of steps={config.steps} done. Raise steps to train on."
      )
      return state
    _log_run_start(config, setup.features, state)
    loop_args = (setup.model, setup.features, state, setup.state_shardings, p_train_step, data_iterator, manager, events)
    return step_loop.run_steps(config, mesh, *loop_args, local_tier=local_tier)
  finally:
    data_iterator.close()
    for checkpoints in (manager, local_tier):
      if checkpoints is not None:
        checkpoints.close()  # waits for a save in flight, also when the loop failed
    events.event("job_end")
    events.close()
    if config.enable_goodput_recording:
      goodput.log_report(config)


def main(argv: list[str]) -> None:
  config = pyconfig.initialize(argv, required_keys=("run_name",))
  from MaxText import max_logging  # pylint: disable=import-outside-toplevel
  from MaxText.diagnostics import stack_traces, vertex_tensorboard  # pylint: disable=import-outside-toplevel
  from MaxText.runtime import jax_runtime

  max_logging.configure(config.log_all_processes)
  jax_runtime.enable_compilation_cache(config.jax_cache_dir)
  with (
    stack_traces.collect(config.collect_stack_trace, config.stack_trace_to_cloud, config.stack_trace_interval_seconds),
    vertex_tensorboard.upload(config),
  ):
    train_loop(config)


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
