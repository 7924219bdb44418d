"""SIGTERM/SIGINT (a preemption notice, or Ctrl-C) during training: the loop saves the current step and stops."""

import signal

import jax

from MaxText import max_logging


class PreemptionWatcher:
  """SIGTERM/SIGINT (a preemption notice or Ctrl-C) ask the loop to save the current step and stop.

  A second Ctrl-C interrupts at once. With several processes, JAX's preemption service (which owns
  SIGTERM there) picks one step at which every process saves and stops.
  """

  def __init__(self, saves: bool = True):
    self.signal_name = None
    self._then = "saving a checkpoint after the current step, then stopping" if saves else "stopping after the current step"
    self._previous = {}
    if jax.process_count() == 1:
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._on_signal)

  def _on_signal(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if signum == signal.SIGINT:  # the loop may be far from the end of its step: say what happens, and how to hurry
      max_logging.warn(f"Ctrl-C: {self._then}; Ctrl-C again interrupts at once")

  def should_stop(self, step: int) -> bool:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

      if multihost_utils.reached_preemption_sync_point(step):
        self.signal_name = "SIGTERM"
    return self.signal_name is not None

  def close(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
