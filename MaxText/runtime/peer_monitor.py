"""A lost process ends a multi-process job with one line and exit status 75, instead of a hang or JAX's C++ abort.

When a process of a jax.distributed job dies (SIGKILL, a host that fails), the others are left inside a collective:
CPU (Gloo) collectives fail at once, GPU (NCCL) ones may wait for good, and Orbax's in-flight save waits at its
commit barrier. JAX's coordination service notices the missing heartbeats only after its heartbeat timeout, then
aborts every process with a fatal log and a C++ stack dump (exit 134). Its hook to be told instead (the client's
missed-heartbeat callback) fails from Python in jaxlib 0.10 (std::bad_cast), so this module keeps its own heartbeats
through jax.distributed's key-value store, and JAX's timeout is set later than ours (jax_heartbeat_timeout):

- every process writes maxtext/alive/<index> (a counter) every `interval` seconds, from a daemon thread that runs
  while the main thread waits in a collective;
- process 0 (which hosts the store) reads them all: a process whose counter has not moved for `threshold` seconds is
  lost. Process 0 writes the verdict to maxtext/lost/, where the other survivors read it (one key per process and
  poll: the store's load grows with the process count, not its square);
- each survivor prints one line (which process was lost, the step it was in, the newest complete checkpoint) and ends
  with os._exit(75) (EX_TEMPFAIL: run the same command again), whatever its main thread is blocked in. Nothing is
  saved: the state of a step that was in flight is not whole, and a save in flight never commits, since Orbax
  commits a checkpoint only after every process wrote its part.

A process that ends normally writes "done" (finished()) and is no longer watched. One that stops with an error says
so after its own line (exit_after_error: "failed", or process 0's verdict on itself) and exits at once, without JAX's
shutdown (which would wait for the others): the others, possibly waiting for it in a collective, end as above after a
grace of a few intervals, in which those that meet the same error print their own. If process 0 itself dies, the
store dies with it and JAX's client ends every other process at once with its own fatal error (exit 134): no Python
code runs there.
"""

import os
import sys
import threading
import time
import traceback

EXIT_STATUS = os.EX_TEMPFAIL  # 75: a temporary failure; the same command resumes from the last complete checkpoint
ALIVE_DIR = "maxtext/alive/"
LOST_DIR = "maxtext/lost/"
DONE = "done"
FAILED = "failed"  # the process stops with an error of its own (its output says which)
LEAVING = "leaving"  # a survivor read the verdict and exits

# The intervals that the others get, after a process stopped with an error, to meet the same error (e.g. a config or
# checkpoint mistake that every process meets, at times apart by their compile times) before they are told of it.
_FAILED_GRACE_INTERVALS = 5
_monitor = None  # this process's PeerMonitor, or None (a single process, or not started)


def jax_heartbeat_timeout(timeout_s: int) -> int:
  """The heartbeat timeout to give JAX: later than ours, so that our line, not JAX's abort, reports a lost process."""
  return timeout_s + max(10, timeout_s // 2)


def timings(timeout_s: float) -> tuple[float, float]:
  """(interval, threshold): how often a process beats and polls, and how long a silent process takes to be lost.

  A process's last beat precedes its death by up to an interval, process 0 sees it up to an interval later and judges
  it lost at its first poll more than `threshold` after that: up to threshold + 2 intervals after the death. Process 0
  then waits up to 2 intervals for the other survivors to read its verdict, so that all have left within the timeout.
  """
  interval = min(1.0, timeout_s / 10)
  return interval, timeout_s - 4 * interval


class PeerMonitor:
  """The heartbeats of this process and, on process 0, the judge of the others' (see the module docstring)."""

  def __init__(self, client, process_index: int, process_count: int, timeout_s: int, clock=time.monotonic, exit_fn=None):
    """Does not start the thread (start() does).

    Args:
      client: jax.distributed's client (its key-value store).
      process_index, process_count: this process and the job's size.
      timeout_s: distributed_heartbeat_timeout.
      clock: monotonic seconds (a test's fake clock).
      exit_fn: called with the exit status after the line is printed (default os._exit).
    """
    self.client, self.index, self.count, self.timeout_s = client, process_index, process_count, timeout_s
    self.interval, self.threshold = timings(timeout_s)
    self.grace = _FAILED_GRACE_INTERVALS * self.interval
    self.clock = clock
    self.exit_fn = exit_fn or os._exit  # pylint: disable=protected-access
    self.step = None  # the step the main thread is in (note_step)
    self.resume_note = None  # () -> str: where the same command resumes (set_resume_note)
    self._beats = 0
    self._done = False
    self._seen = {}  # process index -> (its last counter, the clock when it changed)
    self._finished = set()  # processes that ended normally
    self._failed_since = {}  # process index -> the clock when process 0 first saw it failed
    self._started = clock()  # a process not heard of yet counts as silent since then
    self._store_ok_since = self._started  # the last successful call to the store
    self._waited = False  # the main thread waited a whole timeout once and no process was lost
    self._verdict = threading.Event()  # set when this process knows of a lost one (or stops with an error)
    self._thread = None

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name="maxtext-peer-monitor", daemon=True)
    self._thread.start()

  def finished(self) -> None:
    """This process ended normally: the others no longer watch it (it keeps watching them until it exits)."""
    self._done = True
    try:
      self._set(DONE)
    except Exception:  # pylint: disable=broad-except  # a run that ended well stays so; the others may time out
      pass

  def failed(self) -> None:
    """This process stops with an error, already printed: the others are told now, not after the timeout (they may be
    waiting for it in a collective). Process 0 holds the store, so it waits for them to read it."""
    self._verdict.set()  # from now on the thread reports nothing: this process's own error is its last line
    try:
      if self.index == 0:
        # An error that every process meets (a config or checkpoint mistake): each one's own line is its last.
        self._wait_for_others(lambda value: value in (FAILED, DONE), self.grace)
        self._publish(0, f"lost process 0 of {self.count} (it stopped with an error: see its output)")
      else:
        self._set(FAILED)
    except Exception:  # pylint: disable=broad-except  # the store may be gone too; the others then time out
      pass

  def _set(self, value: str) -> None:
    self.client.key_value_set(f"{ALIVE_DIR}{self.index}", value, allow_overwrite=True)

  def _run(self) -> None:
    while True:
      time.sleep(self.interval)
      self.tick()

  def tick(self) -> None:
    """One beat and one look at the others (the thread's loop body; a test calls it with a fake clock)."""
    if self._verdict.is_set():
      return
    now = self.clock()
    try:
      if not self._done:
        self._beats += 1
        self._set(str(self._beats))
      verdict = self._judge(now) if self.index == 0 else self._read_verdict()
      self._store_ok_since = now
    except Exception:  # pylint: disable=broad-except  # the store is in process 0; see below
      verdict = None
      if now - self._store_ok_since > self.threshold:
        verdict = (
          f"lost process 0 of {self.count} (jax.distributed's coordinator: its key-value store has not answered for "
          f"{now - self._store_ok_since:.0f} s, distributed_heartbeat_timeout={self.timeout_s})"
        )
    if verdict is not None:
      self._leave(verdict)

  def _judge(self, now: float) -> str | None:
    """Process 0: the verdict on the first process silent for longer than the threshold, or None."""
    for key, value in self.client.key_value_dir_get(ALIVE_DIR):
      index = int(key.rsplit("/", 1)[-1])
      if value == DONE:
        self._finished.add(index)
      elif value == FAILED:
        # Reported after a grace: should this process stop with the same error meanwhile, its own line is its last.
        if now - self._failed_since.setdefault(index, now) >= self.grace:
          return self._publish(index, f"lost process {index} of {self.count} (it stopped with an error: see its output)")
      elif index not in self._seen or self._seen[index][0] != value:
        self._seen[index] = (value, now)
    for index in range(self.count):
      if index == self.index or index in self._finished:
        continue
      silent = now - self._seen.get(index, (None, self._started))[1]
      if silent > self.threshold:
        return self._publish(
          index,
          f"lost process {index} of {self.count} (no heartbeat for {silent:.0f} s, "
          f"distributed_heartbeat_timeout={self.timeout_s})",
        )
    return None

  def _publish(self, lost: int, verdict: str) -> str:
    """Process 0: the verdict for the other survivors, once they have read it (or 2 intervals passed)."""
    self.client.key_value_set(f"{LOST_DIR}{lost}", verdict, allow_overwrite=True)
    self._wait_for_survivors(lost)
    return verdict

  def _wait_for_survivors(self, lost: int) -> None:
    """Process 0 holds the store: it waits (up to 2 intervals) until the other survivors have read the verdict."""
    self._wait_for_others(lambda value: value in (LEAVING, FAILED), 2 * self.interval, lost)

  def _wait_for_others(self, left, seconds: float, lost: int | None = None) -> None:
    """Process 0: waits up to `seconds` until every other process (but `lost` and those done) has a value `left`."""
    others = set(range(1, self.count)) - {lost} - self._finished
    deadline = time.monotonic() + seconds
    while others and time.monotonic() < deadline:
      others -= {int(k.rsplit("/", 1)[-1]) for k, v in self.client.key_value_dir_get(ALIVE_DIR) if left(v)}
      if others:
        time.sleep(self.interval / 10)

  def _read_verdict(self) -> str | None:
    entries = self.client.key_value_dir_get(LOST_DIR)
    if not entries:
      return None
    self._set(LEAVING)
    return entries[0][1]

  def line(self, verdict: str) -> str:
    """The one line a survivor prints: what was lost, and where the same command resumes."""
    where = f" in step {self.step}" if self.step is not None else ""
    note = ""
    if self.resume_note is not None:
      try:
        note = " " + self.resume_note()
      except Exception as e:  # pylint: disable=broad-except  # the line must print whatever the storage does
        note = f" (the checkpoint directory cannot be listed: {type(e).__name__}: {e})"
    return f"Error: {verdict}{where}; stopping without a save (a step or save in flight is incomplete).{note}"

  def _leave(self, verdict: str) -> None:
    self._verdict.set()
    sys.stdout.flush()
    print(self.line(verdict), file=sys.stderr, flush=True)
    self.exit_fn(EXIT_STATUS)

  def wait_for_verdict(self, error: BaseException) -> None:
    """Called by the main thread with an error that may come from a lost process (a collective that failed):
    waits up to the timeout for the verdict, so that the error is not reported (nor a save attempted) before the
    line. Returns when no process is lost by then."""
    if self._waited or not _runtime_error_in(error):
      return
    if self._verdict.wait(self.timeout_s + 2 * self.interval):
      time.sleep(60)  # the thread prints the line and ends the process
    self._waited = True


def _runtime_error_in(error: BaseException | None) -> bool:
  """Whether the error, or one of its causes, is a JAX runtime error (a failed collective raises one)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError"):
      return True
    error = error.__cause__ or error.__context__
  return False


def start(timeout_s: int) -> None:
  """Starts this process's monitor, once jax.distributed is up (cluster.initialize); no-op with one process."""
  global _monitor  # pylint: disable=global-statement
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src import distributed  # pylint: disable=import-outside-toplevel  # no public API for the store

  if _monitor is not None or jax.process_count() == 1 or distributed.global_state.client is None:
    return
  _monitor = PeerMonitor(distributed.global_state.client, jax.process_index(), jax.process_count(), timeout_s)
  _monitor.start()


def note_step(step: int) -> None:
  """The main thread is in `step` now (for the line)."""
  if _monitor is not None:
    _monitor.step = step


def set_resume_note(note) -> None:
  """note() -> str: where the same command resumes (the newest complete checkpoint), for the line."""
  if _monitor is not None:
    _monitor.resume_note = note


def finished() -> None:
  """This process ended normally (its entry point returned)."""
  if _monitor is not None:
    _monitor.finished()


def exit_after_error(status: int, error: BaseException | None = None) -> None:
  """In a multi-process job, ends this process with `status` once its error is printed (`error`: printed here, with
  its traceback), after telling the others; no-op with one process. JAX's shutdown at exit would wait for the others,
  which may be waiting for this one."""
  if _monitor is None:
    return
  if error is not None:
    traceback.print_exception(error)
  _monitor.failed()
  sys.stdout.flush()
  sys.stderr.flush()
  _monitor.exit_fn(status)


def wait_if_lost(error: BaseException) -> None:
  """Before an error is reported or acted upon: if it may come from a lost process, wait for the verdict."""
  if _monitor is not None:
    _monitor.wait_for_verdict(error)
