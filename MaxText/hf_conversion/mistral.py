"""Mistral (transformers MistralForCausalLM) <-> MaxText decoder_block=mistral: Llama's tensors, a sliding window."""

from MaxText.hf_conversion import hf_config, llama
from MaxText.hf_conversion.tables import Family


def config_to_maxtext(hf: dict, where: str) -> dict:
  return dict(hf_config.decoder_keys(hf, where, "mistral"), sliding_window_size=hf.get("sliding_window") or 0)


def config_to_hf(cfg) -> dict:
  keys = hf_config.decoder_config(cfg, "mistral", "MistralForCausalLM")
  return dict(keys, sliding_window=cfg.sliding_window_size or None)


FAMILY = Family(
  name="mistral",
  model_types=("mistral",),
  architecture="MistralForCausalLM",
  decoder_block="mistral",
  global_params=llama.GLOBAL_PARAMS,
  layer_params=llama.LAYER_PARAMS,
  config_to_maxtext=config_to_maxtext,
  config_to_hf=config_to_hf,
)
