"""Trains a decoder LM:  python3 MaxText/train.py MaxText/configs/base.yml run_name=demo [key=value ...]

Builds the mesh, the sharded model and optimizer state, the input pipeline and a jitted train_step from
one validated config, then logs a line per step (loss, step time, TFLOP/s, tokens/s, MFU) to the
console, TensorBoard and an optional metrics file.
"""

import os
import sys

if __package__ in (None, ""):  # Run as `python3 MaxText/train.py`: import MaxText from this checkout.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxText import pyconfig  # pylint: disable=wrong-import-position
from MaxText.errors import UserError, run_and_exit_on_user_error  # pylint: disable=wrong-import-position


def _log_run_start(config, state) -> None:
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText import flops, max_logging  # pylint: disable=import-outside-toplevel

  device = jax.devices()[0]
  max_logging.log(
    f"System: jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} x {device.device_kind}, "
    f"process {jax.process_index()} of {jax.process_count()}"
  )
  max_logging.log("Config (value  # source):\n" + config.to_yaml())
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  max_logging.log(f"Number of parameters: {num_params / 1e9:.6f} billion ({num_params:,})")
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
  """Trains until config.steps (or a SIGTERM/SIGINT) and returns the final train state."""
  # pylint: disable=import-outside-toplevel
  from MaxText import checkpointing, train_state, train_step
  from MaxText.evaluation import check_eval_data
  from MaxText.input_pipeline.input_pipeline_interface import create_data_iterator
  from MaxText.mesh import create_device_mesh

  _prepare_run_dir(config)
  mesh = create_device_mesh(config)
  check_eval_data(config, mesh)  # a wrong eval split, glob or file stops the run now, not at step eval_interval
  setup = train_state.build(config, mesh)
  data_iterator = create_data_iterator(config, mesh)  # data and tokenizer mistakes stop the run before the compile
  manager = None
  try:
    if config.compiled_trainstep_file:  # compiled ahead of time by train_compile.py
      p_train_step = train_step.load_compiled_train_step(setup.model, config, mesh, setup.abstract_state)
    else:  # Pre-flight: compile the step and check its memory before the state is allocated or restored.
      p_train_step = train_step.compile_train_step(setup.model, config, mesh, setup.abstract_state)
    manager = checkpointing.create_checkpoint_manager(config)
    state, data_state = checkpointing.initial_state(
      config,
      manager,
      setup.abstract_state,
      lambda: train_state.init_train_state(setup.model, setup.tx, config, mesh, setup.state_shardings),
    )
    if data_state is not None:
      data_iterator.set_state(data_state)
    return _run_steps(config, mesh, setup.model, state, setup.state_shardings, p_train_step, data_iterator, manager)
  finally:
    data_iterator.close()
    if manager is not None:
      manager.close()  # waits for a save in flight, also when the loop failed


def _run_steps(config, mesh, model, state, state_shardings, p_train_step, data_iterator, manager):
  """The step loop from state.step to config.steps, with metrics, checkpoints and evals."""
  # pylint: disable=import-outside-toplevel
  from MaxText import checkpointing, evaluation, max_logging, metric_logger, sharding, train_step
  from MaxText.diagnostics import loop as diagnostics_loop
  from MaxText.diagnostics import nonfinite, numerics_log, plots

  start_step = int(state.step)
  if start_step >= config.steps:
    max_logging.log(
      f"Run {config.run_name} is already complete: {start_step} of steps={config.steps} done. Raise steps to train on."
    )
    return state
  _log_run_start(config, state)
  p_eval_step = train_step.jit_eval_step(model, config, mesh, state_shardings) if config.eval_interval > 0 else None
  writer = metric_logger.create_tensorboard_writer(config)
  observers = nonfinite.observers(config, state.params) + numerics_log.observers(config, state.params, writer, start_step)
  logger = metric_logger.MetricLogger(config, start_step, writer, observers)
  watcher = checkpointing.PreemptionWatcher()
  diagnostics = diagnostics_loop.LoopDiagnostics(config, start_step)
  used_up = f"the training data is used up (num_epoch={config.num_epoch})"
  example_batch, stop_reason, last_saved, last_step = None, None, None, start_step - 1
  in_step = False  # while True, `state` is donated to the compiled step and must not be saved
  try:
    with sharding.logical_context(mesh, config):
      for step in range(start_step, config.steps):
        with diagnostics.step(step, state):
          if example_batch is None or not config.reuse_example_batch:
            example_batch = next(data_iterator)
          in_step = True
          state, metrics = p_train_step(state, example_batch)
          in_step = False
        logger.record(step, metrics)
        diagnostics.after_step(step, metrics)
        # Once every process is out of data, steps see only padding and change nothing (see train_step).
        if logger.data_exhausted:
          stop_reason = used_up
        elif watcher.should_stop(step):
          stop_reason = f"received {watcher.signal_name}"
        if p_eval_step is not None and stop_reason is None and (step + 1) % config.eval_interval == 0:
          logger.flush()
          with diagnostics.activity("eval"):
            eval_metrics = evaluation.evaluate(config, mesh, p_eval_step, state.params)
          logger.write_eval(step, eval_metrics)
          logger.reset_step_timer()
          if config.target_eval_loss > 0 and eval_metrics["eval/loss"] <= config.target_eval_loss:
            stop_reason = f"the eval loss reached target_eval_loss={config.target_eval_loss}"
        save = manager is not None and (stop_reason or step % config.checkpoint_period == 0 or step == config.steps - 1)
        if save:
          logger.flush()  # the step's metrics line is written before its checkpoint can commit
          stop_reason = stop_reason or (used_up if logger.data_exhausted else None)
        last_step = int(state.step) - 1 if stop_reason else step  # the last step that updated the weights
        if save:
          if last_step not in (last_saved, start_step - 1):  # nothing new since the last save or the restore
            with diagnostics.activity("checkpoint save"):
              blocked = checkpointing.save_checkpoint(manager, last_step, state, data_iterator)
            last_saved = last_step
            logger.reset_step_timer()
            max_logging.log(f"Saving the checkpoint of step {last_step} (the loop waited {blocked:.3f} s)")
        if stop_reason:
          break
  except Exception as error:
    # Eval, data, logging: an error outside the compiled step keeps what was trained since the last checkpoint.
    # A non-finite step (nonfinite_action=abort) saves nothing: the last checkpoint is the last good state.
    if manager is not None and not in_step and not isinstance(error, nonfinite.NonFiniteError):
      _save_before_exit(manager, logger, state, data_iterator, error, (last_saved, start_step - 1))
    raise
  finally:
    diagnostics.close()
    logger.close()
    watcher.close()
  if manager is not None:
    manager.wait_until_finished()
  plots.write_run_plot(config, logger.history)
  if stop_reason:
    max_logging.log(
      f"Stopping because {stop_reason}: the last step is {last_step}; {_saved_note(config, manager, last_saved)}."
    )
  else:
    board = f" TensorBoard: tensorboard --logdir={config.tensorboard_dir}" if config.enable_tensorboard else ""
    max_logging.log(f"Training finished at step {config.steps - 1}.{board}")
  return state


def _save_before_exit(manager, logger, state, data_iterator, error: Exception, not_new: tuple) -> None:
  """Saves the state of the last completed step (unless its step is in `not_new`) and waits for the write.

  Never raises: the caller re-raises `error`, which is what the run reports.
  """
  # pylint: disable=import-outside-toplevel
  from MaxText import checkpointing, max_logging

  step = None
  try:
    step = int(state.step) - 1  # the last step that updated the weights
    if step in not_new:
      return
    reason = " ".join(str(error).split())[:300] if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
    max_logging.log(f"Saving the checkpoint of step {step} before exiting because of an error: {reason}")
    try:
      logger.flush()  # the step's metrics line before its checkpoint, as for every save
    except Exception:  # pylint: disable=broad-except  # logging may be what failed; the checkpoint matters more
      pass
    checkpointing.save_checkpoint(manager, step, state, data_iterator)
    manager.wait_until_finished()
    max_logging.log(f"Saved the checkpoint of step {step} to {manager.directory}")
  except Exception as save_error:  # pylint: disable=broad-except
    max_logging.warn(
      f"could not save the checkpoint of step {step} before exiting: {type(save_error).__name__}: {save_error}"
    )


def _saved_note(config, manager, last_saved) -> str:
  if manager is None:
    return "checkpointing is disabled"
  if last_saved is None:
    return "its checkpoint was already saved"
  return f"saved the checkpoint of step {last_saved} to {config.checkpoint_dir}"


def main(argv: list[str]) -> None:
  config = pyconfig.initialize(argv, required_keys=("run_name",))
  from MaxText import jax_runtime, max_logging  # pylint: disable=import-outside-toplevel
  from MaxText.diagnostics import stack_traces, vertex_tensorboard  # pylint: disable=import-outside-toplevel

  max_logging.configure(config.log_all_processes)
  jax_runtime.enable_compilation_cache(config.jax_cache_dir)
  with (
    stack_traces.collect(config.collect_stack_trace, config.stack_trace_to_cloud, config.stack_trace_interval_seconds),
    vertex_tensorboard.upload(config),
  ):
    train_loop(config)


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
