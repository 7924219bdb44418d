"""Grouped-query self-attention: projections, RoPE, and the attention kernels (causal + packed segments)."""

import functools

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import initializers
from MaxText.layers.embeddings import apply_rotary_embedding
from MaxText.layers.flash_attention import flash_attention
from MaxText.layers.linears import DenseGeneral

# Large negative instead of -inf: a fully masked row then gives a uniform softmax instead of NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(segment_ids):
  """Causal mask within packed segments: query t sees key s iff s <= t and both are in the same segment.

  Args:
    segment_ids: (B, T) segment of each token (0 = padding).
  Returns:
    (B, 1, 1, T, S) boolean mask, broadcastable over (kv_heads, group).
  """
  length = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
  same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, S)
  return (same_segment & causal)[:, None, None, :, :]


def dot_product_attention(query, key, value, segment_ids, float32_logits: bool = True):
  """softmax(q k^T + mask) v with grouped-query heads; the softmax scale is already applied to the query.

  Args:
    query: (B, T, Nq, D). key, value: (B, S, Nkv, D), Nq a multiple of Nkv.
    segment_ids: (B, T) packed-segment ids.
  Returns:
    (B, T, Nq, D)
  """
  batch, length, num_q, head_dim = query.shape
  num_kv = key.shape[2]
  query = query.reshape(batch, length, num_kv, num_q // num_kv, head_dim)  # (B, T, Nkv, G, D)
  logits = jnp.einsum("btkgd,bskd->bkgts", query, key)  # (B, Nkv, G, T, S)
  if float32_logits:
    logits = logits.astype(jnp.float32)
  logits = jnp.where(attention_mask(segment_ids), logits, _MASK_VALUE)
  probs = nn.softmax(logits, axis=-1).astype(value.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, value)  # (B, T, Nkv, G, D)
  return out.reshape(batch, length, num_q, head_dim)


class Attention(nn.Module):
  """Self-attention with separate query/key/value/out kernels named as in upstream MaxText checkpoints."""

  num_query_heads: int
  num_kv_heads: int
  head_dim: int
  attention_kernel: str = "dot_product"
  rope_min_timescale: float = 1
  rope_max_timescale: float = 10_000
  query_scale: float = 1.0  # multiplies the query after RoPE: 1/sqrt(head_dim), or query_pre_attn_scalar**-0.5
  dtype: str = "float32"
  weight_dtype: str = "float32"

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    dense = functools.partial(
      DenseGeneral, dtype=self.dtype, weight_dtype=self.weight_dtype, kernel_init=initializers.attention_kernel_init
    )

    query = dense((self.num_query_heads, self.head_dim), ("embed", "heads", "kv"), name="query")(x)
    key = dense((self.num_kv_heads, self.head_dim), ("embed", "kv_heads", "kv_head_dim"), name="key")(x)
    value = dense((self.num_kv_heads, self.head_dim), ("embed", "kv_heads", "kv_head_dim"), name="value")(x)
    query = checkpoint_name(query, "query_proj")  # (B, T, Nq, D)
    key = checkpoint_name(key, "key_proj")  # (B, T, Nkv, D)
    value = checkpoint_name(value, "value_proj")

    rope = functools.partial(
      apply_rotary_embedding, min_timescale=self.rope_min_timescale, max_timescale=self.rope_max_timescale
    )
    # The softmax scale is applied here, not folded into the query kernel, so that checkpoints convert by
    # permutation only. Scaling q (not the logits) serves every kernel, flash included.
    query = nn.with_logical_constraint(
      rope(query, positions) * self.query_scale,
      ("activation_batch", "activation_length", "activation_heads", "activation_kv"),
    )
    if self.attention_kernel == "flash":
      kernel = flash_attention
    else:
      kernel = dot_product_attention
    out = kernel(query, rope(key, positions), value, segment_ids)
    out = checkpoint_name(out, "context")  # (B, T, Nq, D)
    out = dense(x.shape[-1], ("heads", "kv", "embed"), axis=(-2, -1), name="out")(out)
    return checkpoint_name(out, "out_proj")
