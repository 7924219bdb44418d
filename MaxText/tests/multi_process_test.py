"""Two processes (jax.distributed on 127.0.0.1, 4 CPU devices each) train exactly like one process with 8 devices."""

import os
import subprocess
import sys

import numpy as np
import portpicker
import pytest

from MaxText.input_pipeline import sample_datasets
from MaxText.tests.helpers import REPO_ROOT, TRAIN_PY, read_metrics, tiny_args


@pytest.fixture(scope="module")
def grain_flags(tmp_path_factory):
  root = tmp_path_factory.mktemp("mp_data")
  sample_datasets.write_array_records(str(root / "train"), sample_datasets.split_texts("train", 400), num_shards=2)
  return ["dataset_type=grain", f"grain_train_files={root}/train.array_record-*"]


def _command(tmp_path, run_name, flags):
  args = tiny_args(
    f"base_output_directory={tmp_path}",
    f"metrics_file={tmp_path / run_name}.jsonl",
    "steps=4",
    "per_device_batch_size=1",
    *flags,
  )
  return [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", f"run_name={run_name}", *args]


def _env(devices, **extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu", **extra)
  return env


def test_two_processes_read_disjoint_rows_and_match_one_process(tmp_path, grain_flags):
  single = subprocess.run(
    _command(tmp_path, "single", grain_flags),
    cwd=REPO_ROOT,
    env=_env(8),
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert single.returncode == 0, single.stderr[-3000:]

  port = portpicker.pick_unused_port()
  procs = [
    subprocess.Popen(
      _command(tmp_path, "multi", grain_flags),
      cwd=REPO_ROOT,
      env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", NNODES="2", NODE_RANK=str(rank)),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for rank in range(2)
  ]
  outputs = [p.communicate(timeout=600) for p in procs]
  for p, (_, stderr) in zip(procs, outputs):
    assert p.returncode == 0, stderr[-3000:]
  assert "Process 0 loads rows [0, 4) of each 8-row train batch" in outputs[0][0]
  assert "Process 1 loads rows [4, 8) of each 8-row train batch" in outputs[1][0]
  assert "jax.distributed ready: process 1 of 2" in outputs[1][0]

  one, two = read_metrics(tmp_path / "single.jsonl"), read_metrics(tmp_path / "multi.jsonl")
  assert [m["step"] for m in two] == [0, 1, 2, 3]
  assert [m["learning/total_weights"] for m in two] == [m["learning/total_weights"] for m in one]
  np.testing.assert_allclose([m["learning/loss"] for m in two], [m["learning/loss"] for m in one], rtol=1e-6)
  assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == ["0", "3"]
