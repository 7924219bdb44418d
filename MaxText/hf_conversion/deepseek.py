"""DeepSeek-V3 (transformers DeepseekV3ForCausalLM) <-> MaxText decoder_block=deepseek.

HF layers 0 .. first_k_dense_replace - 1 are MaxText's dense_layers, the rest its moe_layers. Multi-head latent
attention's projections map by transposes and reshapes (each head's query [nope, rope], kv_b's [k_nope, value]); the
RoPE part keeps DeepSeek's interleaved layout (rope_interleave=true), which MaxText's MLA reads as such. The router's
e_score_correction_bias is MaxText's gate/bias; per-expert tensors stack on MaxText's expert axis 0, as Mixtral's.

The multi-token prediction depths that DeepSeek's own checkpoints append as further layers (model.layers.
<num_hidden_layers + k - 1>, num_nextn_predict_layers of them) are MaxText's decoder/mtp_<k>: its enorm, hnorm,
eh_proj, shared_head.norm and an MoE layer's tensors. Their copies of the embedding and of the output head
(embed_tokens, shared_head.head) are the main model's, which MaxText shares: to_maxtext skips them, to_hf does not
write them. transformers' DeepseekV3ForCausalLM has no such layers (it ignores them).
"""

import dataclasses

from MaxText import max_logging
from MaxText.errors import UserError
from MaxText.hf_conversion import hf_config, llama, mixtral
from MaxText.hf_conversion.tables import Family, Param

_ATTN = "model.layers.{i}.self_attn."
ATTENTION_PARAMS = (
  # the query: through the q_lora_rank bottleneck, or projected directly (q_lora_rank null, as DeepSeek-V2-Lite)
  Param("self_attention/wq_a/kernel", _ATTN + "q_a_proj.weight", "transpose", optional=True),
  Param("self_attention/q_norm/scale", _ATTN + "q_a_layernorm.weight", optional=True),
  Param("self_attention/wq_b/kernel", _ATTN + "q_b_proj.weight", "heads_in", optional=True),
  Param("self_attention/query/kernel", _ATTN + "q_proj.weight", "heads_in", optional=True),
  Param("self_attention/wkv_a/kernel", _ATTN + "kv_a_proj_with_mqa.weight", "transpose"),
  Param("self_attention/kv_norm/scale", _ATTN + "kv_a_layernorm.weight"),
  Param("self_attention/wkv_b/kernel", _ATTN + "kv_b_proj.weight", "heads_in"),
  Param("self_attention/out/kernel", _ATTN + "o_proj.weight", "heads_out"),
)
_NORMS = (
  Param("pre_self_attention_layer_norm/scale", "model.layers.{i}.input_layernorm.weight"),
  Param("post_self_attention_layer_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
)
_MLP = "model.layers.{i}.mlp"
MOE_PARAMS = (
  *mixtral.expert_params(_MLP, "gate_proj", "up_proj", "down_proj"),
  Param("MoeBlock_0/gate/bias", f"{_MLP}.gate.e_score_correction_bias"),
  Param("MoeBlock_0/shared_experts/wi_0/kernel", f"{_MLP}.shared_experts.gate_proj.weight", "transpose"),
  Param("MoeBlock_0/shared_experts/wi_1/kernel", f"{_MLP}.shared_experts.up_proj.weight", "transpose"),
  Param("MoeBlock_0/shared_experts/wo/kernel", f"{_MLP}.shared_experts.down_proj.weight", "transpose"),
)
MTP_PARAMS = (
  Param("enorm/scale", "model.layers.{i}.enorm.weight"),
  Param("hnorm/scale", "model.layers.{i}.hnorm.weight"),
  Param("eh_proj/kernel", "model.layers.{i}.eh_proj.weight", "transpose"),
  Param("norm/scale", "model.layers.{i}.shared_head.norm.weight"),
  *(dataclasses.replace(p, maxtext=f"layer/{p.maxtext}") for p in (*_NORMS, *ATTENTION_PARAMS, *MOE_PARAMS)),
)
_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # an MTP layer's copies of the main model's

STACK_PARAMS = {
  "dense_layers": (*_NORMS, *ATTENTION_PARAMS, *llama.MLP_PARAMS),
  "moe_layers": (*_NORMS, *ATTENTION_PARAMS, *MOE_PARAMS),
}


def _yarn_keys(hf: dict, where: str) -> dict:
  theta, scaling = hf_config.rope(hf, where)
  keys = {"rope_max_timescale": hf_config.number(theta)}
  if not scaling:
    return keys
  if scaling["rope_type"] != "yarn":
    raise UserError(f"{where}: rope type '{scaling['rope_type']}' is not supported for deepseek (supported: default, yarn)")
  mscale, mscale_all_dim = scaling.get("mscale", 1.0), scaling.get("mscale_all_dim", 0.0)
  if mscale != mscale_all_dim:
    raise UserError(
      f"{where}: YaRN with mscale={mscale} and mscale_all_dim={mscale_all_dim} is not supported (MaxText's mscale "
      "stands for both, as DeepSeek-V3's configs set them)"
    )
  keys.update(
    rope_type="yarn",
    rope_factor=float(hf_config.require(scaling, "factor", where)),
    original_max_position_embeddings=hf_config.require(scaling, "original_max_position_embeddings", where),
    beta_fast=float(scaling.get("beta_fast") or 32),
    beta_slow=float(scaling.get("beta_slow") or 1),
    mscale=float(mscale),
  )
  return keys


def config_to_maxtext(hf: dict, where: str) -> dict:
  hf_config.reject_true(hf, ("attention_bias",), where)
  if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
    raise UserError(f"{where}: only DeepSeek-V3's routing (sigmoid scores, topk_method noaux_tc) is supported")
  if not hf.get("norm_topk_prob", True) or not hf.get("rope_interleave", True):
    raise UserError(f"{where}: norm_topk_prob=false and rope_interleave=false are not supported for deepseek")
  heads = hf_config.require(hf, "num_attention_heads", where)
  keys = {
    "decoder_block": "deepseek",
    "base_emb_dim": hf_config.require(hf, "hidden_size", where),
    "base_num_query_heads": heads,
    "base_num_kv_heads": heads,  # latent attention has no kv heads of its own
    "base_mlp_dim": hf_config.require(hf, "intermediate_size", where),
    "base_moe_mlp_dim": hf_config.require(hf, "moe_intermediate_size", where),
    "base_num_decoder_layers": hf_config.require(hf, "num_hidden_layers", where),
    "first_num_dense_layers": hf.get("first_k_dense_replace", 0),
    "mlp_activations": [hf_config.activation(hf, where), "linear"],
    "vocab_size": hf_config.require(hf, "vocab_size", where),
    "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
    "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
    "normalize_embedding_logits": False,
    "num_experts": hf_config.require(hf, "n_routed_experts", where),
    "num_experts_per_tok": hf_config.require(hf, "num_experts_per_tok", where),
    "shared_experts": hf.get("n_shared_experts") or 0,
    "n_routing_groups": hf.get("n_group") or 1,
    "topk_routing_group": hf.get("topk_group") or 1,
    "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
    "q_lora_rank": hf.get("q_lora_rank") or 0,
    "kv_lora_rank": hf_config.require(hf, "kv_lora_rank", where),
    "qk_nope_head_dim": hf_config.require(hf, "qk_nope_head_dim", where),
    "qk_rope_head_dim": hf_config.require(hf, "qk_rope_head_dim", where),
    "v_head_dim": hf_config.require(hf, "v_head_dim", where),
    "mtp_num_layers": hf.get("num_nextn_predict_layers") or 0,
  }
  if hf.get("aux_loss_alpha") is not None:  # DeepSeek's own config.json: the sequence-wise balance loss's weight
    keys["load_balance_loss_weight"] = float(hf["aux_loss_alpha"])
  keys.update(_yarn_keys(hf, where))
  return keys


def config_to_hf(cfg) -> dict:
  yarn = None
  if cfg.rope_type == "yarn":
    yarn = {
      "rope_type": "yarn",
      "factor": cfg.rope_factor,
      "original_max_position_embeddings": cfg.original_max_position_embeddings,
      "beta_fast": cfg.beta_fast,
      "beta_slow": cfg.beta_slow,
      "mscale": cfg.mscale,
      "mscale_all_dim": cfg.mscale,
    }
  return {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": cfg.emb_dim,
    "intermediate_size": cfg.mlp_dim,
    "moe_intermediate_size": cfg.moe_mlp_dim,
    "num_hidden_layers": cfg.num_decoder_layers,
    "first_k_dense_replace": cfg.first_num_dense_layers,
    "num_attention_heads": cfg.num_query_heads,
    "num_key_value_heads": cfg.num_query_heads,
    "hidden_act": "silu",
    "vocab_size": cfg.vocab_size,
    "rms_norm_eps": cfg.normalization_layer_epsilon,
    "tie_word_embeddings": bool(cfg.logits_via_embedding),
    "n_routed_experts": cfg.num_experts,
    "num_experts_per_tok": cfg.num_experts_per_tok,
    "n_shared_experts": cfg.shared_experts,
    "n_group": cfg.n_routing_groups,
    "topk_group": cfg.topk_routing_group,
    "routed_scaling_factor": cfg.routed_scaling_factor,
    "norm_topk_prob": True,
    "q_lora_rank": cfg.q_lora_rank or None,
    "kv_lora_rank": cfg.kv_lora_rank,
    "qk_nope_head_dim": cfg.qk_nope_head_dim,
    "qk_rope_head_dim": cfg.qk_rope_head_dim,
    "v_head_dim": cfg.v_head_dim,
    "head_dim": cfg.qk_rope_head_dim,
    "rope_theta": float(cfg.rope_max_timescale),
    "rope_scaling": yarn,
    "rope_interleave": True,
    "attention_bias": False,
    "num_nextn_predict_layers": cfg.mtp_num_layers,
  }


def keys_for_checkpoint(keys: dict, names: list) -> dict:
  """No multi-token prediction where the checkpoint has no such layers (transformers writes num_nextn_predict_layers
  but not the layers), with a line saying so."""
  first = f"model.layers.{keys['base_num_decoder_layers']}.eh_proj.weight"
  if keys["mtp_num_layers"] and first not in names:
    max_logging.log(
      f"config.json counts {keys['mtp_num_layers']} multi-token prediction layers, which the checkpoint does not "
      "hold: converting the main model (mtp_num_layers=0)"
    )
    return dict(keys, mtp_num_layers=0)
  return keys


def without_shared_copies(hf: dict):
  """Hides the multi-token prediction layers' copies of the embedding and output head (the main model's)."""
  layers = hf.get("num_hidden_layers", 0)

  def rename(name: str):
    parts = name.split(".")
    in_mtp = name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= layers
    return None if in_mtp and name.endswith(_SHARED_COPIES) else name

  return rename


FAMILY = Family(
  name="deepseek",
  model_types=("deepseek_v3",),
  architecture="DeepseekV3ForCausalLM",
  decoder_block="deepseek",
  global_params=llama.GLOBAL_PARAMS,
  layer_params=STACK_PARAMS["moe_layers"],
  config_to_maxtext=config_to_maxtext,
  config_to_hf=config_to_hf,
  hf_tensor_name=without_shared_copies,
  stack_params=STACK_PARAMS,
  mtp_params=MTP_PARAMS,
  checkpoint_keys=keys_for_checkpoint,
)
