"""Qwen3 (transformers Qwen3ForCausalLM) <-> MaxText decoder_block=qwen3: Llama's tensors plus q/k RMSNorms; and
Qwen3-MoE (Qwen3MoeForCausalLM) <-> decoder_block=qwen3_moe: the same attention, per-expert gate/up/down tensors
stacked on MaxText's expert axis 0 (as Mixtral's), the router's `mlp.gate`."""

from MaxText.errors import UserError
from MaxText.hf_conversion import hf_config, llama, mixtral
from MaxText.hf_conversion.tables import Family, Param

QK_NORM_PARAMS = (
  Param("self_attention/query_norm/scale", "model.layers.{i}.self_attn.q_norm.weight"),
  Param("self_attention/key_norm/scale", "model.layers.{i}.self_attn.k_norm.weight"),
)
LAYER_PARAMS = (*llama.LAYER_PARAMS, *QK_NORM_PARAMS)


def config_to_maxtext(hf: dict, where: str) -> dict:
  hf_config.reject_true(hf, ("attention_bias",), where)
  if hf.get("use_sliding_window"):
    raise UserError(f"{where}: use_sliding_window=true is not supported for qwen3")
  return hf_config.decoder_keys(hf, where, "qwen3")


def config_to_hf(cfg) -> dict:
  return dict(hf_config.decoder_config(cfg, "qwen3", "Qwen3ForCausalLM"), use_sliding_window=False)


MOE_LAYER_PARAMS = (
  Param("pre_self_attention_layer_norm/scale", "model.layers.{i}.input_layernorm.weight"),
  *llama.ATTENTION_PARAMS,
  *QK_NORM_PARAMS,
  Param("post_self_attention_layer_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
  *mixtral.expert_params("model.layers.{i}.mlp", "gate_proj", "up_proj", "down_proj"),
)


def moe_config_to_maxtext(hf: dict, where: str) -> dict:
  keys = config_to_maxtext(hf, where)
  if not hf.get("norm_topk_prob"):
    raise UserError(
      f"{where}: norm_topk_prob=false is not supported for qwen3_moe (its routing renormalises the top-k weights, "
      "as the released Qwen3-MoE checkpoints do)"
    )
  if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
    raise UserError(f"{where}: dense layers among the MoE ones (mlp_only_layers, decoder_sparse_step) are not supported")
  keys.update(
    decoder_block="qwen3_moe",
    base_mlp_dim=hf_config.require(hf, "moe_intermediate_size", where),
    # The Hub's config.json says num_experts; transformers 5 writes num_local_experts.
    num_experts=hf.get("num_experts") or hf_config.require(hf, "num_local_experts", where),
    num_experts_per_tok=hf_config.require(hf, "num_experts_per_tok", where),
  )
  return keys


def moe_config_to_hf(cfg) -> dict:
  keys = config_to_hf(cfg)
  keys.update(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    moe_intermediate_size=cfg.mlp_dim,
    num_experts=cfg.num_experts,
    num_experts_per_tok=cfg.num_experts_per_tok,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
  )
  keys.pop("mlp_bias")
  return keys


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

MOE_FAMILY = Family(
  name="qwen3_moe",
  model_types=("qwen3_moe",),
  architecture="Qwen3MoeForCausalLM",
  decoder_block="qwen3_moe",
  global_params=llama.GLOBAL_PARAMS,
  layer_params=MOE_LAYER_PARAMS,
  config_to_maxtext=moe_config_to_maxtext,
  config_to_hf=moe_config_to_hf,
)
