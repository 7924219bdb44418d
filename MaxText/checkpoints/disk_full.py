"""A checkpoint save that runs out of disk space stops the run with one line that names the checkpoint staying the
latest (DiskFullError, exit 2), instead of tracebacks from Orbax's threads.

Orbax writes a checkpoint into <N>.orbax-checkpoint-tmp and renames it (or writes its commit file) only once every
write has succeeded, and max_num_checkpoints_to_keep deletes older checkpoints only after that: a save that fails
leaves the previous checkpoint the latest, and the temporary directory is removed when the run starts again. Why stop
rather than train on (docs/checkpoints.md): a full disk seldom frees itself, and the steps trained without a
checkpoint are lost at the next preemption.
"""

import errno
import logging
import os
import sys
import traceback

from MaxText.errors import UserError

_CODES = (errno.ENOSPC, errno.EDQUOT)  # no space left on the device; the user's quota is used up


class DiskFullError(UserError):
  """A checkpoint could not be written because its disk is full; the newest complete checkpoint stays the latest."""


def reason(error: BaseException | None) -> str | None:
  """ "No space left on device" (or the quota's), when an error or one of its causes shows a full disk; else None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _CODES:
      return os.strerror(error.errno)
    found = _in_text(str(error))
    if found:
      return found
    error = error.__cause__ or error.__context__
  return None


def _in_text(text: str) -> str | None:
  """tensorstore's errors (ValueError "RESOURCE_EXHAUSTED: ... [os_error_code='28']") carry the errno as text."""
  for code in _CODES:
    if f"os_error_code='{code}'" in text:
      return os.strerror(code)
  return None


def raise_if_full(directory, step: int | None, action, newest_step) -> None:
  """Runs action() (a save, or the wait for one); a full disk becomes a DiskFullError.

  Args:
    directory: the checkpoint directory, for the line.
    step: the step whose save action() starts or waits for.
    action: the call to Orbax.
    newest_step: () -> the step of the newest complete checkpoint in `directory`, or None.
  """
  why = None
  try:
    action()
  except Exception as error:  # pylint: disable=broad-except
    why = reason(error)
    if why is None:
      raise
  if why is None:
    return
  # Raised outside the except clause: the failed write's coroutines are not kept alive by the error's context.
  newest = newest_step()
  stays = f"the checkpoint of step {newest} stays the latest" if newest is not None else "no checkpoint is complete yet"
  raise DiskFullError(
    f"the checkpoint of step {step} could not be written to {directory} ({why}), so {stays}. Free space (a save "
    "needs room for one more checkpoint beside those kept) and rerun the same command to resume from there."
  )


class _WithoutDiskFullReports(logging.Filter):
  """Orbax's threads log each failed write with its traceback (at absl's ERROR level)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return reason(record.exc_info[1] if record.exc_info else None) is None and not _in_text(record.getMessage())


_FILTER = _WithoutDiskFullReports()


def _late_write_to_a_closed_loop(unraisable) -> bool:
  """A failed save stops Orbax's event loop while tensorstore still completes the save's other writes, and reports
  each completion to that loop as an unraisable "Event loop is closed" (from asyncio's call_soon_threadsafe)."""
  error, frames = unraisable.exc_value, traceback.extract_tb(unraisable.exc_traceback)
  return (
    isinstance(error, RuntimeError)
    and str(error) == "Event loop is closed"
    and any(frame.name == "call_soon_threadsafe" for frame in frames)
  )


def quiet_library_reports() -> None:
  """Leaves DiskFullError's line the only report of a full disk: drops Orbax's logged tracebacks of the failed writes
  and tensorstore's late reports to a closed event loop (any other log record or unraisable error is kept)."""
  for name in ("absl", "asyncio"):
    logging.getLogger(name).addFilter(_FILTER)  # a filter is added to a logger at most once
  if getattr(sys.unraisablehook, "drops_late_writes", False):
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _late_write_to_a_closed_loop(unraisable):
      previous(unraisable)

  hook.drops_late_writes = True
  sys.unraisablehook = hook
