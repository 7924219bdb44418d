"""GPT-OSS (OpenAI's gpt-oss-20b and gpt-oss-120b): Llama's pre-norm layer with attention sinks, biased projections,
YaRN RoPE (not truncated) and a mixture of experts with trained router and expert biases and a clamped SwiGLU.

Layers alternate between a sliding window (even layers, as transformers' layer_types) and full attention. Both kinds
have the same params and the same (YaRN) RoPE, so the stack scans single layers, each told its index
(DecoderFamily.takes_layer_index), as Gemma 3's. Reference: transformers' GptOssForCausalLM.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.layers import block_parts
from MaxText.layers.attentions import Attention, LocalAttention
from MaxText.layers.linears import Gemm
from MaxText.layers.moe import MoeBlock
from MaxText.layers.yarn import YarnRopeScaling

SWIGLU_ALPHA = 1.702  # transformers' GptOssConfig.swiglu_alpha (the released models'; the conversion checks it)


@dataclasses.dataclass(frozen=True)
class ClampedSwiglu:
  """transformers' GptOssExperts._apply_gate: gate clamped above at `limit`, up clamped to [-limit, limit], then
  (up + 1) * gate * sigmoid(alpha * gate). limit <= 0: no clamping."""

  alpha: float
  limit: float
  projections = 2  # wi_0 (gate) and wi_1 (up)

  def __call__(self, h_parts):
    gate, up = h_parts
    if self.limit > 0:
      gate, up = jnp.minimum(gate, self.limit), jnp.clip(up, -self.limit, self.limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


def is_sliding(layer_index):
  """Whether layer `layer_index` (an int, or a scanned layer's traced int) attends within the sliding window."""
  return layer_index % 2 == 0


def rope_scaling(config):
  """YaRN without truncation for rope_type=yarn (GPT-OSS's rope_parameters say truncate: false), else the shared."""
  if config.rope_type != "yarn":
    return block_parts.rope_scaling(config)
  return YarnRopeScaling(
    config.rope_factor, config.original_max_position_embeddings, config.beta_fast, config.beta_slow, truncate=False
  )


def attention(config, gemm: Gemm) -> Attention:
  return block_parts.self_attention(
    config,
    gemm,
    sliding_window=0,  # the full layers'; the sliding ones take `local`'s
    use_bias=True,
    use_sinks=config.attention_sink,
    rope_scaling=rope_scaling(config),
    local=LocalAttention(config.sliding_window_size, config.rope_max_timescale, scaled_rope=True),
  )


def experts(config) -> MoeBlock:
  return MoeBlock(
    num_experts=config.num_experts,
    num_experts_per_tok=config.num_experts_per_tok,
    intermediate_dim=config.mlp_dim,
    activations=ClampedSwiglu(SWIGLU_ALPHA, config.mlp_activations_limit),
    experts=block_parts.experts_config(config),
    dtype=config.dtype,
    weight_dtype=config.weight_dtype,
    router_bias=config.routed_bias,
    expert_bias=config.mlp_bias,
    name="MoeBlock_0",
  )


class GptOssDecoderLayer(nn.Module):
  """h = x + attn(norm(x)); out = h + moe(norm(h)), attention windowed on even layers."""

  config: object
  gemm: Gemm

  @nn.compact
  def __call__(self, x, positions, segment_ids, deterministic: bool, layer_index):
    cfg = self.config
    normed = block_parts.rms_norm(cfg, "pre_self_attention_layer_norm")(x)
    attn = attention(cfg, self.gemm)(normed, positions, segment_ids, deterministic, is_local=is_sliding(layer_index))
    h = x + block_parts.dropout(cfg)(attn, deterministic=deterministic)
    ffn = experts(cfg)(block_parts.rms_norm(cfg, "post_self_attention_layer_norm")(h), segment_ids)
    return h + block_parts.dropout(cfg)(ffn, deterministic=deterministic)


FAMILY = block_parts.DecoderFamily(GptOssDecoderLayer, takes_layer_index=True)
