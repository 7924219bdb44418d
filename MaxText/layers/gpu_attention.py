"""GPU attention kernels: cuDNN flash attention through jax.nn.dot_product_attention (cudnn_flash_jax) and
through TransformerEngine's JAX package (cudnn_flash_te).

Both take the shapes of attentions.dot_product_attention: query (B, T, Nq, D) already scaled, key and value
(B, S, Nkv, D) with Nq a multiple of Nkv (grouped-query attention is native to both), segment_ids (B, T).
The config (attention_selection.py) has checked dtype, head_dim and the options each supports.

Packed segments: `segments="mask"` passes the (B, 1, T, S) segment mask, which cuDNN applies as an additive
bias (correct for any packing, but the bias is materialised and read: slower); `segments="lengths"` assumes one
document per row, padded at the end with segment 0, and passes the per-row length, which cuDNN skips natively
(packing=false); `segments="causal"` assumes every row is one whole document (synthetic data) and masks nothing
but causality: cuDNN's plain causal kernel, the fastest.
"""

import jax
import jax.numpy as jnp

SEGMENTS = ("mask", "lengths", "causal")


def _row_lengths(segment_ids):
  """(B,) int32 tokens of each row that are not padding (segment 0), at least 1: a row of padding only then
  attends to its first token and stays finite, as under dot_product's large negative mask."""
  return jnp.maximum(jnp.sum(segment_ids != 0, axis=1), 1).astype(jnp.int32)


def cudnn_attention(
  query,
  key,
  value,
  segment_ids,
  sliding_window: int = 0,
  logits_soft_cap: float = 0.0,
  segments: str = "mask",
  implementation: str = "cudnn",
):
  """Causal grouped-query attention with cuDNN's fused flash kernel.

  Args:
    sliding_window: > 0 limits each query to that many most recent keys (itself included).
    logits_soft_cap: must be 0: cuDNN has no soft cap (the config rejects it before this point).
    segments: "mask" (any packing), "lengths" (one document per row, padding at the end) or "causal" (one whole
      document per row: segment_ids are not read).
    implementation: "cudnn"; "xla" runs the same call through XLA's reference implementation (CPU tests).
  Returns:
    (B, T, Nq, D)
  """
  if logits_soft_cap > 0:
    raise ValueError("cuDNN flash attention has no logits soft cap")
  mask, lengths = None, None
  if segments == "mask":
    # Same segment only: causality and the window are the kernel's own masks. (B, 1, T, S), broadcast over heads.
    mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
  elif segments == "lengths":
    lengths = _row_lengths(segment_ids)
  elif segments != "causal":
    raise ValueError(f"segments={segments!r}; expected one of {SEGMENTS}")
  return jax.nn.dot_product_attention(
    query,
    key,
    value,
    mask=mask,
    scale=1.0,  # the query is already scaled (attentions.Attention)
    is_causal=True,
    key_value_seq_lengths=lengths,
    local_window_size=(sliding_window - 1, 0) if sliding_window > 0 else None,
    implementation=implementation,
  )


def transformer_engine_attention(query, key, value, segment_ids, sliding_window: int = 0, logits_soft_cap: float = 0.0):
  """Causal grouped-query attention with TransformerEngine's DotProductAttention (cuDNN fused attention).

  Must be called inside a Flax module's compact method (TE's layer is a Flax module, without params). Rows
  hold one document padded at the end (the config rejects packed data for this kernel); the padding is
  masked from the segment ids. Sliding window and soft cap are rejected by the config.
  """
  from transformer_engine.jax.flax import DotProductAttention  # pylint: disable=import-outside-toplevel

  if sliding_window > 0 or logits_soft_cap > 0:
    raise ValueError("attention=cudnn_flash_te supports neither a sliding window nor a logits soft cap")
  _, _, num_q, head_dim = query.shape
  layer = DotProductAttention(
    head_dim=head_dim,
    num_attention_heads=num_q,
    num_gqa_groups=key.shape[2],
    attn_mask_type="padding_causal",
    attn_bias_type="no_bias",
    attention_dropout=0.0,
    dtype=query.dtype,
    qkv_layout="bshd_bshd_bshd",
    scale_factor=1.0,  # the query is already scaled
    transpose_batch_sequence=False,
  )
  # TE's mask is True where attention is NOT allowed; it reads the padding (row lengths) from it.
  valid = segment_ids != 0
  pad_mask = ~(valid[:, None, :, None] & valid[:, None, None, :])  # (B, 1, T, S)
  return layer(query, key, value, mask=pad_mask, deterministic=True)
