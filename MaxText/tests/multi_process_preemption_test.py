"""A 2-process job (4 CPU devices each, one slice per process) trains like 1 process x 8 devices, and a SIGTERM
to one of its processes makes both save the same step and exit 0; restarted, it ends with the same losses."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from MaxText.tests.helpers import (
  REPO_ROOT,
  TRAIN_PY,
  cpu_env,
  finish_processes,
  read_metrics,
  start_cpu_processes,
  tiny_args,
)

STEPS = 10


def _command(tmp_path, run_name, *flags):
  args = tiny_args(
    f"base_output_directory={tmp_path}",
    f"metrics_file={tmp_path / run_name}.jsonl",
    f"steps={STEPS}",
    "checkpoint_period=3",
    "learning_rate=1e-2",
    "per_device_batch_size=1",
    "log_all_processes=true",  # both processes report where they stopped
    *flags,
  )
  return [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", f"run_name={run_name}", *args]


def _steps_written(metrics: pathlib.Path) -> int:
  return len(read_metrics(metrics)) if metrics.exists() else 0


@pytest.mark.slow
def test_sigterm_to_one_process_saves_one_step_on_both_and_the_restart_matches_one_process(tmp_path):
  single = subprocess.run(
    _command(tmp_path, "single"), cwd=REPO_ROOT, env=cpu_env(8), capture_output=True, text=True, timeout=600, check=False
  )
  assert single.returncode == 0, single.stderr[-3000:]

  command = _command(tmp_path, "multi")
  procs = start_cpu_processes(command)
  metrics = tmp_path / "multi.jsonl"
  deadline = time.time() + 300
  while _steps_written(metrics) < 2 and time.time() < deadline and all(p.poll() is None for p in procs):
    time.sleep(0.005)
  # Pause both (they run in lock step through their collectives), so the SIGTERM lands mid-run on any machine.
  for p in procs:
    p.send_signal(signal.SIGSTOP)
  done_before_signal = _steps_written(metrics)
  procs[1].send_signal(signal.SIGTERM)
  for p in procs:
    p.send_signal(signal.SIGCONT)
  codes, outputs = finish_processes(procs)
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
  assert 2 <= done_before_signal < STEPS - 1, done_before_signal

  stops = [re.search(r"Stopping because received SIGTERM: the last step is (\d+)", out) for out in outputs]
  assert all(stops), "\n".join(o[-3000:] for o in outputs)
  stop_step = int(stops[0].group(1))
  assert int(stops[1].group(1)) == stop_step < STEPS - 1
  assert f"Saving the checkpoint of step {stop_step}" in outputs[0]
  assert str(stop_step) in os.listdir(tmp_path / "multi" / "checkpoints")

  codes, outputs = finish_processes(start_cpu_processes(command))  # the same command resumes
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
  assert f"Restored the checkpoint of step {stop_step}" in outputs[0]
  assert "Mesh: 8 devices in 2 slices" in outputs[0]

  one, two = read_metrics(tmp_path / "single.jsonl"), read_metrics(metrics)
  assert [m["step"] for m in two] == list(range(STEPS))
  np.testing.assert_allclose([m["learning/loss"] for m in two], [m["learning/loss"] for m in one], rtol=1e-5)
