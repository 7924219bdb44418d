"""Two processes (jax.distributed on 127.0.0.1, 4 CPU devices each) train exactly like one process with 8 devices,
also when the batch rows of a process are not one block (interleaved) or are held by both (tensor parallelism)."""

import os
import re
import subprocess
import sys

import numpy as np
import portpicker
import pytest

from MaxText.input_pipeline import sample_datasets
from MaxText.tests.helpers import REPO_ROOT, TRAIN_PY, read_metrics, tiny_args

# Mesh axes in another order than base.yml's lay the devices out differently (CPU meshes are a plain
# reshape of the device list: process 0 has devices 0-3). fsdp before data: process 0 holds rows 0-1 and 4-5
# of an 8-row batch. tensor first: each process holds one tensor half of every row, so both hold all rows.
_AXES = ["data", "stage", "fsdp", "fsdp_transpose", "sequence", "tensor", "expert", "autoregressive"]
INTERLEAVED = ["mesh_axes=[" + ",".join(["fsdp", "data"] + [a for a in _AXES if a not in ("fsdp", "data")]) + "]"]
INTERLEAVED += ["ici_data_parallelism=2"]
TENSOR_ACROSS = [
  "mesh_axes=[" + ",".join(["tensor"] + [a for a in _AXES if a != "tensor"]) + "]",
  "ici_tensor_parallelism=2",
]


@pytest.fixture(scope="module")
def data_flags(tmp_path_factory):
  root = tmp_path_factory.mktemp("mp_data")
  texts = sample_datasets.split_texts("train", 400)
  sample_datasets.write_array_records(str(root / "train"), texts, num_shards=2)
  # Two eval documents: rows 0 and 1 of the 8-row eval batch get one each; process 1 holds neither.
  sample_datasets.write_array_records(str(root / "eval"), sample_datasets.split_texts("eval", 2), num_shards=1)
  parquet = sample_datasets.write_parquet(str(root / "train.parquet"), texts)
  grain = ["dataset_type=grain", f"grain_train_files={root}/train.array_record-*"]
  return {
    "grain": grain,
    "grain_small_eval": [*grain, f"grain_eval_files={root}/eval.array_record-*", "eval_interval=2", "eval_steps=2"],
    "hf": ["dataset_type=hf", "hf_path=parquet", f"hf_train_files={parquet}"],
  }


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


LAYOUTS = {  # name: (data, mesh flags, the rows each process loads)
  "blocks": ("grain", [], ["0-3", "4-7"]),
  "interleaved": ("grain_small_eval", INTERLEAVED, ["0-1, 4-5", "2-3, 6-7"]),
  "tensor_across_processes": ("hf", TENSOR_ACROSS, ["0-7", "0-7"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_load_their_rows_and_match_one_process(tmp_path, data_flags, layout):
  data, mesh_flags, rows = LAYOUTS[layout]
  flags = [*data_flags[data], *mesh_flags]
  single = subprocess.run(
    _command(tmp_path, "single", flags),
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
      _command(tmp_path, "multi", flags),
      cwd=REPO_ROOT,
      env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", NNODES="2", NODE_RANK=str(rank)),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for rank in range(2)
  ]
  try:
    outputs = [p.communicate(timeout=300) for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, (_, stderr) in zip(procs, outputs):
    assert p.returncode == 0, stderr[-3000:]
  for rank in range(2):
    assert f"Process {rank} loads rows {rows[rank]} of each 8-row train batch" in outputs[rank][0]
  assert "jax.distributed ready: process 1 of 2" in outputs[1][0]

  one, two = read_metrics(tmp_path / "single.jsonl"), read_metrics(tmp_path / "multi.jsonl")
  assert [m["step"] for m in two] == [0, 1, 2, 3]
  assert [m["learning/total_weights"] for m in two] == [m["learning/total_weights"] for m in one]
  np.testing.assert_allclose([m["learning/loss"] for m in two], [m["learning/loss"] for m in one], rtol=1e-6)
  assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == ["0", "3"]
  if "eval_interval=2" in flags:  # process 1 holds no eval document: it pads instead of failing alone (a hang)

    def evals(stdout):  # (step, eval_loss, perplexity, eval_steps, total_weights) of each eval line
      found = re.findall(
        r"eval after step (\d+): eval_loss=([\d.]+), perplexity=([\d.]+), eval_steps=(\d+), total_weights=(\d+)", stdout
      )
      return np.array(found, dtype=np.float64)

    # The same evals, up to float32 rounding of a sum over other shards (perplexity 6270.228 vs 6270.231 seen).
    assert len(evals(outputs[0][0])) == 2
    np.testing.assert_allclose(evals(outputs[0][0]), evals(single.stdout), rtol=1e-6)
