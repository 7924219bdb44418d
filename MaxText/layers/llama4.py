"""Llama 4 (the text model of Scout and Maverick, transformers' Llama4TextModel): Llama's pre-norm layer with

- RoPE layers: RoPE on interleaved pairs (transformers' complex rotation), then an L2 norm of each query and key head
  (use_qk_norm, Llama4TextL2Norm), attending within chunks of chunk_attn_window_size tokens;
- NoPE layers, every nope_layer_interval-th: no RoPE, global causal attention, and with temperature_tuning the
  queries scaled by 1 + scale * log(1 + floor((position + 1) / floor_scale)) (transformers' attn_scale, floor_scale);
- MoE layers, every interleave_moe_layer_step-th: a shared expert beside one routed expert per token, whose INPUT is
  scaled by the sigmoid of its router logit (Llama4TextMoe); the other layers a dense MLP of base_mlp_dim.

Layer kinds repeat every 4 layers (both intervals divide 4), so the stack scans blocks of 4 layers
(common_types.DECODER_LAYERS_PER_BLOCK), each layer's kind static: decoder/layers/layer_<j>/..., HF layer 4 b + j.
"""

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.configuration import common_types
from MaxText.layers import block_parts, moe
from MaxText.layers.attentions import Attention
from MaxText.layers.embeddings import rope_inverse_frequencies
from MaxText.layers.linears import PLAIN, DenseGeneral, Gemm
from MaxText.layers.llama2 import LlamaDecoderLayer
from MaxText.layers.moe_experts import ExpertsConfig, routed_experts

LAYERS_PER_BLOCK = common_types.layers_per_block("llama4")


def interleaved_rope(x, positions, min_timescale: float, max_timescale: float, scaling=None):
  """RoPE on interleaved pairs (x[2i], x[2i+1]), as transformers' Llama 4 (a complex rotation), in float32.

  Args:
    x: (B, T, N, D) queries or keys. positions: (B, T).
  """
  inv_freq = jnp.asarray(rope_inverse_frequencies(x.shape[-1], min_timescale, max_timescale, scaling))  # (D/2,)
  angles = positions[:, :, None, None].astype(jnp.float32) * inv_freq  # (B, T, 1, D/2)
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)  # (B, T, N, D/2, 2)
  even, odd = pairs[..., 0], pairs[..., 1]
  rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
  return rotated.reshape(x.shape).astype(x.dtype)


def l2_norm(x, epsilon: float):
  """x / rms(x) over the last axis, in float32 (Llama4TextL2Norm: no scale)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)).astype(x.dtype)


def attention_temperature(positions, scale: float, floor_scale: float):
  """(B, T) -> (B, T) float32: 1 + scale * log(1 + floor((position + 1) / floor_scale))."""
  return jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale)) * scale + 1.0


class Llama4Attention(Attention):
  """Attention with Llama 4's interleaved RoPE, L2 q/k norm (l2_qk_norm) and temperature tuning (temperature_scale
  > 0); params as Attention's."""

  l2_qk_norm: bool = False
  temperature_scale: float = 0.0
  temperature_floor: float = 1.0

  def _rope(self, query, key, positions, is_local: bool):
    del is_local
    if not self.use_rope:
      return query, key
    rope = lambda x: interleaved_rope(x, positions, self.rope_min_timescale, self.rope_max_timescale, self.rope_scaling)
    return rope(query), rope(key)

  def after_rope(self, query, key, positions):
    if self.l2_qk_norm:
      query, key = l2_norm(query, self.norm_epsilon), l2_norm(key, self.norm_epsilon)
    if self.temperature_scale > 0:
      scales = attention_temperature(positions, self.temperature_scale, self.temperature_floor)  # (B, T)
      query = (query * scales[:, :, None, None]).astype(query.dtype)
    return query, key


class Llama4MoeBlock(nn.Module):
  """transformers' Llama4TextMoe. Params: gate/kernel (embed, E); wi_0, wi_1 (E, embed, mlp), wo (E, mlp, embed);
  shared_experts/{wi_0, wi_1, wo} (a dense MLP of shared_experts x intermediate_dim)."""

  num_experts: int
  intermediate_dim: int
  shared_experts: int
  experts: ExpertsConfig
  activations: Sequence[str]
  dtype: str
  weight_dtype: str
  gemm: Gemm = PLAIN  # the shared expert's

  @nn.compact
  def __call__(self, x, segment_ids):
    """x (B, T, D); segment_ids (B, T) (padding, 0, is left out of the routing statistics). Returns (B, T, D)."""
    logits = DenseGeneral(self.num_experts, ("embed", None), dtype="float32", weight_dtype=self.weight_dtype, name="gate")(
      x
    )  # (B, T, E)
    top, chosen = jax.lax.top_k(logits, 1)  # (B, T, 1)
    # The sown probabilities are the softmax's, for the default (Switch) balance loss.
    moe.sow_routing_statistics(self, jax.nn.softmax(logits, axis=-1), chosen, segment_ids, self.num_experts)
    scaled = x * jax.nn.sigmoid(top).astype(x.dtype)  # the expert's input is scaled, not its output
    y = routed_experts(
      self,
      scaled,
      jnp.ones_like(top),
      chosen,
      self.num_experts,
      self.intermediate_dim,
      self.activations,
      self.experts,
    )
    if self.shared_experts > 0:
      y = y + moe.shared_experts(self, x)
    return y


def is_moe_layer(config, j: int) -> bool:
  """Whether layer j of a block (and of the model: blocks are whole periods) has experts."""
  return (j + 1) % config.interleave_moe_layer_step == 0


def is_nope_layer(config, j: int) -> bool:
  """Whether layer j has no RoPE (and attends globally)."""
  return config.nope_layer_interval > 0 and (j + 1) % config.nope_layer_interval == 0


class Llama4DecoderLayer(LlamaDecoderLayer):
  """Llama's layer; `use_rope` and `is_moe` say which kind it is (the module docstring)."""

  use_rope: bool = True
  is_moe: bool = False

  def attention(self, x, positions, segment_ids, deterministic: bool):
    cfg = self.config
    tuned = cfg.temperature_tuning and not self.use_rope
    attention = block_parts.self_attention(
      cfg,
      self.gemm,
      attention_cls=Llama4Attention,
      use_rope=self.use_rope,
      attention_chunk=cfg.chunk_attn_window_size if self.use_rope else 0,
      l2_qk_norm=cfg.use_qk_norm and self.use_rope,
      temperature_scale=cfg.temperature_tuning_scale if tuned else 0.0,
      temperature_floor=float(cfg.temperature_tuning_floor_scale),
    )
    return attention(x, positions, segment_ids, deterministic)

  def feed_forward(self, x, segment_ids, deterministic: bool):
    if not self.is_moe:
      return super().feed_forward(x, segment_ids, deterministic)
    cfg = self.config
    return Llama4MoeBlock(
      num_experts=cfg.num_experts,
      intermediate_dim=cfg.moe_mlp_dim,
      shared_experts=cfg.shared_experts,
      experts=block_parts.experts_config(cfg),
      activations=tuple(cfg.mlp_activations),
      dtype=cfg.dtype,
      weight_dtype=cfg.weight_dtype,
      gemm=self.gemm,
      name="MoeBlock_0",
    )(x, segment_ids)


class Llama4Block(nn.Module):
  """LAYERS_PER_BLOCK Llama 4 layers, layer_0 .. layer_3, each of its kind."""

  config: object
  gemm: Gemm

  @nn.compact
  def __call__(self, x, positions, segment_ids, deterministic: bool):
    cfg = self.config
    for j in range(LAYERS_PER_BLOCK):
      layer = Llama4DecoderLayer(
        cfg, self.gemm, use_rope=not is_nope_layer(cfg, j), is_moe=is_moe_layer(cfg, j), name=f"layer_{j}"
      )
      x = layer(x, positions, segment_ids, deterministic)
    return x


FAMILY = block_parts.DecoderFamily(Llama4Block)
