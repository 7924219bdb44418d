"""Step watchdog: a stalled step makes every process dump its threads' stacks and process 0 name who is behind."""

import queue
import re
import sys
import threading
import time

import pytest

from MaxText.diagnostics import watchdog
from MaxText.runtime import fault_injection
from MaxText.tests.helpers import TRAIN_PY, start_cpu_processes, tiny_args, tiny_config


class FakeStore:
  """The part of jax.distributed's client that the watchdog uses, shared by the watchdogs of one test."""

  def __init__(self):
    self.values = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    assert allow_overwrite
    self.values[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_a_stalled_process_is_named_and_both_dump_their_stacks(tmp_path, capfd):
  store = FakeStore()
  stacks = [open(tmp_path / f"stacks_{i}.txt", "w", encoding="utf-8") for i in range(2)]  # noqa: SIM115
  dogs = [watchdog.StepWatchdog(10.0, 1, 0, i, 2, store, out=stacks[i]) for i in range(2)]
  try:
    for step in range(3):
      for dog in dogs:
        dog.beat(step)
    dogs[0].beat(3)  # process 1 stays at step 2
    err, deadline = "", time.monotonic() + 15
    while time.monotonic() < deadline and "behind" not in err:
      time.sleep(0.2)
      err += capfd.readouterr().err
  finally:
    for dog in dogs:
      dog.close()
    for f in stacks:
      f.close()
  for index, step in ((0, 4), (1, 3)):
    text = (tmp_path / f"stacks_{index}.txt").read_text()
    assert f"Step watchdog: process {index} has been in step {step} for 1 s, longer than" in text
    assert "step_watchdog_min_seconds=1" in text
    assert "in test_a_stalled_process_is_named_and_both_dump_their_stacks" in text  # the main thread's stack
    assert text.count("Step watchdog: process") == 1  # once per stall
  assert "Step watchdog: behind: process 1. last step 2: process 1 (in step 3 for up to" in err
  assert "last step 3: process 0 (in step 4 for up to" in err


def test_progress_after_a_stall_is_reported_and_evals_have_their_own_clock(tmp_path, capfd):
  with open(tmp_path / "stacks.txt", "w", encoding="utf-8") as out:
    dog = watchdog.StepWatchdog(1.5, 1, 0, out=out)
    try:
      dog.beat(0)
      with dog.activity("eval"):  # the first eval (it compiles) may take factor x min_seconds = 1.5 s
        time.sleep(1.2)
      dog.beat(1)
      with dog.activity("eval"):  # the second, 1.5 x its median 1.2 s = 1.8 s
        time.sleep(2.4)
      dog.beat(2)
      time.sleep(0.5)
    finally:
      dog.close()
  stacks = (tmp_path / "stacks.txt").read_text()
  assert "the eval after step 0" not in stacks
  assert "has been in the eval after step 1 for 2 s, longer than 1.5 x the median eval time (1.2" in stacks
  assert "Step watchdog: process 0 is past the stall: step 3" in capfd.readouterr().err


def test_behind_report():
  now = time.time()
  beats = {i: {"step": 7, "activity": "train step", "since": now} for i in range(6)}
  beats[3] = {"step": 6, "activity": "train step", "since": now - 30}
  beats[4] = {"step": 7, "activity": "checkpoint save", "since": now}
  del beats[5]
  report = watchdog.behind_report(beats, 6, 0)
  assert report.startswith("Step watchdog: behind: process 3, 5. no heartbeat: process 5 ")
  assert "last step 6: process 3 (in step 7 for up to 30 s)" in report
  assert "last step 7: process 0-2, 4 (in the checkpoint save after step 7, step 8 for up to 0 s)" in report
  same = watchdog.behind_report({i: {"step": 2, "activity": "train step", "since": now} for i in range(2)}, 2, 0)
  assert "none is behind" in same
  assert "no step yet: process 0" in watchdog.behind_report({0: {"step": 4, "activity": "train step", "since": now}}, 1, 5)


def test_auto_is_on_for_multi_process_jobs_only():
  assert not watchdog.enabled("auto", 1) and watchdog.enabled("auto", 2)
  assert watchdog.enabled("true", 1) and not watchdog.enabled("false", 8)


def test_yaml_booleans_and_cli_words_are_both_accepted(tmp_path):
  config_file = tmp_path / "watchdog.yml"
  config_file.write_text("base_config: base.yml\nstep_watchdog: true\n")
  from MaxText.configuration import config_loader  # pylint: disable=import-outside-toplevel

  values, _ = config_loader.load_raw_config(["t", str(config_file), "run_name=x"], {})
  assert values["step_watchdog"] == "true"
  assert tiny_config("step_watchdog=false").step_watchdog == "false"
  assert tiny_config("step_watchdog=True").step_watchdog == "true"


def _read_lines(proc, lines: queue.Queue, rank: int) -> None:
  for line in proc.stdout:
    lines.put((rank, line))


@pytest.mark.slow
def test_a_hung_process_of_two_is_named_and_both_dump_their_stacks(tmp_path):
  args = tiny_args(
    f"base_output_directory={tmp_path}", "steps=200", "per_device_batch_size=1", "step_watchdog_min_seconds=3"
  )
  command = [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", "run_name=hang", "enable_checkpointing=false", *args]
  procs = start_cpu_processes(command, devices_per_process=2, rank_env={1: {fault_injection.ENV: "hang_at_step:3"}})
  lines, outputs = queue.Queue(), ["", ""]
  for rank, proc in enumerate(procs):
    threading.Thread(target=_read_lines, args=(proc, lines, rank), daemon=True).start()
  hung_at = None
  try:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not ("behind: process 1. last step 2" in outputs[0] and "in _hang" in outputs[1]):
      try:
        rank, line = lines.get(timeout=1)
      except queue.Empty:
        continue
      outputs[rank] += line
      if hung_at is None and "hangs before step 3" in line:
        hung_at = time.monotonic()
    reported_at = time.monotonic()
  finally:
    for proc in procs:
      proc.kill()
  assert hung_at is not None, outputs[1][-3000:]
  assert reported_at - hung_at < 30, "the report came long after step_watchdog_min_seconds=3"
  assert "Step watchdog: stacks of every thread when a step takes over 10 x the median step time" in outputs[0]
  for rank, step in ((0, 4), (1, 3)):
    assert re.search(f"Step watchdog: process {rank} has been in step {step} for \\d+ s", outputs[rank]), outputs[rank][
      -3000:
    ]
  assert "in _hang" in outputs[1]  # process 1's main thread, where the test hangs it
  assert "MaxText/train.py" in outputs[0]  # process 0's main thread, waiting in the loop for step 3
  assert re.search(
    r"Step watchdog: behind: process 1\. last step 2: process 1 \(in step 3 for up to \d+ s\); "
    r"last step 3: process 0 \(in step 4",
    outputs[0],
  ), outputs[0][-3000:]
