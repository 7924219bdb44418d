"""Analytic training FLOPs per device and step, and model FLOPs utilisation (MFU) against peak tables.

Counting (multiply-add = 2 FLOPs; x3 for forward + backward):
  per layer:  FFN  2*B*T*E*M*(A+1)         (A input projections of the gated MLP, one output; with experts:
                                            x num_experts_per_tok, plus the router 2*B*T*E*num_experts)
              QKV  2*B*T*E*(Nq + 2*Nkv)*D
              OUT  2*B*T*Nq*D*E
              ATTN causal: 2*B*T^2*Nq*D    (q.k^T and probs.v, 2*2*B*T^2*Nq*D, halved because a causal
                                            mask leaves only the lower triangle of useful work)
  once:       LOGITS 2*B*T*E*V
DeepSeek (decoder_block=deepseek): multi-head latent attention's projections (q through q_lora_rank or direct, the
kv latent and its expansion, out) replace QKV and OUT, its attention is 2*B*T^2*Nq*(Dqk + Dv) before the causal
halving; the first first_num_dense_layers layers run the dense FFN, the others k routed + shared_experts experts of
width moe_mlp_dim and the router. Each multi-token prediction depth adds its 2E -> E projection, one more layer (of
the last stack's kind) and its logits.
Upstream MaxText (mid-2024) counted attention without the causal halving (4*B*T^2*Nq*D); later
upstream switched to the causal count used here. `causal_attention=False` gives the old figure.
"""

import dataclasses

# Peak dense bf16 TFLOP/s per JAX device (a v4/v5p megacore chip, a v5e/v6e chip, one GPU), by generation.
PEAK_BF16_TFLOPS = {
  "v4": 275.0,
  "v5e": 197.0,
  "v5p": 459.0,
  "v6e": 918.0,
  "a100": 312.0,
  "h100-pcie": 756.0,
  "h100-nvl": 835.0,
  "h100": 989.0,
  "gh200": 989.0,
  "h200": 989.0,
  "b200": 2250.0,
}

# What one CPU device does (2 cores of a small VM, as the README quickstart measures): a rough figure, for estimates.
CPU_TFLOPS_ESTIMATE = 0.1

# How jax's device_kind names each generation, matched as lower-case substrings in this order: the more specific
# names first, because a v5p reports "TPU v5" (a prefix of the v5e's "TPU v5 lite") and "NVIDIA GH200 480GB"
# contains "H200".
_DEVICE_KIND_GENERATIONS = (
  ("tpu v4", "v4"),
  ("tpu v5 lite", "v5e"),
  ("tpu v5e", "v5e"),
  ("tpu v5p", "v5p"),
  ("tpu v5", "v5p"),
  ("tpu v6 lite", "v6e"),
  ("tpu v6e", "v6e"),
  ("a100", "a100"),
  ("h100 pcie", "h100-pcie"),
  ("h100 nvl", "h100-nvl"),
  ("h100", "h100"),
  ("gh200", "gh200"),
  ("h200", "h200"),
  ("b200", "b200"),
)


def device_generation(device_kind: str) -> str | None:
  """The generation (a PEAK_BF16_TFLOPS key) of a jax device_kind such as 'TPU v5 lite'; None if unknown."""
  kind = device_kind.lower()
  return next((generation for name, generation in _DEVICE_KIND_GENERATIONS if name in kind), None)


def peak_tflops_per_device(device_kind: str) -> float | None:
  """Peak bf16 TFLOP/s for a jax device_kind (e.g. 'TPU v5 lite', 'NVIDIA H100 80GB HBM3'); None if unknown."""
  generation = device_generation(device_kind)
  return PEAK_BF16_TFLOPS[generation] if generation else None


def mfu(tflops_per_sec_per_device: float, device_kind: str) -> float | None:
  """Model FLOPs utilisation: achieved TFLOP/s per device over the device's peak; None for an unknown device."""
  peak = peak_tflops_per_device(device_kind)
  return tflops_per_sec_per_device / peak if peak else None


@dataclasses.dataclass(frozen=True)
class StepFlops:
  learnable_tflops: float  # Weight matmuls (including the logits), per device per step.
  attention_tflops: float  # Attention score and context matmuls, per device per step.

  @property
  def total_tflops(self) -> float:
    return self.learnable_tflops + self.attention_tflops


def _attention_flops(config, tokens: float) -> tuple[float, float]:
  """(projection FLOPs, attention FLOPs without the causal halving) of one layer's attention."""
  emb, num_q, length = config.emb_dim, config.num_query_heads, config.max_target_length
  if config.decoder_block != "deepseek":
    head_dim = config.head_dim
    projections = 2 * tokens * emb * (num_q + 2 * config.num_kv_heads) * head_dim + 2 * tokens * num_q * head_dim * emb
    return projections, 4 * tokens * length * num_q * head_dim
  qk_dim, v_dim = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
  if config.q_lora_rank > 0:
    query = 2 * tokens * config.q_lora_rank * (emb + num_q * qk_dim)
  else:
    query = 2 * tokens * emb * num_q * qk_dim
  latent = 2 * tokens * emb * (config.kv_lora_rank + config.qk_rope_head_dim)
  expand = 2 * tokens * config.kv_lora_rank * num_q * (config.qk_nope_head_dim + v_dim)
  out = 2 * tokens * num_q * v_dim * emb
  return query + latent + expand + out, 2 * tokens * length * num_q * (qk_dim + v_dim)


def _ffn_flops(config, tokens: float) -> tuple[float, float]:
  """(the feed-forward FLOPs of all layers, those of one layer of the last stack): dense MLPs, or the experts a
  token runs (and the router)."""
  gated = len(config.mlp_activations) + 1
  dense = 2 * tokens * config.emb_dim * config.mlp_dim * gated
  router = 2 * tokens * config.emb_dim * config.num_experts
  layers = config.num_decoder_layers
  if config.decoder_block == "deepseek":
    experts = (config.num_experts_per_tok + config.shared_experts) * 2 * tokens * config.emb_dim * config.moe_mlp_dim * gated
    dense_layers = config.first_num_dense_layers
    return dense * dense_layers + (experts + router) * (layers - dense_layers), experts + router
  if config.num_experts > 1:  # each token runs num_experts_per_tok experts, after the router's projection
    return (dense * config.num_experts_per_tok + router) * layers, dense * config.num_experts_per_tok + router
  return dense * layers, dense


def training_tflops_per_device(config, causal_attention: bool = True) -> StepFlops:
  """Training TFLOPs per device per optimizer step (all gradient accumulation microbatches)."""
  tokens = config.per_device_batch_size * config.max_target_length  # B*T, may be fractional
  projections, attention = _attention_flops(config, tokens)
  if causal_attention:
    attention /= 2
  logits = 2 * tokens * config.emb_dim * config.vocab_size
  ffn, last_layer_ffn = _ffn_flops(config, tokens)
  layers, depths = config.num_decoder_layers, config.mtp_num_layers
  # each multi-token prediction depth: eh_proj (2E -> E), one layer of the last stack's kind, its logits
  mtp = depths * (2 * tokens * 2 * config.emb_dim * config.emb_dim + projections + last_layer_ffn + logits)
  scale = 3 * config.gradient_accumulation_steps / 1e12
  learnable = projections * layers + ffn + logits + mtp
  return StepFlops(learnable_tflops=learnable * scale, attention_tflops=attention * (layers + depths) * scale)


def tokens_per_device_per_step(config) -> float:
  return config.per_device_batch_size * config.max_target_length * config.gradient_accumulation_steps


def describe(flops: StepFlops) -> str:
  total = flops.total_tflops
  return (
    f"Per train step: {total:.3f} TFLOPs per device, {100 * flops.learnable_tflops / total:.2f}% learnable weight "
    f"matmuls and {100 * flops.attention_tflops / total:.2f}% causal attention"
  )
