"""Features x layouts: every parallel layout of 8 CPU devices, with every training feature on the llama block and with
every other block, gives the losses of the same global batch on 1 device, or is refused in one line that names a
mathematical reason (REFUSALS).

A child process per case trains its 1-device run and its four layouts (sharded_runs.py, 3 steps each at
learning_rate=1e-2, float32); the losses of a cell must equal its 1-device run's to a relative 1e-5. Slow: about 10
minutes here.
"""

import json

import numpy as np
import pytest

from MaxText.tests.helpers import (
  BASE_YML,
  CHAT_DATA,
  DPO,
  LORA,
  TRAIN_PY,
  cpu_env,
  run_args,
  run_python,
  write_data_files,
)
from MaxText.tests.tiny_models import DEEPSEEK, TINY_GPT_OSS, TINY_LLAMA4

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
  # nf4's blocks of 64 input rows must split over fsdp x context x expert (up to 8): every kernel's input is 512.
  "qlora": [
    *LLAMA,
    *LORA,
    "lora_weight_qtype=nf4",
    "base_emb_dim=512",
    "base_mlp_dim=512",
    "head_dim=128",
  ],
  "dpo": [*LLAMA, *DPO],
  # packing=false: a packed Hugging Face stream is packed per data shard, so its batches depend on the layout.
  "sft": [
    *LLAMA,
    "use_sft=true",
    "packing=false",
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
  "z_loss": [*LLAMA, "z_loss_multiplier=1e-2"],
  "muon": [*LLAMA, "opt_type=muon"],
  "muon_lora": [*LLAMA, *LORA, "opt_type=muon"],  # Muon on the adapters alone
  # A teacher twice as deep as the student ({teacher}: the fixture's, trained one step on 1 device); 4 and 8 layers
  # over 2 pipeline stages are 2 and 4 repeats, so each model holds its layers in its own memory order.
  "distill": [
    *LLAMA,
    "base_num_decoder_layers=4",
    "use_distillation=true",
    "distill_temperature=2",
    "teacher_overrides.base_num_decoder_layers=8",
    "teacher_overrides.load_parameters_path={teacher}",
  ],
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
  "llama4": [*TINY_LLAMA4, "base_num_decoder_layers=8"],  # 2 blocks of 4: one per pipeline stage
  "gpt_oss": TINY_GPT_OSS,
}
CASES = {**FEATURES, **BLOCKS}

# (case, layout) -> a fragment of the one line that refuses it; each names why the maths does not allow it.
REFUSALS: dict[tuple[str, str], str] = {}

# Cases compared at a looser relative tolerance, and why. int8: qwix's symmetric int8 maps each row's largest
# magnitude to +-127.5, a rounding tie, so the last-bit differences between two layouts' float sums (an RMS norm
# vectorised otherwise, in data parallelism too) move that element a whole int8 step; the losses then differ by
# about 1e-4 from step 0, in every layout alike.
ROUNDING_TOLERANCE = {"int8": 1e-3}

# (case, layout) -> what is not done yet: these cells are refused (in one line) or differ, for reasons of this
# implementation, not of the maths. Each is an expected failure, strict: a cell that starts to pass fails the test
# until it leaves this table.
NOT_YET: dict[tuple[str, str], str] = {}


def _runs(tmp_path, case: str, files: dict) -> list[dict]:
  runs = []
  for layout, layout_args in [("one", [])] + list(LAYOUTS.items()):
    devices = 1 if layout == "one" else 8
    name = f"{case}.{layout}"
    args = run_args(tmp_path, name, STEPS, files, f"per_device_batch_size={ROWS // devices}", *CASES[case], *layout_args)
    runs.append({"name": name, "devices": devices, "args": args, "may_refuse": layout != "one"})
  return runs


def _teacher(tmp_path) -> str:
  """The distillation case's teacher: an 8-layer llama's params after one train.py step on 1 device."""
  args = run_args(tmp_path, "teacher", 1, {}, *LLAMA, "base_num_decoder_layers=8", "enable_checkpointing=true")
  result = run_python([TRAIN_PY, BASE_YML, *args], env_extra=cpu_env(1))
  assert result.returncode == 0, result.stderr[-3000:]
  return str(tmp_path / "teacher" / "checkpoints" / "0" / "items")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  """Each case's five runs in a child process of its own (a crash there, such as an XLA:CPU collective that times
  out, fails that case's cells only)."""
  tmp_path = tmp_path_factory.mktemp("interaction")
  files = write_data_files(tmp_path)
  files["teacher"] = _teacher(tmp_path)
  merged = {}
  for case in CASES:
    runs_path, report_path = tmp_path / f"{case}.runs.json", tmp_path / f"{case}.report.json"
    runs_path.write_text(json.dumps(_runs(tmp_path, case, files)))
    env = cpu_env(8, **({"JAX_ENABLE_COMPILATION_CACHE": "false"} if case in UNCACHED else {}))
    result = run_python(["-m", "MaxText.tests.sharded_runs", str(runs_path), str(report_path)], env_extra=env)
    if result.returncode == 0:
      merged.update(json.loads(report_path.read_text()))
    else:
      lines = [line for line in result.stderr.splitlines() if line.strip()]
      crash = next((line for line in lines if "Termination timeout" in line or "Error" in line), lines[-1:] or [""])
      merged.update({f"{case}.{layout}": {"crashed": str(crash)[:300]} for layout in ["one", *LAYOUTS]})
  return merged


def cell(report, case: str, layout: str) -> str:
  """'ok', 'refused: <line>', or what differs from 1 device."""
  run, one = report[f"{case}.{layout}"], report[f"{case}.one"]
  if "crashed" in run:
    return f"crashed: {run['crashed']}"
  if "refused" in run:
    return f"refused: {run['refused']}"
  ours, expected = np.asarray(run["metrics"]["learning/loss"]), np.asarray(one["metrics"]["learning/loss"])
  rtol = ROUNDING_TOLERANCE.get(case, 1e-5)
  if len(ours) != len(expected) or not np.allclose(ours, expected, rtol=rtol, atol=0):
    return f"losses {ours.tolist()} vs 1 device {expected.tolist()}"
  return _statistics_differ(run.get("numerics"), one.get("numerics")) or "ok"


def _statistics_differ(ours, expected) -> str:
  """'' when numerics_debug_config's statistics (rows of step, layer, tensor, stat, value) equal 1 device's: relative
  1e-4, and near zero within 1e-6 of the largest value of that statistic."""
  if ours is None and expected is None:
    return ""
  key = lambda r: (r["step"], r["layer"], r["tensor"], r["stat"])  # noqa: E731
  ours, expected = ({key(r): r["value"] for r in rows or []} for rows in (ours, expected))
  if ours.keys() != expected.keys():
    return f"statistics rows {sorted(set(ours) ^ set(expected))[:3]} differ from 1 device's"
  for k, value in expected.items():
    scale = max(abs(v) for j, v in expected.items() if j[2:] == k[2:])
    if not np.isclose(ours[k], value, rtol=1e-4, atol=1e-6 * scale):
      return f"statistic {k}: {ours[k]} vs 1 device {value}"
  return ""


# Cases run without the persistent compilation cache: a multi-device step with the numerics statistics, compiled
# afresh, runs; the same step loaded from the cache stops at step 1 in an all-gather whose 8 in-process devices never
# meet (XLA:CPU aborts after 40 s). Seen at 1752d65 too; not yet reported upstream.
UNCACHED = ("numerics",)


def _cells():
  for case in CASES:
    for layout in LAYOUTS:
      gap = NOT_YET.get((case, layout))
      yield pytest.param(case, layout, marks=[pytest.mark.xfail(strict=True, reason=gap)] if gap else [])


@pytest.mark.slow
@pytest.mark.parametrize("case,layout", list(_cells()))
def test_each_layout_with_each_feature_and_block_equals_one_device_or_is_refused_for_a_reason(report, case, layout):
  found = cell(report, case, layout)
  refusal = REFUSALS.get((case, layout))
  if refusal is None:
    assert found == "ok", f"{case} x {layout}: {found}"
  else:
    assert found.startswith("refused: ") and refusal in found, f"{case} x {layout}: {found}"
