"""Stack traces of every thread: every stack_trace_interval_seconds (collect_stack_trace), on a crash, and on demand.

The keys and the file location of stack_trace_to_cloud (/tmp/debugging/, which the agent of TPU VMs uploads to
Cloud Logging) are those of cloud-tpu-diagnostics, which upstream MaxText runs its loop under. That package is not
used because of what it does (measured with cloud-tpu-diagnostics 0.1.5 on CPU):
  - it dumps the main thread only, while a hang often sits in another one (a checkpoint write, the data loader);
  - the end of a run waits for the rest of an interval (its thread sleeps a whole interval and is joined): up to
    600 s with the default interval, after training has finished.
Here a daemon thread writes each snapshot with faulthandler, which reads every thread's frames without running code
in them, so a thread blocked in XLA or in a collective shows where it waits. The same function serves the step
watchdog (watchdog.py).
"""

import contextlib
import faulthandler
import os
import sys
import threading
import time

from MaxText import max_logging

# cloud-tpu-diagnostics' directory, which the TPU VM agent uploads to Cloud Logging (logName .../runtime_monitor).
CLOUD_STACK_TRACE_DIR = "/tmp/debugging"


def dump_all_threads(header: str, out=None) -> None:
  """Writes `header` and then the stack of every thread of this process (most recent call first) to `out`.

  Args:
    header: one line saying why the stacks are dumped.
    out: a file with a file descriptor (default sys.stderr).
  """
  out = sys.stderr if out is None else out
  out.flush()  # faulthandler writes to the descriptor directly: what Python buffered goes first
  os.write(out.fileno(), (header.rstrip("\n") + "\n").encode())
  faulthandler.dump_traceback(file=out, all_threads=True)


def _open_cloud_file():
  """A new file in CLOUD_STACK_TRACE_DIR named as cloud-tpu-diagnostics names them (the pid added if it exists)."""
  os.makedirs(CLOUD_STACK_TRACE_DIR, exist_ok=True)
  stamp = time.strftime("%Y_%m_%d_%H_%M_%S", time.localtime())
  for name in (f"stack_trace_{stamp}.txt", f"stack_trace_{stamp}_{os.getpid()}.txt"):
    try:
      return open(os.path.join(CLOUD_STACK_TRACE_DIR, name), "xb", buffering=0)  # pylint: disable=consider-using-with
    except FileExistsError:  # another process of this host started in the same second
      continue
  raise FileExistsError(f"stack trace files of this second already exist in {CLOUD_STACK_TRACE_DIR}")


@contextlib.contextmanager
def collect(enabled: bool, to_cloud: bool, interval_seconds: int):
  """While inside, dumps every thread's stack every interval_seconds and on a fatal signal (collect_stack_trace).

  Args:
    enabled: collect_stack_trace; when False this does nothing.
    to_cloud: stack_trace_to_cloud: write to a file in /tmp/debugging/ instead of stderr.
    interval_seconds: stack_trace_interval_seconds.
  """
  if not enabled:
    yield
    return
  if to_cloud:
    try:
      out = _open_cloud_file()
    except OSError as e:  # a diagnostics aid must not stop training: the stacks go to stderr instead
      max_logging.warn(f"stack_trace_to_cloud: cannot write in {CLOUD_STACK_TRACE_DIR} ({e}); stack traces go to stderr")
      to_cloud = False
  out = out if to_cloud else sys.stderr
  where = out.name if to_cloud else "stderr"
  was_enabled = faulthandler.is_enabled()
  faulthandler.enable(file=out, all_threads=True)  # SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL
  stop = threading.Event()
  header = (
    f"INFO: Not a crash. MaxText dumps the stack of every thread every {interval_seconds} seconds "
    "(collect_stack_trace=true)."
  )

  def snapshots():
    while not stop.wait(interval_seconds):
      dump_all_threads(header, out)

  thread = threading.Thread(target=snapshots, name="maxtext-stack-traces", daemon=True)
  thread.start()
  max_logging.log(f"Stack traces of every thread every {interval_seconds} s, and on a crash, go to {where}")
  try:
    yield
  finally:
    stop.set()
    thread.join()  # at once: the thread waits on `stop`, not in a sleep
    faulthandler.disable()
    if was_enabled:  # e.g. python3 -X faulthandler: keep it as it was, on stderr
      faulthandler.enable()
    if to_cloud:
      out.close()
