"""The identical-loss gate of refactors: the same runs give the same losses, params and shardings as recorded.

The figures in loss_gate_reference.json of the first eight RUNS were recorded from commit 5908f91 (before the core
refactor), those of the others (DPO, LoRA, QLoRA, DeepSeek's MTP and routing bias, numerics stats with LoRA, a
pipeline, context-parallel SFT) from commit 1752d65 (before the feature-protocol refactor), with

    python3 -m MaxText.tests.loss_gate_test --record

which runs and records only the RUNS that the reference lacks, leaving every recorded entry as it is (to record a
run again, delete its entry first).

Each run trains the tiny model for a few steps in float32 (one child process with 8 CPU devices, see
sharded_runs.py); the losses must match to a relative 1e-6, and every param's path, shard shape and partition spec
exactly, so that checkpoints written before still restore and the HF conversion tables still apply.
"""

import json
import os
import sys

import numpy as np
import pytest

from MaxText.tests.helpers import CHAT_DATA, DPO, LORA, REPO_ROOT, cpu_env, run_args, run_python, write_data_files
from MaxText.tests.tiny_models import DEEPSEEK

REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loss_gate_reference.json")
STEPS = 4

# name -> (devices, extra args); {stats_yaml}, {tokenizer}, {pairs} and {chat} are files that _runs writes.
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
  # Recorded from 1752d65.
  "dpo": (
    1,
    ["decoder_block=llama2", *DPO],
  ),
  "lora": (1, ["decoder_block=llama2", *LORA]),
  "qlora_nf4_accum2": (
    1,
    ["decoder_block=llama2", *LORA, "lora_weight_qtype=nf4", "gradient_accumulation_steps=2"],
  ),
  "deepseek_mtp_routing_bias": (
    1,
    [*DEEPSEEK, "mtp_num_layers=1", "routed_bias=true", "routed_bias_update_rate=0.01"],
  ),
  "numerics_stats_lora": (1, ["decoder_block=llama2", "numerics_debug_config={stats_yaml}", *LORA]),
  # pipeline_test's stage4_fsdp2: 8 layers in 4 stages of 2 repeats (reordered in memory), 4 microbatches.
  "pipeline": (
    8,
    ["decoder_block=llama2", "base_num_decoder_layers=8", "ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2"],
  ),
  # Completion-only SFT on packed chats, the sequence split 4 ways over context (all_gather, load balanced), 8 rows.
  "context_sft": (
    8,
    [
      "decoder_block=llama2",
      "use_sft=true",
      "sft_train_on_completion_only=true",
      "train_data_columns=['messages']",
      "max_target_length=64",
      "per_device_batch_size=1",
      *CHAT_DATA,
      "hf_train_files={chat}",
      "ici_context_parallelism=4",
      "ici_fsdp_parallelism=2",
    ],
  ),
}


def _runs(tmp_path, names) -> list[dict]:
  files = write_data_files(tmp_path)
  runs = []
  for name in names:
    devices, extra = RUNS[name]
    runs.append({"name": name, "devices": devices, "args": run_args(tmp_path, name, STEPS, files, *extra)})
  return runs


def run_gate(tmp_path, names=tuple(RUNS)) -> dict:
  """{run name: {"loss": [...], "params": {path: [shard shape, spec]}}} of the RUNS `names`, from one child process."""
  runs_path, report_path = tmp_path / "runs.json", tmp_path / "report.json"
  runs_path.write_text(json.dumps(_runs(tmp_path, names)))
  result = run_python(["-m", "MaxText.tests.sharded_runs", str(runs_path), str(report_path)], env_extra=cpu_env(8))
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
  report = json.loads(report_path.read_text())
  return {name: {"loss": report[name]["metrics"]["learning/loss"], "params": report[name]["params"]} for name in names}


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
  params = _without_new_axes(gate[name]["params"]) if name in RECORDED_AT_5908F91 else gate[name]["params"]
  assert params == reference[name]["params"]


# Mesh axes added to base.yml's rules after the recording at 5908f91; of size 1 in each of those runs, so a spec
# naming them shards the same as one that does not. The runs recorded later hold them in their specs as they are
# (a run whose entry is recorded again leaves this tuple).
NEW_AXES = ("context",)
RECORDED_AT_5908F91 = (
  "llama_scanned",
  "llama_unrolled_minimal_accum2",
  "fp8",
  "int8",
  "numerics_stats",
  "gemma2",
  "mixtral",
  "fsdp4_tensor2",
)


def _without_new_axes(params: dict) -> dict:
  def strip(spec: str) -> str:
    for axis in NEW_AXES:
      spec = spec.replace(f"'{axis}', ", "").replace(f", '{axis}'", "")
    return spec

  return {path: [shape, strip(spec)] for path, (shape, spec) in params.items()}


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
  import pathlib
  import tempfile

  with open(REFERENCE, encoding="utf-8") as f:
    recorded = json.load(f)
  missing = [name for name in RUNS if name not in recorded]
  with tempfile.TemporaryDirectory() as tmp:
    figures = run_gate(pathlib.Path(tmp), missing) if missing else {}
  with open(REFERENCE, "w", encoding="utf-8") as f:
    json.dump({**figures, **recorded}, f, indent=1, sort_keys=True)
  print(f"recorded {missing} into {REFERENCE} from {REPO_ROOT}; kept {sorted(recorded)}")
