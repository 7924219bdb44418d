"""Features x layouts: every parallel layout of 8 CPU devices, with every training feature on the llama block and with
every other block, gives the losses of the same global batch on 1 device, or is refused in one line that names a
mathematical reason (REFUSALS).

One child process trains all the runs (sharded_runs.py, 3 steps each at learning_rate=1e-2, float32); the losses of
a cell must equal its 1-device run's to a relative 1e-5. Slow: about 15 minutes here.
"""

import json

import numpy as np
import pytest

from MaxText.tests.helpers import cpu_env, run_python
from MaxText.tests.tiny_data import CHAT_DATA, DEEPSEEK, DPO, LORA, run_args, write_data_files

STEPS = 3
ROWS = 8  # the global batch: 1 row per device on 8 devices, 8 rows on 1

LAYOUTS = {
  "pipeline": ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"],
  "context": ["ici_context_parallelism=4", "ici_fsdp_parallelism=2"],
  "expert": ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"],
  "tensor": ["ici_tensor_parallelism=2", "ici_fsdp_parallelism=4"],
}
LLAMA = ["decoder_block=llama2"]
FEATURES = {
  "lora": [*LLAMA, *LORA],
  "qlora": [*LLAMA, *LORA, "lora_weight_qtype=nf4"],
  "dpo": [*LLAMA, *DPO],
  "sft": [
    *LLAMA,
    "use_sft=true",
    "train_data_columns=['messages']",
    "max_target_length=64",
    *CHAT_DATA,
    "hf_train_files={chat}",
  ],
  "fp8": [*LLAMA, "quantization=fp8"],
  "int8": [*LLAMA, "quantization=int8"],
  "numerics": [*LLAMA, "numerics_debug_config={stats_yaml}"],
  "mtp": [*LLAMA, "mtp_num_layers=1"],
  "checkify": [*LLAMA, "max_checkify=true"],
}
BLOCKS = {
  "gemma3": [
    "decoder_block=gemma3",
    "mlp_activations=[gelu,linear]",
    "logits_via_embedding=true",
    "sliding_window_size=5",
    "use_post_attn_norm=true",
    "use_post_ffw_norm=true",
  ],
  "deepseek": DEEPSEEK,
  "mixtral": ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2"],
  "qwen3_moe": ["decoder_block=qwen3_moe", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32"],
}
CASES = {**FEATURES, **BLOCKS}

# (case, layout) -> a fragment of the one line that refuses it; each names why the maths does not allow it.
REFUSALS: dict[tuple[str, str], str] = {}


def _runs(tmp_path) -> list[dict]:
  files = write_data_files(tmp_path)
  runs = []
  for case, case_args in CASES.items():
    for layout, layout_args in [("one", [])] + list(LAYOUTS.items()):
      devices = 1 if layout == "one" else 8
      name = f"{case}.{layout}"
      args = run_args(tmp_path, name, STEPS, files, f"per_device_batch_size={ROWS // devices}", *case_args, *layout_args)
      runs.append({"name": name, "devices": devices, "args": args, "may_refuse": layout != "one"})
  return runs


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("interaction")
  runs_path, report_path = tmp_path / "runs.json", tmp_path / "report.json"
  runs_path.write_text(json.dumps(_runs(tmp_path)))
  result = run_python(
    ["-m", "MaxText.tests.sharded_runs", str(runs_path), str(report_path)], env_extra=cpu_env(8), timeout=1800
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
  return json.loads(report_path.read_text())


def cell(report, case: str, layout: str) -> str:
  """'ok', 'refused: <line>', or what differs from 1 device."""
  run, one = report[f"{case}.{layout}"], report[f"{case}.one"]
  if "refused" in run:
    return f"refused: {run['refused']}"
  ours, expected = np.asarray(run["metrics"]["learning/loss"]), np.asarray(one["metrics"]["learning/loss"])
  if len(ours) == len(expected) and np.allclose(ours, expected, rtol=1e-5, atol=0):
    return "ok"
  return f"losses {ours.tolist()} vs 1 device {expected.tolist()}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_each_layout_with_each_feature_and_block_equals_one_device_or_is_refused_for_a_reason(report, case, layout):
  found = cell(report, case, layout)
  refusal = REFUSALS.get((case, layout))
  if refusal is None:
    assert found == "ok", f"{case} x {layout}: {found}"
  else:
    assert found.startswith("refused: ") and refusal in found, f"{case} x {layout}: {found}"
