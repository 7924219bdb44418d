"""SIGKILL a 40-step run at three points (one during an async checkpoint save), restart it each time
with the same command, and get per-step losses bitwise identical to an uninterrupted run."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from MaxText.runtime import fault_injection
from MaxText.tests.helpers import REPO_ROOT, TRAIN_PY, read_metrics, tiny_args

STEPS = 40


def _command(tmp_path, run_name, per_device_batch, *extra):
  args = tiny_args(
    f"base_output_directory={tmp_path}",
    f"metrics_file={tmp_path / run_name}.jsonl",
    f"steps={STEPS}",
    "checkpoint_period=10",
    "learning_rate=1e-2",
    "base_emb_dim=64",
    "base_mlp_dim=256",
    "max_target_length=64",
    f"per_device_batch_size={per_device_batch}",
    *extra,
  )
  return [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", f"run_name={run_name}", *args]


def _steps_done(metrics_path) -> int:
  return len(read_metrics(metrics_path)) if metrics_path.exists() else 0


def _launch(command, devices, kill_at_step=None, fault=None):
  """Runs the command; SIGKILLs it once the metrics file reaches kill_at_step. Returns the exit code."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  if fault:
    env[fault_injection.ENV] = fault
  metrics_path = pathlib.Path(next(a.split("=", 1)[1] for a in command if a.startswith("metrics_file=")))
  proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  if kill_at_step is not None:
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and _steps_done(metrics_path) < kill_at_step:
      time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
  _, stderr = proc.communicate(timeout=600)
  return proc.returncode, stderr


# A pipeline of 2 stages x 2 repeats holds its layers reordered in memory (pipeline_layout); its checkpoints do not.
PIPELINED = ("base_num_decoder_layers=4", "ici_pipeline_parallelism=2", "num_pipeline_repeats=2")


@pytest.mark.slow
@pytest.mark.parametrize("devices,per_device_batch,extra", [(1, 8, ()), (8, 1, ()), (8, 1, PIPELINED)])
def test_killed_and_restarted_run_matches_an_uninterrupted_one(tmp_path, devices, per_device_batch, extra):
  reference = _command(tmp_path, "reference", per_device_batch, *extra)
  code, stderr = _launch(reference, devices)
  assert code == 0, stderr[-3000:]

  command = _command(tmp_path, "killed", per_device_batch, *extra)
  for kill_at, fault in ((5, None), (23, None), (None, "kill_during_save:30")):
    code, stderr = _launch(command, devices, kill_at_step=kill_at, fault=fault)
    assert code == -signal.SIGKILL, f"the run was meant to be killed mid-way: {code} {stderr[-2000:]}"
  code, stderr = _launch(command, devices)
  assert code == 0, stderr[-3000:]

  expected = read_metrics(tmp_path / "reference.jsonl")
  got = read_metrics(tmp_path / "killed.jsonl")
  assert [m["step"] for m in got] == list(range(STEPS))
  assert [m["learning/loss"] for m in got] == [m["learning/loss"] for m in expected]  # bitwise
  assert [m["learning/grad_norm"] for m in got] == [m["learning/grad_norm"] for m in expected]
