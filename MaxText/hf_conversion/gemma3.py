"""Gemma 3's text model (transformers Gemma3ForCausalLM, config Gemma3TextConfig) <-> MaxText decoder_block=gemma3.

Gemma 2's tensors (four norms per layer) plus the (1 + w) q/k norms. Every layer has the same tensors; whether it is
local or global follows from its index (layers/gemma3.py), which config.json states as layer_types (transformers 5) or
sliding_window_pattern (the Hub's files). RoPE comes per kind: transformers 5 writes rope_parameters per layer type,
the Hub's files rope_theta and rope_scaling (the global layers') and rope_local_base_freq (the local layers').

A multimodal checkpoint (Gemma3ForConditionalGeneration: how the Hub ships 4b, 12b and 27b) converts with its vision
tower (gemma3_vision.py), whose text model is this one under other names.
"""

from MaxText.errors import UserError
from MaxText.hf_conversion import gemma, gemma2, hf_config, qwen3
from MaxText.hf_conversion.tables import Family
from MaxText.layers.gemma3 import PATTERN, is_local

LAYER_PARAMS = (*gemma2.DECODER_LAYER_PARAMS, *qwen3.QK_NORM_PARAMS)

# transformers' Gemma3TextConfig defaults: the Hub's multimodal config.json (4b and up) gives only what differs from
# them in its text_config (e.g. hidden_size, num_hidden_layers, rope_scaling, sliding_window).
TEXT_CONFIG_DEFAULTS = {
  "vocab_size": 262_208,
  "hidden_size": 2304,
  "intermediate_size": 9216,
  "num_hidden_layers": 26,
  "num_attention_heads": 8,
  "num_key_value_heads": 4,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "rms_norm_eps": 1e-6,
  "rope_theta": 1_000_000.0,
  "rope_local_base_freq": 10_000.0,
  "query_pre_attn_scalar": 256,
  "sliding_window": 4096,
  "tie_word_embeddings": True,
}


def text_config(hf: dict) -> dict:
  """The text model's config: config.json itself (Gemma3ForCausalLM) or its text_config (the multimodal
  Gemma3ForConditionalGeneration), over transformers' defaults."""
  return {**TEXT_CONFIG_DEFAULTS, **(hf.get("text_config") or {} if hf.get("model_type") == "gemma3" else hf)}


def _layer_types(layers: int) -> list[str]:
  return ["sliding_attention" if is_local(i) else "full_attention" for i in range(layers)]


def _rope_per_kind(hf: dict, where: str) -> tuple[tuple[float, dict], tuple[float, dict]]:
  """((theta, scaling) of the global layers, the same of the local ones), from either form of config.json."""
  params = hf.get("rope_parameters") or {}
  if "full_attention" in params or "sliding_attention" in params:  # transformers 5
    kinds = [
      hf_config.rope({"rope_parameters": params.get(kind) or {}}, where) for kind in ("full_attention", "sliding_attention")
    ]
    return kinds[0], kinds[1]
  return hf_config.rope(hf, where), (float(hf.get("rope_local_base_freq", 10_000.0)), {})


def config_to_maxtext(hf: dict, where: str) -> dict:
  hf = text_config(hf)
  hf_config.reject_true(hf, ("attention_bias", "use_bidirectional_attention"), where)
  layers = hf_config.require(hf, "num_hidden_layers", where)
  pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", PATTERN))
  if hf.get("layer_types", _layer_types(layers)) != _layer_types(layers) or pattern != PATTERN:
    raise UserError(
      f"{where}: MaxText's gemma3 has a global (full attention) layer after every {PATTERN - 1} local (sliding) ones; "
      "this config's layer_types or sliding_window_pattern differ"
    )
  (theta, scaling), (local_theta, local_scaling) = _rope_per_kind(hf, where)
  if local_scaling:
    raise UserError(f"{where}: RoPE scaling on the sliding-window layers is not supported for gemma3")
  if scaling and scaling["rope_type"] != "linear":
    raise UserError(f"{where}: rope type '{scaling['rope_type']}' is not supported for gemma3 (supported: default, linear)")
  keys = hf_config.common_keys(hf, where, "gemma3", theta)
  keys.update(
    mlp_activations=[hf_config.activation(hf, where, "hidden_activation"), "linear"],
    logits_via_embedding=True,
    local_rope_max_timescale=hf_config.number(local_theta),
    rope_linear_scaling_factor=float(scaling.get("factor", 1.0)),
    **gemma2.attention_keys(hf, where),
  )
  return keys


def config_to_hf(cfg) -> dict:
  keys = dict(gemma.config_to_hf(cfg), **gemma2.attention_config(cfg))
  factor = cfg.rope_linear_scaling_factor
  keys.update(
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    rope_scaling={"rope_type": "linear", "factor": factor} if factor != 1 else None,
    rope_local_base_freq=float(cfg.local_rope_max_timescale if cfg.local_rope_max_timescale > 0 else cfg.rope_max_timescale),
    sliding_window_pattern=PATTERN,
    layer_types=_layer_types(cfg.num_decoder_layers),
  )
  return keys


FAMILY = Family(
  name="gemma3",
  model_types=("gemma3_text",),
  architecture="Gemma3ForCausalLM",
  decoder_block="gemma3",
  global_params=gemma.GLOBAL_PARAMS,
  layer_params=LAYER_PARAMS,
  config_to_maxtext=config_to_maxtext,
  config_to_hf=config_to_hf,
)
