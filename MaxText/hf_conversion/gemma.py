"""Gemma (transformers GemmaForCausalLM) <-> MaxText decoder_block=gemma.

Both store RMSNorm weights w of y = x * (1 + w), and both scale the embeddings by sqrt(emb) at run time, so
the tensors map as they are. Gemma ties the logits to the embedding.
"""

from MaxText.hf_conversion import hf_config, llama
from MaxText.hf_conversion.tables import Family, Param

GLOBAL_PARAMS = (
  Param("token_embedder/embedding", "model.embed_tokens.weight"),
  Param("decoder/decoder_norm/scale", "model.norm.weight"),
)

LAYER_PARAMS = (
  Param("pre_self_attention_norm/scale", "model.layers.{i}.input_layernorm.weight"),
  *llama.ATTENTION_PARAMS,
  Param("pre_ffw_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
  *llama.MLP_PARAMS,
)


def gemma_keys(hf: dict, where: str, decoder_block: str) -> dict:
  keys = hf_config.decoder_keys(hf, where, decoder_block)
  keys["mlp_activations"] = [
    hf_config.activation(hf, where, "hidden_activation" if "hidden_activation" in hf else "hidden_act"),
    "linear",
  ]
  keys["logits_via_embedding"] = True
  return keys


def config_to_maxtext(hf: dict, where: str) -> dict:
  hf_config.reject_true(hf, ("attention_bias",), where)
  return gemma_keys(hf, where, "gemma")


def config_to_hf(cfg) -> dict:
  keys = hf_config.decoder_config(cfg, "gemma", "GemmaForCausalLM")
  keys.pop("mlp_bias")
  keys["hidden_activation"] = keys["hidden_act"]
  return keys


FAMILY = Family(
  name="gemma",
  model_types=("gemma",),
  architecture="GemmaForCausalLM",
  decoder_block="gemma",
  global_params=GLOBAL_PARAMS,
  layer_params=LAYER_PARAMS,
  config_to_maxtext=config_to_maxtext,
  config_to_hf=config_to_hf,
)
