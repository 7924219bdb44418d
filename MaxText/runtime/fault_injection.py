"""Test-only faults, asked for with MAXTEXT_FAULT_INJECTION=<kind>:<step> (one at a time); unset in real runs.

- kill_during_save:<step>: the process SIGKILLs itself while the asynchronous save of step <step> is in flight
  (checkpointing.save_checkpoint), so a test can check that the restarted run resumes from its last good checkpoint.
- hang_at_step:<step>: the training loop blocks in Python before step <step> (diagnostics/loop.py), so a test can
  check that the step watchdog names the hung process and that every process dumps its stacks.
- kill_in_step:<step>: the process SIGKILLs itself once step <step> is dispatched, while it runs (diagnostics/loop.py),
  so a test can check that the other processes of the job report it lost (peer_monitor.py).
"""

import os
import signal
import time

import jax

from MaxText import max_logging
from MaxText.errors import UserError

ENV = "MAXTEXT_FAULT_INJECTION"
KILL_DURING_SAVE = "kill_during_save"
HANG_AT_STEP = "hang_at_step"
KILL_IN_STEP = "kill_in_step"


def requested(kind: str) -> int | None:
  """The step at which MAXTEXT_FAULT_INJECTION asks for a fault of this kind, or None when it asks for none."""
  value = os.environ.get(ENV, "")
  name, colon, step = value.partition(":")
  if name != kind or not colon:
    return None
  try:
    return int(step)
  except ValueError:
    raise UserError(f"{ENV}={value!r}: the step after '{kind}:' must be an integer") from None


def kill_during_save(step: int) -> None:
  """Called once the save of `step` has started: SIGKILLs this process if kill_during_save:<step> was asked for."""
  if requested(KILL_DURING_SAVE) == step:
    max_logging.warn(f"{ENV}: killing the process while the save of step {step} is in flight")
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in(step: int) -> None:
  """Called once `step` is dispatched: SIGKILLs this process if kill_in_step:<step> was asked for."""
  if requested(KILL_IN_STEP) == step:
    max_logging.warn(f"{ENV}: killing process {jax.process_index()} in step {step}")
    os.kill(os.getpid(), signal.SIGKILL)


def hang_before(step: int) -> None:
  """Called before the loop starts `step`: hangs this process for good if hang_at_step:<step> was asked for."""
  if requested(HANG_AT_STEP) == step:
    _hang(step)


def _hang(step: int) -> None:
  """Blocks in Python, as a process stuck in its own code would (its threads still run and can dump their stacks).

  watchdog_test looks for this function's name in the stack dump.
  """
  max_logging.warn(f"{ENV}: process {jax.process_index()} hangs before step {step}")
  while True:
    time.sleep(3600)
