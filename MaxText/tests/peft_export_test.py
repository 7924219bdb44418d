"""A LoRA run of each family exported with to_hf: PEFT's adapter on the HF base and the merged checkpoint both give
our LoRA model's logits (llama's own case, with resuming and decoding, is lora_test.py's)."""

import json

import pytest

# Every dense projection that MaxText's LoRA can adapt, in any stack and block sublayer (Gemma 2's local/global,
# DeepSeek's dense_layers/moe_layers): attention (MLA's too) and the dense MLP. MoE routers and experts are not
# DenseGeneral layers with adapters (layers/moe.py runs them through linears.PLAIN).
ALL_PROJECTIONS = "^decoder/(layers|dense_layers|moe_layers)/(.*/)?(self_attention/[a-z_0-9]+|mlp/(wi_0|wi_1|wo))$"
# case -> (family, lora_module_path). Gemma 2's local layers only: adapters on every other HF layer. DeepSeek's dense
# MLP is left out: PEFT would read its adapter as the experts' (below).
CASES = {
  "gemma2": ("gemma2", ALL_PROJECTIONS),
  "gemma2-local": ("gemma2", "^decoder/layers/local/(self_attention|mlp)/"),
  "mixtral": ("mixtral", ALL_PROJECTIONS),
  "qwen3_moe": ("qwen3_moe", ALL_PROJECTIONS),
  "deepseek": ("deepseek", "^decoder/(dense_layers|moe_layers)/self_attention/"),  # MLA's 5 projections, both stacks
}


def _lora_run(tmp_path, family: str, module_path: str):
  """A tiny HF model of `family`, converted, and 3 LoRA steps on it: (hf_dir, model.yml, base params, run dir)."""
  from MaxText.tests.helpers import lora_run  # pylint: disable=import-outside-toplevel
  from MaxText.tests.tiny_models import build_hf_model  # pylint: disable=import-outside-toplevel

  hf_dir = build_hf_model(str(tmp_path / "hf"), family)
  lora = ["enable_lora=true", "lora_rank=4", "lora_alpha=8", f"lora_module_path={module_path}"]
  # Short rows: one device's batch of 16-token rows keeps the five families' runs quick.
  model_yml, base_params, run_dir, _ = lora_run(tmp_path, hf_dir, *lora, "per_device_batch_size=1", "max_target_length=16")
  return hf_dir, model_yml, base_params, run_dir


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_and_merged_exports_give_our_logits(tmp_path, case):
  from MaxText.hf_conversion import logit_check  # pylint: disable=import-outside-toplevel
  from MaxText.tests.tiny_models import exports_give_our_logits  # pylint: disable=import-outside-toplevel

  family, module_path = CASES[case]
  hf_dir, model_yml, base_params, run_dir = _lora_run(tmp_path, family, module_path)
  tokens = logit_check.random_tokens(256, length=24)  # longer than the sliding windows (16)
  exports_give_our_logits(tmp_path, run_dir, hf_dir, base_params, model_yml, tokens, label=f"{case} ")
  with open(tmp_path / "peft" / "adapter_config.json", encoding="utf-8") as f:
    print(f"{case} target_modules {json.load(f)['target_modules']}")


def test_an_adapter_outside_the_hf_layers_is_one_line(tmp_path):
  """DeepSeek's multi-token prediction layer has no module in transformers' model: its adapter is refused, naming
  it, before anything is written."""
  import types  # pylint: disable=import-outside-toplevel

  from MaxText.errors import UserError  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import deepseek, peft  # pylint: disable=import-outside-toplevel

  config = types.SimpleNamespace(
    decoder_block="deepseek", num_decoder_layers=3, first_num_dense_layers=1, param_scan_axis=1, lora_rank=4, lora_alpha=8
  )
  module = ("decoder", "mtp_1", "layer", "self_attention", "out")
  stores = {module + ("lora_a",): None, module + ("lora_b",): None}
  with pytest.raises(UserError) as error:
    peft.write_peft(config, deepseek.FAMILY, stores, str(tmp_path / "peft"))
  assert str(error.value) == (
    "LoRA export: decoder/mtp_1/layer/self_attention/out is outside the HF model's decoder layers, so PEFT's adapter "
    "cannot hold it; export with --merge_lora, or train with a lora_module_path that leaves it out"
  )
  assert not (tmp_path / "peft").exists()


def test_deepseeks_dense_mlp_adapter_is_one_line(tmp_path):
  """PEFT on transformers 5 loads a deepseek_v3 gate_proj/up_proj/down_proj adapter as the experts' fused weights,
  leaving the dense layers' MLP unadapted (logits off by 2.8 on the tiny model): refused, merged export suggested."""
  import types  # pylint: disable=import-outside-toplevel

  from MaxText.errors import UserError  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import deepseek, peft  # pylint: disable=import-outside-toplevel

  config = types.SimpleNamespace(
    decoder_block="deepseek", num_decoder_layers=3, first_num_dense_layers=1, param_scan_axis=1, lora_rank=4, lora_alpha=8
  )
  module = ("decoder", "dense_layers", "mlp", "wi_0")
  stores = {module + ("lora_a",): None, module + ("lora_b",): None}
  with pytest.raises(UserError) as error:
    peft.write_peft(config, deepseek.FAMILY, stores, str(tmp_path / "peft"))
  assert str(error.value) == (
    "LoRA export: decoder/dense_layers/mlp/wi_0 is model.layers.{i}.mlp.gate_proj, which PEFT on transformers 5 loads "
    "as the MoE experts' fused weights of deepseek, not as this nn.Linear; export with --merge_lora, or train with a "
    "lora_module_path that leaves it out"
  )
  assert not (tmp_path / "peft").exists()
