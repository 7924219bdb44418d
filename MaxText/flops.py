"""Analytic training FLOPs per device and step, and model FLOPs utilisation (MFU) against peak tables.

Counting (multiply-add = 2 FLOPs; x3 for forward + backward):
  per layer:  FFN  2*B*T*E*M*(A+1)         (A input projections of the gated MLP, one output)
              QKV  2*B*T*E*(Nq + 2*Nkv)*D
              OUT  2*B*T*Nq*D*E
              ATTN causal: 2*B*T^2*Nq*D    (q.k^T and probs.v, 2*2*B*T^2*Nq*D, halved because a causal
                                            mask leaves only the lower triangle of useful work)
  once:       LOGITS 2*B*T*E*V
Upstream MaxText (mid-2024) counted attention without the causal halving (4*B*T^2*Nq*D); later
upstream switched to the causal count used here. `causal_attention=False` gives the old figure.
"""

import dataclasses

# Peak dense bf16 TFLOP/s per device (per JAX device: a v4/v5p megacore chip, a v5e/v6e chip, one GPU).
PEAK_BF16_TFLOPS = (
  ("TPU v4", 275.0),
  ("TPU v5 lite", 197.0),
  ("TPU v5e", 197.0),
  ("TPU v5p", 459.0),
  ("TPU v5", 459.0),
  ("TPU v6 lite", 918.0),
  ("TPU v6e", 918.0),
  ("A100", 312.0),
  ("H100 PCIe", 756.0),
  ("H100", 989.0),
  ("H200", 989.0),
  ("B200", 2250.0),
)


def peak_tflops_per_device(device_kind: str) -> float | None:
  """Peak bf16 TFLOP/s for a jax device_kind (e.g. 'TPU v5 lite', 'NVIDIA H100 80GB HBM3'); None if unknown."""
  for name, peak in PEAK_BF16_TFLOPS:  # Ordered so that 'TPU v5 lite' matches before 'TPU v5'.
    if name.lower() in device_kind.lower():
      return peak
  return None


@dataclasses.dataclass(frozen=True)
class StepFlops:
  learnable_tflops: float  # Weight matmuls (including the logits), per device per step.
  attention_tflops: float  # Attention score and context matmuls, per device per step.

  @property
  def total_tflops(self) -> float:
    return self.learnable_tflops + self.attention_tflops


def training_tflops_per_device(config, causal_attention: bool = True) -> StepFlops:
  """Training TFLOPs per device per optimizer step (all gradient accumulation microbatches)."""
  tokens = config.per_device_batch_size * config.max_target_length  # B*T, may be fractional
  emb, mlp, head_dim = config.emb_dim, config.mlp_dim, config.head_dim
  num_q, num_kv = config.num_query_heads, config.num_kv_heads
  ffn = 2 * tokens * emb * mlp * (len(config.mlp_activations) + 1)
  qkv = 2 * tokens * emb * (num_q + 2 * num_kv) * head_dim
  out = 2 * tokens * num_q * head_dim * emb
  attention = 4 * tokens * config.max_target_length * num_q * head_dim
  if causal_attention:
    attention /= 2
  logits = 2 * tokens * emb * config.vocab_size
  layers = config.num_decoder_layers
  scale = 3 * config.gradient_accumulation_steps / 1e12
  return StepFlops(
    learnable_tflops=((ffn + qkv + out) * layers + logits) * scale, attention_tflops=attention * layers * scale
  )


def tokens_per_device_per_step(config) -> float:
  return config.per_device_batch_size * config.max_target_length * config.gradient_accumulation_steps


def describe(flops: StepFlops) -> str:
  total = flops.total_tflops
  return (
    f"Per train step: {total:.3f} TFLOPs per device, {100 * flops.learnable_tflops / total:.2f}% learnable weight "
    f"matmuls and {100 * flops.attention_tflops / total:.2f}% causal attention"
  )
