"""SIGKILL a 40-step run at three points (one during an async checkpoint save), restart it each time
with the same command, and get per-step losses bitwise identical to an uninterrupted run."""

import signal

import pytest

from MaxText.tests.helpers import KILL_RESUME_STEPS, kill_resume_command, launch_run, read_metrics

# A pipeline of 2 stages x 2 repeats holds its layers reordered in memory (pipeline_layout); its checkpoints do not.
PIPELINED = ("base_num_decoder_layers=4", "ici_pipeline_parallelism=2", "num_pipeline_repeats=2")


@pytest.mark.slow
@pytest.mark.parametrize("devices,per_device_batch,extra", [(1, 8, ()), (8, 1, ()), (8, 1, PIPELINED)])
def test_killed_and_restarted_run_matches_an_uninterrupted_one(tmp_path, devices, per_device_batch, extra):
  reference = kill_resume_command(tmp_path, "reference", per_device_batch, *extra)
  code, stderr = launch_run(reference, devices)
  assert code == 0, stderr[-3000:]

  command = kill_resume_command(tmp_path, "killed", per_device_batch, *extra)
  for kill_at, fault in ((5, None), (23, None), (None, "kill_during_save:30")):
    code, stderr = launch_run(command, devices, kill_at_step=kill_at, fault=fault)
    assert code == -signal.SIGKILL, f"the run was meant to be killed mid-way: {code} {stderr[-2000:]}"
  code, stderr = launch_run(command, devices)
  assert code == 0, stderr[-3000:]

  expected = read_metrics(tmp_path / "reference.jsonl")
  got = read_metrics(tmp_path / "killed.jsonl")
  assert [m["step"] for m in got] == list(range(KILL_RESUME_STEPS))
  assert [m["learning/loss"] for m in got] == [m["learning/loss"] for m in expected]  # bitwise
  assert [m["learning/grad_norm"] for m in got] == [m["learning/grad_norm"] for m in expected]
