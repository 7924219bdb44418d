"""Two processes (jax.distributed on 127.0.0.1, 4 CPU devices each) train exactly like one process with 8 devices,
also when the batch rows of a process are not one block (interleaved) or are held by both (tensor parallelism)."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from MaxText.input_pipeline import sample_datasets
from MaxText.tests.helpers import (
  REPO_ROOT,
  TRAIN_PY,
  cpu_env,
  finish_processes,
  read_metrics,
  start_cpu_processes,
  tiny_args,
)

# Each process is one slice (CPU devices all report slice 0), so dcn_* axes split across the processes:
# dcn_data (the default fill): process 0 holds rows 0-3 of an 8-row batch. dcn_fsdp with ici_data=2 (data before
# fsdp in data_sharding): process 0 holds rows 0-1 and 4-5. dcn_tensor: each process holds one tensor half of
# every row, so both hold all rows. The 1-process runs spread the same axes over its 8 devices (ici_*).
INTERLEAVED = ["ici_data_parallelism=2"]
TENSOR_ACROSS = ["ici_tensor_parallelism=2"]
ACROSS_PROCESSES = {
  "blocks": [],
  "interleaved": ["dcn_data_parallelism=1", "dcn_fsdp_parallelism=2"],
  "tensor_across_processes": ["dcn_data_parallelism=1", "dcn_tensor_parallelism=2", "ici_tensor_parallelism=1"],
}


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


LAYOUTS = {  # name: (data, mesh flags, the rows each process loads)
  "blocks": ("grain", [], ["0-3", "4-7"]),
  "interleaved": ("grain_small_eval", INTERLEAVED, ["0-1, 4-5", "2-3, 6-7"]),
  "tensor_across_processes": ("hf", TENSOR_ACROSS, ["0-7", "0-7"]),
}


# "blocks" runs with the unit tests; the other layouts (2-4 minutes of subprocesses) with the slow ones.
@pytest.mark.parametrize(
  "layout", [layout if layout == "blocks" else pytest.param(layout, marks=pytest.mark.slow) for layout in LAYOUTS]
)
def test_two_processes_load_their_rows_and_match_one_process(tmp_path, data_flags, layout):
  data, mesh_flags, rows = LAYOUTS[layout]
  flags = [*data_flags[data], *mesh_flags]
  single = subprocess.run(
    _command(tmp_path, "single", flags),
    cwd=REPO_ROOT,
    env=cpu_env(8),
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert single.returncode == 0, single.stderr[-3000:]

  procs = start_cpu_processes(_command(tmp_path, "multi", [*flags, *ACROSS_PROCESSES[layout]]))
  codes, outputs = finish_processes(procs, timeout=300)
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
  for rank in range(2):
    assert f"Process {rank} loads rows {rows[rank]} of each 8-row train batch" in outputs[rank]
  assert "jax.distributed ready: process 1 of 2" in outputs[1]
  assert "Mesh: 8 devices in 2 slices" in outputs[0]

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
    assert len(evals(outputs[0])) == 2
    np.testing.assert_allclose(evals(outputs[0]), evals(single.stdout), rtol=1e-6)
