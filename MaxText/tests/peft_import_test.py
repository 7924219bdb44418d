"""to_maxtext --peft_adapter refuses, in one line, every part of a PEFT adapter that MaxText's LoRA cannot hold
(rather than converting without it: a different model than the adapter's), and says what to do instead."""

import json
import os
import re

import numpy as np
import pytest

from MaxText.errors import UserError

MERGE = r"merge it into its base with PEFT's merge_and_unload\(\), save that and convert it without --peft_adapter$"


@pytest.fixture(scope="module", name="hf_dir")
def _hf_dir(tmp_path_factory):
  from MaxText.tests.tiny_models import hf_llama  # pylint: disable=import-outside-toplevel

  return hf_llama(tmp_path_factory.mktemp("hf"))


def _adapter(hf_dir: str, out_dir: str, **lora_kwargs) -> str:
  import peft  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  torch.manual_seed(1)
  base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  lora_config = peft.LoraConfig(**{"r": 4, "target_modules": ["q_proj"], "init_lora_weights": False, **lora_kwargs})
  peft.get_peft_model(base, lora_config).save_pretrained(out_dir)
  return out_dir


REFUSED = {
  "embedding_lora": (
    dict(target_modules=["q_proj", "embed_tokens"]),
    r"adapts model\.embed_tokens \(lora_embedding_A/B\), which MaxText's LoRA cannot represent",
  ),
  "lm_head_lora": (dict(target_modules=["q_proj", "lm_head"]), r"adapts lm_head \(lora_A/B\), which MaxText's LoRA"),
  "modules_to_save": (
    dict(modules_to_save=["lm_head"]),
    r"holds trained copies of modules_to_save \['lm_head'\], which MaxText's LoRA cannot represent",
  ),
  "trainable_token_indices": (dict(trainable_token_indices=[1, 2]), r"holds trainable_token_indices \[1, 2\], which"),
  "bias": (dict(bias="all"), r"holds trained biases \(bias 'all'\), which MaxText's LoRA cannot represent"),
  "lora_bias": (dict(lora_bias=True), r"holds lora_bias True, which MaxText's LoRA cannot represent"),
  "alpha_pattern": (
    dict(target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 16}),
    r"holds alpha_pattern \{'v_proj': 16\} \(per-module alpha or rank\), which MaxText's LoRA cannot represent",
  ),
  "rank_pattern": (
    dict(target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2}),
    r"holds rank_pattern \{'v_proj': 2\} \(per-module alpha or rank\), which",
  ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_maxtexts_lora_cannot_hold_is_refused_in_one_line(hf_dir, tmp_path, case):
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel

  lora_kwargs, message = REFUSED[case]
  adapter = _adapter(hf_dir, str(tmp_path / "adapter"), **lora_kwargs)
  with pytest.raises(UserError) as refused:
    converter.to_maxtext(hf_dir, str(tmp_path / "maxtext"), adapter)
  text = str(refused.value)
  assert "\n" not in text and text.startswith(f"--peft_adapter {adapter} "), text
  assert re.search(message, text) and re.search(MERGE, text), text
  assert not os.path.exists(tmp_path / "maxtext" / "params")  # refused before anything is written


def test_a_tensor_the_conversion_does_not_read_is_named(hf_dir, tmp_path):
  """The general guard: a tensor of a PEFT feature the conversion does not know is an error naming it."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel

  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel

  adapter = _adapter(hf_dir, str(tmp_path / "adapter"))
  path = os.path.join(adapter, "adapter_model.safetensors")
  tensors = load_file(path)
  tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_future.weight"] = np.ones((4,), np.float32)
  save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(UserError) as refused:
    converter.to_maxtext(hf_dir, str(tmp_path / "maxtext"), adapter)
  text = str(refused.value)
  assert "\n" not in text and re.search(
    r"holds base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_future\.weight, which the conversion does "
    r"not read; " + MERGE,
    text,
  ), text


def test_lora_dropout_is_read_with_a_line_that_it_is_not_applied(hf_dir, tmp_path, capsys):
  """Dropout acts in training only; MaxText's LoRA has none, so the adapter is read (its model is the same)."""
  from MaxText.hf_conversion import llama, peft  # pylint: disable=import-outside-toplevel

  adapter = _adapter(hf_dir, str(tmp_path / "adapter"), lora_dropout=0.1)
  keys = peft.lora_keys(llama.FAMILY, adapter, 2)
  assert keys["lora_module_path"] == "^decoder/layers/(self_attention/query)$"
  err = capsys.readouterr().err
  assert "lora_dropout 0.1 is not applied (MaxText's LoRA has no dropout)" in err, err


def test_to_hf_names_the_base_that_to_maxtext_read(hf_dir, tmp_path):
  """The PEFT export of a converted model with an adapter names its HF source as base_model_name_or_path."""
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel

  adapter = _adapter(hf_dir, str(tmp_path / "adapter"), target_modules=["q_proj", "down_proj"])
  converter.to_maxtext(hf_dir, str(tmp_path / "maxtext"), adapter)
  converter.to_hf(str(tmp_path / "maxtext"), str(tmp_path / "peft"))
  with open(tmp_path / "peft" / "adapter_config.json", encoding="utf-8") as f:
    assert json.load(f)["base_model_name_or_path"] == os.path.abspath(hf_dir)
