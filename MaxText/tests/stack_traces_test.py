"""collect_stack_trace: snapshots of every thread's stack at each interval, to stderr or /tmp/debugging/ files."""

import threading
import time

import pytest

from MaxText.diagnostics import stack_traces
from MaxText.errors import ConfigError
from MaxText.tests.helpers import run_train, tiny_config


def _wait_in_a_side_thread(release: threading.Event) -> None:
  release.wait()


def test_snapshots_show_every_thread_and_stop_at_once(capfd):
  release = threading.Event()
  side = threading.Thread(target=_wait_in_a_side_thread, args=(release,), daemon=True)
  side.start()
  try:
    with stack_traces.collect(True, False, 1):
      time.sleep(2.5)
    left = time.monotonic()
    with stack_traces.collect(True, False, 600):  # leaving does not wait for the rest of the interval
      pass
    assert time.monotonic() - left < 1
  finally:
    release.set()
  err = capfd.readouterr().err
  assert err.count("INFO: Not a crash. MaxText dumps the stack of every thread every 1 seconds") == 2
  snapshot = err.split("INFO: Not a crash.")[1]
  assert "in _wait_in_a_side_thread" in snapshot  # a thread other than the main one
  assert "in test_snapshots_show_every_thread_and_stop_at_once" in snapshot  # the main thread, in its sleep
  assert "Current thread" in snapshot  # the collecting thread itself


def test_to_cloud_writes_a_file_in_the_agents_directory(tmp_path, monkeypatch):
  monkeypatch.setattr(stack_traces, "CLOUD_STACK_TRACE_DIR", str(tmp_path / "debugging"))
  with stack_traces.collect(True, True, 1):
    time.sleep(1.5)
  (trace_file,) = (tmp_path / "debugging").glob("stack_trace_*.txt")
  text = trace_file.read_text()
  assert text.startswith("INFO: Not a crash.") and "in test_to_cloud_writes_a_file_in_the_agents_directory" in text


def test_an_unwritable_cloud_directory_falls_back_to_stderr(tmp_path, monkeypatch, capfd):
  (tmp_path / "debugging").write_text("a file where the directory should be")
  monkeypatch.setattr(stack_traces, "CLOUD_STACK_TRACE_DIR", str(tmp_path / "debugging"))
  with stack_traces.collect(True, True, 1):
    time.sleep(1.5)
  err = capfd.readouterr().err
  assert f"stack_trace_to_cloud: cannot write in {tmp_path / 'debugging'}" in err and "stack traces go to stderr" in err
  assert "INFO: Not a crash." in err


@pytest.mark.parametrize("key", ["stack_trace_interval_seconds", "step_watchdog_min_seconds"])
def test_waits_beyond_a_week_are_a_config_error(key):
  with pytest.raises(ConfigError, match=f"{key}=100000000 must be in \\[1, 604800\\]"):  # the timer would overflow
    tiny_config(f"{key}=100000000")


def test_off_by_default_starts_nothing():
  threads = threading.active_count()
  with stack_traces.collect(False, False, 1):
    assert threading.active_count() == threads


def test_training_under_stack_trace_collection(tmp_path):
  traces = ("collect_stack_trace=true", "stack_trace_interval_seconds=1")
  result, metrics = run_train(tmp_path, "traces", "steps=2", *traces, own_process=True)  # fault handlers need real fds
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(metrics) == 2
  assert "Stack traces of every thread every 1 s, and on a crash, go to stderr" in result.stdout
  snapshots = result.stderr.split("INFO: Not a crash. MaxText dumps the stack of every thread every 1 seconds")[1:]
  assert snapshots, result.stderr[-3000:]
  assert any("MaxText/train.py" in s for s in snapshots)  # the main thread, somewhere in the run
