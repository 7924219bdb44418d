"""Gemma 2 (transformers Gemma2ForCausalLM) <-> MaxText decoder_block=gemma2.

A MaxText block holds HF layers 2i (`local`, sliding window) and 2i+1 (`global`); each has Gemma's tensors
plus the post-attention and post-feed-forward norms.
"""

import dataclasses

from MaxText.errors import UserError
from MaxText.hf_conversion import gemma, hf_config, llama
from MaxText.hf_conversion.tables import Family, Param

# One Gemma 2 (and Gemma 3) decoder layer: Gemma's tensors plus the post-attention and post-feed-forward norms.
DECODER_LAYER_PARAMS = (
  Param("pre_self_attention_norm/scale", "model.layers.{i}.input_layernorm.weight"),
  *llama.ATTENTION_PARAMS,
  Param("post_self_attention_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
  Param("pre_ffw_norm/scale", "model.layers.{i}.pre_feedforward_layernorm.weight"),
  *llama.MLP_PARAMS,
  Param("post_ffw_norm/scale", "model.layers.{i}.post_feedforward_layernorm.weight"),
)


def _sublayer(prefix: str, offset: int) -> tuple:
  return tuple(dataclasses.replace(p, maxtext=f"{prefix}/{p.maxtext}", layer_offset=offset) for p in DECODER_LAYER_PARAMS)


LAYER_PARAMS = _sublayer("local", 0) + _sublayer("global", 1)


def config_to_maxtext(hf: dict, where: str) -> dict:
  hf_config.reject_true(hf, ("attention_bias",), where)
  layers = hf_config.require(hf, "num_hidden_layers", where)
  expected = ["sliding_attention", "full_attention"] * (layers // 2)
  if layers % 2 or hf.get("layer_types", expected) != expected:
    raise UserError(f"{where}: MaxText's gemma2 alternates sliding and full attention layers, an even number of them")
  return dict(gemma.gemma_keys(hf, where, "gemma2"), **attention_keys(hf, where))


def attention_keys(hf: dict, where: str) -> dict:
  """What Gemma 2 and 3 add to Gemma's keys: the window, the query scale, the soft caps and the post-norms."""
  return {
    "sliding_window_size": hf_config.require(hf, "sliding_window", where),
    "query_pre_attn_scalar": float(hf_config.require(hf, "query_pre_attn_scalar", where)),
    "attn_logits_soft_cap": float(hf.get("attn_logit_softcapping") or 0.0),
    "final_logits_soft_cap": float(hf.get("final_logit_softcapping") or 0.0),
    "use_post_attn_norm": True,
    "use_post_ffw_norm": True,
  }


def attention_config(cfg) -> dict:
  """attention_keys' config.json side."""
  return {
    "sliding_window": cfg.sliding_window_size,
    "query_pre_attn_scalar": hf_config.number(cfg.query_pre_attn_scalar or cfg.head_dim),
    "attn_logit_softcapping": cfg.attn_logits_soft_cap or None,
    "final_logit_softcapping": cfg.final_logits_soft_cap or None,
  }


def config_to_hf(cfg) -> dict:
  keys = dict(gemma.config_to_hf(cfg), **attention_config(cfg))
  keys.update(
    architectures=["Gemma2ForCausalLM"],
    model_type="gemma2",
    layer_types=["sliding_attention", "full_attention"] * (cfg.num_decoder_layers // 2),
  )
  return keys


FAMILY = Family(
  name="gemma2",
  model_types=("gemma2",),
  architecture="Gemma2ForCausalLM",
  decoder_block="gemma2",
  global_params=gemma.GLOBAL_PARAMS,
  layer_params=LAYER_PARAMS,
  config_to_maxtext=config_to_maxtext,
  config_to_hf=config_to_hf,
)
