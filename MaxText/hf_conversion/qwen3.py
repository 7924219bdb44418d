"""Qwen3 (transformers Qwen3ForCausalLM) <-> MaxText decoder_block=qwen3: Llama's tensors plus q/k RMSNorms."""

from MaxText.errors import UserError
from MaxText.hf_conversion import hf_config, llama
from MaxText.hf_conversion.tables import Family, Param

LAYER_PARAMS = (
  *llama.LAYER_PARAMS,
  Param("self_attention/query_norm/scale", "model.layers.{i}.self_attn.q_norm.weight"),
  Param("self_attention/key_norm/scale", "model.layers.{i}.self_attn.k_norm.weight"),
)


def config_to_maxtext(hf: dict, where: str) -> dict:
  hf_config.reject_true(hf, ("attention_bias",), where)
  if hf.get("use_sliding_window"):
    raise UserError(f"{where}: use_sliding_window=true is not supported for qwen3")
  return hf_config.decoder_keys(hf, where, "qwen3")


def config_to_hf(cfg) -> dict:
  return dict(hf_config.decoder_config(cfg, "qwen3", "Qwen3ForCausalLM"), use_sliding_window=False)


FAMILY = Family(
  name="qwen3",
  model_types=("qwen3",),
  architecture="Qwen3ForCausalLM",
  decoder_block="qwen3",
  global_params=llama.GLOBAL_PARAMS,
  layer_params=LAYER_PARAMS,
  config_to_maxtext=config_to_maxtext,
  config_to_hf=config_to_hf,
)
