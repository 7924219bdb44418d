"""The identical-loss gate of refactors: the same runs give the same losses, params and shardings as recorded.

The figures in loss_gate_reference.json were recorded from commit 5908f91 (before the core refactor) with

    python3 -m MaxText.tests.loss_gate_test --record

Each run trains the tiny model for a few steps in float32 (one child process with 8 CPU devices, see
sharded_runs.py); the losses must match to a relative 1e-6, and every param's path, shard shape and partition spec
exactly, so that checkpoints written before still restore and the HF conversion tables still apply.
"""

import json
import os
import sys

import numpy as np
import pytest

from MaxText.tests.helpers import REPO_ROOT, cpu_env, run_python, tiny_args

REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loss_gate_reference.json")
STEPS = 4

STATS_YAML = """
all_gemms:
  enabled: true
  layers:
    layer_types: [qkv, attention_out, fc1, fc2]
  collect_tensor_stats:
    enabled: true
    type: [min, max, mean, std, l2_norm, cur_amax]
    tensors: [activation, gradient, weight]
    freq: 1
"""

# name -> (devices, extra args)
RUNS = {
  "llama_scanned": (1, ["decoder_block=llama2"]),
  "llama_unrolled_minimal_accum2": (
    1,
    ["decoder_block=llama2", "scan_layers=false", "remat_policy=minimal", "gradient_accumulation_steps=2"],
  ),
  "fp8": (1, ["decoder_block=llama2", "quantization=fp8"]),
  "int8": (1, ["decoder_block=llama2", "quantization=int8"]),
  "numerics_stats": (1, ["decoder_block=llama2", "numerics_debug_config={stats_yaml}"]),
  "gemma2": (1, ["decoder_block=gemma2", "sliding_window_size=8", "attn_logits_soft_cap=50", "final_logits_soft_cap=30"]),
  "mixtral": (1, ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2"]),
  "fsdp4_tensor2": (8, ["decoder_block=llama2", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
}


def _runs(tmp_path) -> list[dict]:
  stats_yaml = tmp_path / "stats.yml"
  stats_yaml.write_text(STATS_YAML)
  runs = []
  for name, (devices, extra) in RUNS.items():
    extra = [a.format(stats_yaml=stats_yaml) for a in extra]
    args = tiny_args(
      f"run_name={name}",
      f"base_output_directory={tmp_path}",
      f"metrics_file={tmp_path / name}.jsonl",
      f"steps={STEPS}",
      "learning_rate=1e-2",
      "warmup_steps_fraction=0",
      "enable_checkpointing=false",
      *extra,
    )
    runs.append({"name": name, "devices": devices, "args": args})
  return runs


def run_gate(tmp_path) -> dict:
  """{run name: {"loss": [...], "params": {path: [shard shape, spec]}}} of the RUNS, from one child process."""
  runs_path, report_path = tmp_path / "runs.json", tmp_path / "report.json"
  runs_path.write_text(json.dumps(_runs(tmp_path)))
  result = run_python(["-m", "MaxText.tests.sharded_runs", str(runs_path), str(report_path)], env_extra=cpu_env(8))
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
  report = json.loads(report_path.read_text())
  return {name: {"loss": report[name]["metrics"]["learning/loss"], "params": report[name]["params"]} for name in RUNS}


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
  return run_gate(tmp_path_factory.mktemp("loss_gate"))


@pytest.fixture(scope="module")
def reference():
  with open(REFERENCE, encoding="utf-8") as f:
    return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_same_losses_params_and_shardings_as_before_the_refactor(gate, reference, name):
  assert len(gate[name]["loss"]) == STEPS
  # float32 on the same CPU: only fusion order may move the last bits; never loosened to pass.
  np.testing.assert_allclose(gate[name]["loss"], reference[name]["loss"], rtol=1e-6, err_msg=name)
  assert _without_new_axes(gate[name]["params"]) == reference[name]["params"]


# Mesh axes added to base.yml's rules after the recording; of size 1 in every run here, so a spec naming them
# shards the same as one that does not.
NEW_AXES = ("context",)


def _without_new_axes(params: dict) -> dict:
  def strip(spec: str) -> str:
    for axis in NEW_AXES:
      spec = spec.replace(f"'{axis}', ", "").replace(f", '{axis}'", "")
    return spec

  return {path: [shape, strip(spec)] for path, (shape, spec) in params.items()}


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
  import pathlib
  import tempfile

  with tempfile.TemporaryDirectory() as tmp:
    figures = run_gate(pathlib.Path(tmp))
  with open(REFERENCE, "w", encoding="utf-8") as f:
    json.dump(figures, f, indent=1, sort_keys=True)
  print(f"recorded {REFERENCE} from {REPO_ROOT}")
