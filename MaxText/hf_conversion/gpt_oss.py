"""GPT-OSS (transformers GptOssForCausalLM) <-> MaxText decoder_block=gpt_oss.

Llama's tensors plus the attention's biases and sinks; the experts are fused 3-D tensors stacked on the expert axis,
gate_up_proj (E, embed, 2 x mlp) interleaving the gate and up columns (wi_0 the even ones, wi_1 the odd ones), and the
router has a trained bias. The released checkpoints' MXFP4 experts (quantization_config mxfp4) are read dequantized
(hf_conversion/mxfp4.py); to_hf writes them unquantized.
"""

from MaxText.errors import UserError
from MaxText.hf_conversion import hf_config, llama
from MaxText.hf_conversion.tables import Family, Param
from MaxText.layers.gpt_oss import SWIGLU_ALPHA

_ATTN = "model.layers.{i}.self_attn"
_MOE = "model.layers.{i}.mlp"

LAYER_PARAMS = (
  Param("pre_self_attention_layer_norm/scale", "model.layers.{i}.input_layernorm.weight"),
  *llama.ATTENTION_PARAMS,
  Param("self_attention/query/bias", f"{_ATTN}.q_proj.bias", "heads_bias"),
  Param("self_attention/key/bias", f"{_ATTN}.k_proj.bias", "heads_bias"),
  Param("self_attention/value/bias", f"{_ATTN}.v_proj.bias", "heads_bias"),
  Param("self_attention/out/bias", f"{_ATTN}.o_proj.bias"),
  Param("self_attention/sinks", f"{_ATTN}.sinks"),
  Param("post_self_attention_layer_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
  Param("MoeBlock_0/gate/kernel", f"{_MOE}.router.weight", "transpose"),
  Param("MoeBlock_0/gate/bias", f"{_MOE}.router.bias"),
  Param("MoeBlock_0/wi_0", f"{_MOE}.experts.gate_up_proj", "even"),
  Param("MoeBlock_0/wi_1", f"{_MOE}.experts.gate_up_proj", "odd"),
  Param("MoeBlock_0/wi_0_bias", f"{_MOE}.experts.gate_up_proj_bias", "even"),
  Param("MoeBlock_0/wi_1_bias", f"{_MOE}.experts.gate_up_proj_bias", "odd"),
  Param("MoeBlock_0/wo", f"{_MOE}.experts.down_proj"),
  Param("MoeBlock_0/wo_bias", f"{_MOE}.experts.down_proj_bias"),
)

_YARN_KEYS = {
  "factor": "rope_factor",
  "original_max_position_embeddings": "original_max_position_embeddings",
  "beta_fast": "beta_fast",
  "beta_slow": "beta_slow",
}


def _yarn_keys(scaling: dict, where: str) -> dict:
  """MaxText's YaRN keys; GPT-OSS's YaRN is not truncated and has no attention_factor or mscale of its own."""
  if not scaling:
    return {}
  if scaling["rope_type"] != "yarn":
    raise UserError(f"{where}: rope type '{scaling['rope_type']}' is not supported for gpt_oss (supported: default, yarn)")
  if scaling.get("truncate", True):
    raise UserError(f"{where}: YaRN with truncate=true is not supported for gpt_oss (its rope_parameters say false)")
  for key in ("attention_factor", "mscale", "mscale_all_dim"):
    if scaling.get(key) is not None:
      raise UserError(f"{where}: YaRN's {key} is not supported for gpt_oss")
  defaults, keys = {"beta_fast": 32.0, "beta_slow": 1.0}, {"rope_type": "yarn"}
  for hf_key, key in _YARN_KEYS.items():
    value = scaling.get(hf_key, defaults.get(hf_key))
    if value is None:
      raise UserError(f"{where}: rope_parameters of type yarn lack {hf_key}")
    keys[key] = hf_config.number(value)
  return keys


def _layer_types(layers: int) -> list[str]:
  """transformers' default layer_types, which MaxText's gpt_oss runs: sliding windows on the even layers."""
  return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def config_to_maxtext(hf: dict, where: str) -> dict:
  theta, scaling = hf_config.rope(hf, where)
  keys = hf_config.common_keys(hf, where, "gpt_oss", theta)
  layers = keys["base_num_decoder_layers"]
  if hf.get("layer_types") not in (None, _layer_types(layers)):
    raise UserError(f"{where}: layer_types other than sliding and full attention alternating are not supported")
  if not hf.get("attention_bias", True):
    raise UserError(f"{where}: attention_bias=false is not supported for gpt_oss (its projections have biases)")
  if hf.get("swiglu_alpha", SWIGLU_ALPHA) != SWIGLU_ALPHA:
    raise UserError(f"{where}: swiglu_alpha={hf['swiglu_alpha']} is not supported for gpt_oss (only {SWIGLU_ALPHA})")
  keys.update(
    num_experts=hf_config.require(hf, "num_local_experts", where),
    num_experts_per_tok=hf_config.require(hf, "num_experts_per_tok", where),
    sliding_window_size=hf.get("sliding_window") or 0,
    attention_sink=True,
    mlp_bias=True,
    routed_bias=True,
    mlp_activations_limit=float(hf.get("swiglu_limit", 7.0)),
    load_balance_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)),
    **_yarn_keys(scaling, where),
  )
  return keys


def config_to_hf(cfg) -> dict:
  keys = hf_config.decoder_config(cfg, "gpt_oss", "GptOssForCausalLM")
  keys.pop("mlp_bias")
  yarn = None
  if cfg.rope_type == "yarn":
    yarn = {"rope_type": "yarn", "truncate": False, **{hf_key: getattr(cfg, key) for hf_key, key in _YARN_KEYS.items()}}
  keys.update(
    attention_bias=True,
    num_local_experts=cfg.num_experts,
    num_experts_per_tok=cfg.num_experts_per_tok,
    sliding_window=cfg.sliding_window_size or None,
    layer_types=_layer_types(cfg.num_decoder_layers),
    swiglu_alpha=SWIGLU_ALPHA,
    swiglu_limit=cfg.mlp_activations_limit,
    router_aux_loss_coef=cfg.load_balance_loss_weight,
    rope_scaling=yarn,
  )
  return keys


FAMILY = Family(
  name="gpt_oss",
  model_types=("gpt_oss",),
  architecture="GptOssForCausalLM",
  decoder_block="gpt_oss",
  global_params=llama.GLOBAL_PARAMS,
  layer_params=LAYER_PARAMS,
  config_to_maxtext=config_to_maxtext,
  config_to_hf=config_to_hf,
)
