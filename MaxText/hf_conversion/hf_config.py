"""Reads a Hugging Face config.json into MaxText config keys, and writes one back (shared by the families).

Both forms of config.json are read: transformers 5 (`rope_parameters`) and the older one (`rope_theta`,
`rope_scaling`). config.json is written in the older form, which transformers 4 and 5 both read.
"""

from MaxText.errors import UserError

# HF activation names -> MaxText mlp_activations names.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
_MAXTEXT_TO_HF_ACTIVATION = {"silu": "silu", "gelu": "gelu_pytorch_tanh", "relu": "relu"}


def require(hf: dict, key: str, where: str):
  if key not in hf or hf[key] is None:
    raise UserError(f"{where} has no '{key}'")
  return hf[key]


def rope(hf: dict, where: str) -> tuple[float, dict]:
  """(rope_theta, scaling) from either form; scaling is {} for plain RoPE, else the rope_type's parameters."""
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  theta = params.pop("rope_theta", hf.get("rope_theta", 10_000.0))
  params.update(scaling)
  rope_type = params.pop("rope_type", params.pop("type", "default"))
  if rope_type in ("default", None):
    return float(theta), {}
  return float(theta), dict(params, rope_type=rope_type)


def number(value: float):
  """An integral float as an int (MaxText's integer keys take it; the YAML reads better)."""
  return int(value) if float(value).is_integer() else float(value)


def activation(hf: dict, where: str, key: str = "hidden_act") -> str:
  name = hf.get(key) or hf.get("hidden_activation") or "silu"
  if name not in ACTIVATIONS:
    raise UserError(f"{where}: {key}={name} is not supported (supported: {', '.join(ACTIVATIONS)})")
  return ACTIVATIONS[name]


def reject_true(hf: dict, keys: tuple, where: str) -> None:
  """An unsupported variant (biases, ...) stops the conversion instead of silently dropping weights."""
  for key in keys:
    if hf.get(key):
      raise UserError(f"{where}: {key}={hf[key]} is not supported by the MaxText {hf.get('model_type')} conversion")


def decoder_keys(hf: dict, where: str, decoder_block: str) -> dict:
  """The MaxText keys shared by the llama-like families (dims, norms, RoPE, tied logits); plain RoPE only."""
  theta, scaling = rope(hf, where)
  if scaling:
    raise UserError(f"{where}: rope type '{scaling['rope_type']}' is not supported for {hf.get('model_type')}")
  return common_keys(hf, where, decoder_block, theta)


def common_keys(hf: dict, where: str, decoder_block: str, theta: float) -> dict:
  heads = require(hf, "num_attention_heads", where)
  emb = require(hf, "hidden_size", where)
  return {
    "decoder_block": decoder_block,
    "base_emb_dim": emb,
    "base_num_query_heads": heads,
    "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
    "base_mlp_dim": require(hf, "intermediate_size", where),
    "base_num_decoder_layers": require(hf, "num_hidden_layers", where),
    "head_dim": hf.get("head_dim") or emb // heads,
    "mlp_activations": [activation(hf, where), "linear"],
    "vocab_size": require(hf, "vocab_size", where),
    "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
    "rope_max_timescale": number(theta),
    "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
    "normalize_embedding_logits": False,  # transformers never divides tied logits by sqrt(emb)
  }


def decoder_config(cfg, model_type: str, architecture: str) -> dict:
  """The config.json keys shared by the llama-like families, from a MaxText config (attribute access)."""
  return {
    "architectures": [architecture],
    "model_type": model_type,
    "hidden_size": cfg.emb_dim,
    "num_attention_heads": cfg.num_query_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "intermediate_size": cfg.mlp_dim,
    "num_hidden_layers": cfg.num_decoder_layers,
    "hidden_act": _MAXTEXT_TO_HF_ACTIVATION[cfg.mlp_activations[0]],
    "vocab_size": cfg.vocab_size,
    "rms_norm_eps": cfg.normalization_layer_epsilon,
    "rope_theta": float(cfg.rope_max_timescale),
    "rope_scaling": None,
    "tie_word_embeddings": bool(cfg.logits_via_embedding),
    "attention_bias": False,
    "mlp_bias": False,
  }


# Llama 3.1 RoPE scaling: HF rope_scaling keys <-> MaxText keys.
LLAMA3_ROPE_KEYS = {
  "factor": "rope_scaling_factor",
  "low_freq_factor": "rope_scaling_low_freq_factor",
  "high_freq_factor": "rope_scaling_high_freq_factor",
  "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings",
}


def llama3_rope_keys(scaling: dict, where: str) -> dict:
  if scaling.get("rope_type") != "llama3":
    raise UserError(f"{where}: rope type '{scaling.get('rope_type')}' is not supported (supported: default, llama3)")
  missing = [k for k in LLAMA3_ROPE_KEYS if k not in scaling]
  if missing:
    raise UserError(f"{where}: rope_scaling of type llama3 lacks {', '.join(missing)}")
  return {key: number(scaling[hf_key]) for hf_key, key in LLAMA3_ROPE_KEYS.items()}


def llama3_rope_config(cfg) -> dict | None:
  if cfg.rope_scaling_factor <= 0:
    return None
  return {"rope_type": "llama3", **{hf_key: getattr(cfg, key) for hf_key, key in LLAMA3_ROPE_KEYS.items()}}
