"""train.py's step loop: from the state's step to config.steps, with metrics, evals, checkpoints and the reasons to
stop early (the data ran out, SIGTERM/SIGINT, the eval loss reached its target).

A step reads top to bottom in StepLoop.run: the step and its metrics, the stop checks, an eval when due, a save
when due. The metric logger reports the steps; this loop decides when training stops.
"""

import time

from MaxText import feature_protocol, max_logging
from MaxText.checkpoints import checkpointing, disk_full
from MaxText.diagnostics import loop as diagnostics_loop
from MaxText.diagnostics import metrics_file, nonfinite, plots
from MaxText.errors import UserError
from MaxText.runtime import goodput as goodput_events
from MaxText.runtime import peer_monitor, preemption, sharding
from MaxText.training import evaluation, jit_steps, metric_logger, train_state, wandb_log


def run_steps(
  config,
  mesh,
  model,
  features,
  state,
  state_shardings,
  p_train_step,
  data_iterator,
  manager,
  goodput=None,
  local_tier=None,
):
  """Trains from state.step to config.steps (or an early stop) and returns the last state.

  Args:
    config, mesh, model, features: the run's (train.py).
    state: the restored or fresh train state, on state_shardings, in the order the run holds it (after the features'
      on_start); the state returned is in the model's order (train_state.logical).
    state_shardings: the state's shardings (the eval step takes the params on theirs).
    p_train_step: the compiled step, called (state, batch) -> (new state, metrics); it donates `state`.
    data_iterator: the train batches; checkpoints save its state.
    manager: the Orbax checkpoint manager, or None when checkpointing is off.
    goodput: the run's goodput.Recorder (steps, saves, evals), or None.
    local_tier: emergency_checkpoint.LocalTier (enable_emergency_checkpoint), or None.
  """
  loop = StepLoop(config, mesh, model, features, state, state_shardings, p_train_step, data_iterator, manager, goodput)
  loop.local_tier = local_tier
  return train_state.logical(features, loop.run(state))


class StepLoop:
  """One run of the step loop."""

  def __init__(
    self, config, mesh, model, features, state, state_shardings, p_train_step, data_iterator, manager, goodput=None
  ):
    self.config, self.mesh, self.data_iterator, self.manager = config, mesh, data_iterator, manager
    self.features, self.model = features, model
    self.goodput = goodput if goodput is not None else goodput_events.OFF
    self._timing = None  # (step, its start, its data wait): the open step, for goodput's step times
    self.p_train_step = p_train_step
    self.p_eval_step = None
    if config.eval_interval > 0:
      self.p_eval_step = jit_steps.jit_eval_step(model, config, features, mesh, state_shardings)
    self.start_step = int(state.step)
    writer = metric_logger.create_tensorboard_writer(config)
    self.nonfinite = nonfinite.host_check(config, state.params)
    observers = [o for f in features for o in f.observers(config, state.params, writer, self.start_step)]
    observers += metrics_file.dir_writers(config)
    observers += wandb_log.writers(config)
    self.logger = metric_logger.MetricLogger(config, self.start_step, writer, observers)
    self.watcher = preemption.PreemptionWatcher(saves=manager is not None)
    self.diagnostics = diagnostics_loop.LoopDiagnostics(config, self.start_step)
    self.batch = None  # the data's last batch
    self._data_wait = 0.0  # the open step's wait for it
    self.in_step = False  # while True, the state is donated to the compiled step and must not be saved
    self.out_of_data = False  # a step had no real token on any process
    self.last_saved = None  # the step of this loop's last checkpoint
    self.local_tier = None  # emergency_checkpoint.LocalTier: saves every local_checkpoint_period steps between

  def run(self, state):
    stop = None
    try:
      with sharding.logical_context(self.mesh, self.config):
        for step in range(self.start_step, self.config.steps):
          state = self._train_step(step, state)
          stop = self._out_of_data_or_preempted(step)
          if stop is None and self._eval_due(step):
            stop = self._evaluate(step, state)
          if self._save_due(step, stop):
            stop = self._save(step, state, stop)
          elif self.local_tier is not None and self.local_tier.due(step) and not stop:
            self._save_local(step, state)
          if stop:
            break
        self._flush()  # the last step's checks
    except Exception as error:
      # Eval, data, logging: an error outside the compiled step keeps what was trained since the last checkpoint.
      # A non-finite step (nonfinite_action=abort) saves nothing: the last checkpoint is the last good state.
      # A collective that failed because a process was lost: peer_monitor ends the process with one line, unsaved.
      peer_monitor.wait_if_lost(error)
      if isinstance(error, nonfinite.NonFiniteError):
        self.logger.discard_pending()  # the steps after the bad one are not reported: the error is the last line
      elif isinstance(error, disk_full.DiskFullError):
        pass  # the disk is full: another save would fail too, and the error names the checkpoint that stays the latest
      elif self.manager is not None and not self.in_step:
        self._save_before_exit(state, error)
      raise
    finally:
      self.diagnostics.close()
      self.logger.close()
      self.watcher.close()
    self._finish(state, stop)
    return state

  def _flush(self) -> None:
    """Writes the pending steps' metrics (waiting for the devices) with their checks; the open step ends here."""
    self._note(self.logger.flush())
    self._end_step()

  def _end_step(self) -> None:
    """Goodput: the open step took from its start until now (its metrics were flushed, or the next step starts)."""
    if self._timing is not None:
      step, started, data = self._timing
      self.goodput.step(step, time.perf_counter() - started, data)
      self._timing = None

  def _pull(self) -> dict:
    """The data's next batch (with reuse_example_batch, the first one again), its wait timed."""
    if self.batch is None or not self.config.reuse_example_batch:
      started = time.perf_counter()
      self.batch = next(self.data_iterator)
      self._data_wait += time.perf_counter() - started
    return self.batch

  def _train_step(self, step: int, state):
    self._end_step()
    started, self._data_wait = time.perf_counter(), 0.0
    with self.diagnostics.step(step, state):
      # The features' host side decides what the step trains on (a feature may generate its batch here).
      state, batch = feature_protocol.host_batch(self.features, state, self._pull, self.model, self.mesh)
      self._timing = (step, started, self._data_wait)
      peer_monitor.note_step(step)
      self.in_step = True
      state, metrics = self.p_train_step(state, batch)
      self.in_step = False
    self._note(self.logger.record(step, metrics))
    self.diagnostics.after_step(step, metrics)
    return state

  def _note(self, written: metric_logger.Written | None) -> None:
    """The checks of a step that the logger wrote: a step without tokens (every process is out of data: steps see
    only padding and change nothing, see train_step), and nonfinite_action (which may stop the run)."""
    if written is None:
      return
    if written.scalars["learning/total_weights"] == 0:
      self.out_of_data = True
    if self.nonfinite is not None:
      self.nonfinite(written.step, written.scalars, written.nested)

  def _used_up(self) -> str:
    return f"the training data is used up (num_epoch={self.config.num_epoch})"

  def _out_of_data_or_preempted(self, step: int) -> str | None:
    if self.out_of_data:
      return self._used_up()
    if self.watcher.should_stop(step):
      return f"received {self.watcher.signal_name}"
    return None

  def _eval_due(self, step: int) -> bool:
    return self.p_eval_step is not None and (step + 1) % self.config.eval_interval == 0

  def _evaluate(self, step: int, state) -> str | None:
    """Evaluates the params after `step`; returns a stop reason when the eval loss reached target_eval_loss."""
    self._flush()
    started = time.perf_counter()
    with self.diagnostics.activity("eval"):
      metrics = evaluation.evaluate(self.config, self.mesh, self.p_eval_step, state)
    self.goodput.phase("eval", time.perf_counter() - started)
    self.logger.write_eval(step, metrics)
    self.logger.reset_step_timer()
    target = self.config.target_eval_loss
    if target > 0 and metrics["eval/loss"] <= target:
      return f"the eval loss reached target_eval_loss={target}"
    return None

  def _save_due(self, step: int, stop: str | None) -> bool:
    last = step == self.config.steps - 1 and self.config.save_checkpoint_on_completion
    return self.manager is not None and bool(stop or step % self.config.checkpoint_period == 0 or last)

  def _save(self, step: int, state, stop: str | None) -> str | None:
    """Saves the last step that updated the weights, unless the last save or the restore holds it already.

    Returns the stop reason, which the step's metrics, written first, can add (the data ran out).
    """
    self._flush()  # the step's metrics line is written before its checkpoint can commit
    stop = stop or (self._used_up() if self.out_of_data else None)
    last_step = int(state.step) - 1 if stop else step  # a stopped run's last step may have changed nothing
    if last_step not in (self.last_saved, self.start_step - 1):
      with self.diagnostics.activity("checkpoint save"):
        blocked = checkpointing.save_checkpoint(
          self.manager, last_step, self._logical(state), self.data_iterator, self.config.dataset_type
        )
      self.goodput.phase("checkpoint_save", blocked)
      self.last_saved = last_step
      self.logger.reset_step_timer()
      max_logging.log(f"Saving the checkpoint of step {last_step} (the loop waited {blocked:.3f} s)")
    return stop

  def _logical(self, state):
    """The state as checkpoints hold it: in the model's order, and what the features keep of it."""
    return train_state.saved(self.features, train_state.logical(self.features, state))

  def _save_local(self, step: int, state) -> None:
    """Saves the state after `step` to the local tier (emergency checkpoints)."""
    self._flush()  # the step's metrics line is written before its checkpoint can commit
    started = time.perf_counter()
    with self.diagnostics.activity("checkpoint save"):
      self.local_tier.save(step, self._logical(state), self.data_iterator, self.config.dataset_type)
    blocked = time.perf_counter() - started
    self.goodput.phase("checkpoint_save", blocked)
    self.logger.reset_step_timer()
    max_logging.log(f"Saving the checkpoint of step {step} to the local tier (the loop waited {blocked:.3f} s)")

  def _finish(self, state, stop: str | None) -> None:
    if self.local_tier is not None:
      self.local_tier.wait_until_finished()
    if self.manager is not None:
      checkpointing.wait_for_saves(self.manager)
    plots.write_run_plot(self.config, self.logger.history)
    if stop:
      last_step = int(state.step) - 1  # the last step that updated the weights
      max_logging.log(f"Stopping because {stop}: the last step is {last_step}; {self._saved_note()}.")
    else:
      board = f" TensorBoard: tensorboard --logdir={self.config.tensorboard_dir}" if self.config.enable_tensorboard else ""
      max_logging.log(f"Training finished at step {self.config.steps - 1}.{board}")

  def _saved_note(self) -> str:
    if self.manager is None:
      return "checkpointing is disabled"
    if self.last_saved is None:
      return "its checkpoint was already saved"
    return f"saved the checkpoint of step {self.last_saved} to {self.config.checkpoint_dir}"

  def _save_before_exit(self, state, error: Exception) -> None:
    """Saves the state of the last completed step (unless already saved or restored) and waits for the write.

    Never raises: the caller re-raises `error`, which is what the run reports.
    """
    step = None
    try:
      step = int(state.step) - 1  # the last step that updated the weights
      if step in (self.last_saved, self.start_step - 1):
        return
      reason = " ".join(str(error).split())[:300] if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
      max_logging.log(f"Saving the checkpoint of step {step} before exiting because of an error: {reason}")
      try:
        self.logger.flush()  # the step's metrics line before its checkpoint, as for every save
      except Exception:  # pylint: disable=broad-except  # logging may be what failed; the checkpoint matters more
        pass
      checkpointing.save_checkpoint(self.manager, step, self._logical(state), self.data_iterator, self.config.dataset_type)
      self.manager.wait_until_finished()
      max_logging.log(f"Saved the checkpoint of step {step} to {self.manager.directory}")
    except Exception as save_error:  # pylint: disable=broad-except
      max_logging.warn(
        f"could not save the checkpoint of step {step} before exiting: {type(save_error).__name__}: {save_error}"
      )
