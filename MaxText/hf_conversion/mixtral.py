"""Mixtral (transformers MixtralForCausalLM) <-> MaxText decoder_block=mixtral.

Per-expert HF tensors (w1 gate, w3 up, w2 down) stack on MaxText's expert axis 0.
"""

from MaxText.hf_conversion import hf_config, llama
from MaxText.hf_conversion.tables import Family, Param

_MOE = "model.layers.{i}.block_sparse_moe"


def expert_params(moe: str, gate: str, up: str, down: str) -> tuple:
  """MaxText's MoeBlock_0 from HF's router `<moe>.gate` and per-expert `<moe>.experts.{e}.<gate|up|down>.weight`."""
  experts = moe + ".experts.{e}."
  return (
    Param("MoeBlock_0/gate/kernel", f"{moe}.gate.weight", "transpose"),
    Param("MoeBlock_0/wi_0", f"{experts}{gate}.weight", "transpose", experts=True),
    Param("MoeBlock_0/wi_1", f"{experts}{up}.weight", "transpose", experts=True),
    Param("MoeBlock_0/wo", f"{experts}{down}.weight", "transpose", experts=True),
  )


LAYER_PARAMS = (
  Param("pre_self_attention_layer_norm/scale", "model.layers.{i}.input_layernorm.weight"),
  *llama.ATTENTION_PARAMS,
  Param("post_self_attention_layer_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
  *expert_params(_MOE, "w1", "w3", "w2"),
)


def config_to_maxtext(hf: dict, where: str) -> dict:
  keys = hf_config.decoder_keys(hf, where, "mixtral")
  keys.update(
    num_experts=hf_config.require(hf, "num_local_experts", where),
    num_experts_per_tok=hf_config.require(hf, "num_experts_per_tok", where),
    sliding_window_size=hf.get("sliding_window") or 0,
  )
  return keys


def config_to_hf(cfg) -> dict:
  keys = hf_config.decoder_config(cfg, "mixtral", "MixtralForCausalLM")
  for key in ("attention_bias", "mlp_bias"):
    keys.pop(key)
  keys.update(
    num_local_experts=cfg.num_experts,
    num_experts_per_tok=cfg.num_experts_per_tok,
    sliding_window=cfg.sliding_window_size or None,
  )
  return keys


FAMILY = Family(
  name="mixtral",
  model_types=("mixtral",),
  architecture="MixtralForCausalLM",
  decoder_block="mixtral",
  global_params=llama.GLOBAL_PARAMS,
  layer_params=LAYER_PARAMS,
  config_to_maxtext=config_to_maxtext,
  config_to_hf=config_to_hf,
)
