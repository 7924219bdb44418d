"""Llama 2 and 3 (transformers LlamaForCausalLM) <-> MaxText decoder_block=llama2."""

from MaxText.hf_conversion import hf_config
from MaxText.hf_conversion.tables import Family, Param

GLOBAL_PARAMS = (
  Param("token_embedder/embedding", "model.embed_tokens.weight"),
  Param("decoder/decoder_norm/scale", "model.norm.weight"),
  Param("decoder/logits_dense/kernel", "lm_head.weight", "transpose", untied_only=True),
)

ATTENTION_PARAMS = (
  Param("self_attention/query/kernel", "model.layers.{i}.self_attn.q_proj.weight", "heads_in"),
  Param("self_attention/key/kernel", "model.layers.{i}.self_attn.k_proj.weight", "heads_in"),
  Param("self_attention/value/kernel", "model.layers.{i}.self_attn.v_proj.weight", "heads_in"),
  Param("self_attention/out/kernel", "model.layers.{i}.self_attn.o_proj.weight", "heads_out"),
)

MLP_PARAMS = (
  Param("mlp/wi_0/kernel", "model.layers.{i}.mlp.gate_proj.weight", "transpose"),
  Param("mlp/wi_1/kernel", "model.layers.{i}.mlp.up_proj.weight", "transpose"),
  Param("mlp/wo/kernel", "model.layers.{i}.mlp.down_proj.weight", "transpose"),
)

LAYER_PARAMS = (
  Param("pre_self_attention_layer_norm/scale", "model.layers.{i}.input_layernorm.weight"),
  *ATTENTION_PARAMS,
  Param("post_self_attention_layer_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
  *MLP_PARAMS,
)

_UNSUPPORTED = ("attention_bias", "mlp_bias")


def config_to_maxtext(hf: dict, where: str) -> dict:
  """Llama 2 and 3, and Llama 3.1's RoPE scaling (rope_type llama3)."""
  hf_config.reject_true(hf, _UNSUPPORTED, where)
  theta, scaling = hf_config.rope(hf, where)
  keys = hf_config.common_keys(hf, where, "llama2", theta)
  if scaling:
    keys.update(hf_config.llama3_rope_keys(scaling, where))
  return keys


def config_to_hf(cfg) -> dict:
  return dict(hf_config.decoder_config(cfg, "llama", "LlamaForCausalLM"), rope_scaling=hf_config.llama3_rope_config(cfg))


FAMILY = Family(
  name="llama",
  model_types=("llama",),
  architecture="LlamaForCausalLM",
  decoder_block="llama2",
  global_params=GLOBAL_PARAMS,
  layer_params=LAYER_PARAMS,
  config_to_maxtext=config_to_maxtext,
  config_to_hf=config_to_hf,
)
