"""Step watchdog: when no step completes for too long, every process dumps its threads' stacks and process 0 names
the processes that are behind, with the last step each one reached.

The loop calls `beat(step)` after each step (one tuple assignment and a median of at most 50 numbers: no device sync,
no I/O) and wraps evals and checkpoint saves in `activity(...)`. A daemon thread polls: when the current activity has
run longer than step_watchdog_factor x the median duration of that activity (a train step, an eval, a save), and
at least step_watchdog_min_seconds (an eval's or a save's first time, which may compile, gets factor x
min_seconds), the process dumps the stacks of all its threads, once per stall, and says so
again when it makes progress.

How process 0 learns the other processes' last steps while one of them may be stuck inside a collective: not
through a JAX collective, which would wait for the stuck process too, but through jax.distributed's key-value store.
Its coordination service runs in a C++ thread of process 0 and answers while Python and the devices are stuck. Each
watchdog thread writes maxtext/heartbeat/<process index> (last step, activity, since when), at most every
_publish_seconds during training and at once when it detects a stall; process 0 reads them all in one call.
Files under the run directory would need a filesystem that every host shares (often not there, or GCS with its
latency); the store is there in every multi-process job.
"""

import collections
import contextlib
import json
import statistics
import sys
import threading
import time

from MaxText import max_logging
from MaxText.diagnostics import stack_traces

HEARTBEAT_DIR = "maxtext/heartbeat/"
TRAIN_STEP = "train step"
_HISTORY = 50  # durations kept per activity for the median


def enabled(setting: str, process_count: int) -> bool:
  """step_watchdog: auto is on for multi-process jobs, where one stuck process silently stops all of them."""
  return setting == "true" or (setting == "auto" and process_count > 1)


def distributed_client():
  """jax.distributed's client (its key-value store), or None in a single-process run."""
  from jax._src import distributed  # pylint: disable=import-outside-toplevel  # no public API for the store

  return distributed.global_state.client


def ranges(numbers) -> str:
  """'0, 2-5, 9' for [0, 2, 3, 4, 5, 9]."""
  numbers, parts = sorted(numbers), []
  for n in numbers:
    if parts and n == parts[-1][1] + 1:
      parts[-1][1] = n
    else:
      parts.append([n, n])
  return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def _where(step: int, activity: str, first_step: int) -> str:
  """What a process is doing, from its last completed step and current activity."""
  if activity == TRAIN_STEP:
    return f"step {step + 1}" if step >= first_step else f"step {first_step}, its first,"
  return f"the {activity} after step {step}"


def behind_report(heartbeats: dict, process_count: int, first_step: int) -> str:
  """Process 0's line: the last step each process reached, those behind the others first.

  Args:
    heartbeats: process index -> {"step", "activity", "since"} as the processes published them.
    process_count: the number of processes of the job.
    first_step: the step the run (re)started at: a last step below it means no step yet.
  """
  by_step = collections.defaultdict(list)
  for index, beat in heartbeats.items():
    by_step[beat["step"]].append(index)
  now = time.time()
  groups = []
  for step in sorted(by_step):
    indices = by_step[step]
    reached = f"last step {step}" if step >= first_step else "no step yet"
    activities = sorted({heartbeats[i]["activity"] for i in indices})
    seconds = max(now - heartbeats[i]["since"] for i in indices)
    doing = ", ".join(_where(step, a, first_step) for a in activities)
    groups.append(f"{reached}: process {ranges(indices)} (in {doing} for up to {seconds:.0f} s)")
  silent = sorted(set(range(process_count)) - set(heartbeats))
  if silent:
    groups.insert(0, f"no heartbeat: process {ranges(silent)} (stuck before the watchdog started, or gone)")
  if len(by_step) > 1 or silent:
    top = max(by_step) if by_step else None
    behind = sorted(set(silent) | {i for s, ind in by_step.items() if s != top for i in ind})
    verdict = f"behind: process {ranges(behind)}"
  else:
    verdict = "none is behind: all wait in the same step (its device work or a collective; see the stacks)"
  return "Step watchdog: " + verdict + ". " + "; ".join(groups) + "."


class StepWatchdog:
  """Heartbeats of the training loop and the thread that watches them (see the module docstring)."""

  def __init__(
    self,
    factor: float,
    min_seconds: float,
    first_step: int,
    process_index: int = 0,
    process_count: int = 1,
    client=None,
    out=None,
  ):
    """Starts the watching thread.

    Args:
      factor: step_watchdog_factor.
      min_seconds: step_watchdog_min_seconds.
      first_step: the first step of this run (its start_step).
      process_index, process_count: this process and the job's size.
      client: jax.distributed's client, for the heartbeats of the other processes (None: this process only).
      out: where the stacks go (default sys.stderr).
    """
    self.factor, self.min_seconds, self.first_step = factor, min_seconds, first_step
    self.process_index, self.process_count = process_index, process_count
    self._client, self._out = client, out
    self._durations = collections.defaultdict(lambda: collections.deque(maxlen=_HISTORY))
    # (last completed step, current activity, monotonic start of the activity, its deadline in seconds): replaced
    # as a whole by the loop, read as a whole by the thread.
    self._state = (first_step - 1, TRAIN_STEP, time.monotonic(), float(min_seconds))
    self._poll = max(0.1, min(1.0, min_seconds / 10))
    self._publish_seconds = max(1.0, min_seconds / 4)
    self._published = None  # (state, monotonic time) last written to the store
    self._stalled = None  # the state whose stall was reported
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="maxtext-step-watchdog", daemon=True)
    self._thread.start()

  def _deadline(self, activity: str) -> float:
    durations = self._durations[activity]
    if durations:
      return max(self.factor * statistics.median(durations), self.min_seconds)
    if activity == TRAIN_STEP:  # train.py compiles the train step before the loop starts
      return float(self.min_seconds)
    return self.factor * self.min_seconds  # the first eval compiles the eval step: no median to go by yet

  def beat(self, step: int) -> None:
    """Step `step` is done on the host (dispatched, and the step before it complete on the devices)."""
    now = time.monotonic()
    _, activity, since, _ = self._state
    if activity == TRAIN_STEP:
      self._durations[TRAIN_STEP].append(now - since)
    self._state = (step, TRAIN_STEP, now, self._deadline(TRAIN_STEP))

  @contextlib.contextmanager
  def activity(self, name: str):
    """Something other than a train step (an eval, a checkpoint save), timed against its own median."""
    step = self._state[0]
    start = time.monotonic()
    self._state = (step, name, start, self._deadline(name))
    try:
      yield
    finally:
      now = time.monotonic()
      self._durations[name].append(now - start)
      self._state = (step, TRAIN_STEP, now, self._deadline(TRAIN_STEP))

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=10)

  def _watch(self) -> None:
    while not self._stop.wait(self._poll):
      state = self._state
      step, activity, since, deadline = state
      now = time.monotonic()
      if self._stalled is not None and self._stalled[:3] != state[:3]:
        max_logging.warn(
          f"Step watchdog: process {self.process_index} is past the stall: {_where(step, activity, self.first_step)}"
        )
        self._stalled = None
      stalled = self._stalled is None and now - since > deadline
      changed = self._published is None or self._published[0] != state
      due = self._published is None or now - self._published[1] >= self._publish_seconds
      if stalled or (changed and due):
        self._publish(state, now)
      if stalled:
        self._stalled = state
        self._report_stall(step, activity, now - since, deadline)

  def _publish(self, state, now: float) -> None:
    if self._client is None:
      return
    step, activity, since, _ = state
    value = json.dumps({"step": step, "activity": activity, "since": time.time() - (now - since)})
    try:
      self._client.key_value_set(f"{HEARTBEAT_DIR}{self.process_index}", value, allow_overwrite=True)
      self._published = (state, now)
    except Exception as e:  # pylint: disable=broad-except  # a diagnostics aid must not stop training
      max_logging.warn(
        f"Step watchdog: cannot write the heartbeat to jax.distributed's key-value store ({e}); "
        "from now on this process reports only its own stalls"
      )
      self._client = None

  def _report_stall(self, step: int, activity: str, seconds: float, deadline: float) -> None:
    median = self._durations[activity]
    rule = f"{self.factor:g} x the median {activity} time ({statistics.median(median):.3f} s), at least " if median else ""
    stack_traces.dump_all_threads(
      f"WARNING: Step watchdog: process {self.process_index} has been in "
      f"{_where(step, activity, self.first_step)} for {seconds:.0f} s, longer than {rule}"
      f"step_watchdog_min_seconds={self.min_seconds:g}. The stacks of its threads:",
      self._out or sys.stderr,
    )
    if self.process_index == 0 and self.process_count > 1:
      self._stop.wait(2 * self._poll + 1)  # the others detect their stall about now and publish it
      max_logging.warn(behind_report(self._heartbeats(), self.process_count, self.first_step))

  def _heartbeats(self) -> dict:
    if self._client is None:
      step, activity, since, _ = self._state
      return {0: {"step": step, "activity": activity, "since": time.time() - (time.monotonic() - since)}}
    try:
      entries = self._client.key_value_dir_get(HEARTBEAT_DIR)
    except Exception as e:  # pylint: disable=broad-except
      max_logging.warn(f"Step watchdog: cannot read the heartbeats of the other processes: {e}")
      return {}
    return {int(key.rsplit("/", 1)[-1]): json.loads(value) for key, value in entries}


def create(config, first_step: int):
  """The step watchdog of this process, or None when step_watchdog is off (or auto with one process)."""
  import jax  # pylint: disable=import-outside-toplevel

  if not enabled(config.step_watchdog, jax.process_count()):
    return None
  client = distributed_client() if jax.process_count() > 1 else None
  watchdog = StepWatchdog(
    config.step_watchdog_factor,
    config.step_watchdog_min_seconds,
    first_step,
    jax.process_index(),
    jax.process_count(),
    client,
  )
  max_logging.log(
    f"Step watchdog: stacks of every thread when a step takes over {config.step_watchdog_factor:g} x the median step "
    f"time and at least {config.step_watchdog_min_seconds} s (step_watchdog={config.step_watchdog})"
  )
  return watchdog
