"""Grouped-query self-attention: projections, RoPE, and the attention kernels (causal + packed segments,
optionally a sliding window and soft-capped logits)."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import context_parallel, initializers, kv_cache
from MaxText.layers.attention_masks import MASK_VALUE, attention_mask, cache_mask, soft_cap
from MaxText.layers.embeddings import RopeScaling, apply_rotary_embedding
from MaxText.layers.flash_attention import flash_attention
from MaxText.layers.gpu_attention import cudnn_attention, transformer_engine_attention
from MaxText.layers.linears import DenseGeneral, Gemm
from MaxText.layers.normalizations import RMSNorm
from MaxText.layers.ring_attention import sharded_ring_attention


def dot_product_attention(
  query,
  key,
  value,
  segment_ids,
  sliding_window: int = 0,
  logits_soft_cap: float = 0.0,
  float32_logits: bool = True,
  layout: context_parallel.ContextParallel = context_parallel.NONE,
  chunk: int = 0,
  sinks=None,
):
  """softmax(soft_cap(q k^T) + mask) v with grouped-query heads; the softmax scale is already in the query.

  Args:
    query: (B, T, Nq, D). key, value: (B, S, Nkv, D), Nq a multiple of Nkv.
    segment_ids: (B, T) packed-segment ids.
    sliding_window: > 0 limits each query to that many most recent keys (itself included).
    logits_soft_cap: > 0 caps the logits with soft_cap before masking.
    chunk: > 0 limits each query to the keys of its chunk of that many tokens (Llama 4).
    layout: the sequence's layout (context_parallel): its token order, and under context parallelism every key
      and value is gathered for the local queries (all_gather).
    sinks: None, or (Nq,) attention sinks (masked_attention).
  Returns:
    (B, T, Nq, D)
  """
  if layout.context > 1:
    gathered = ("activation_kv_batch", None, "activation_kv_heads", None)
    key, value = nn.with_logical_constraint(key, gathered), nn.with_logical_constraint(value, gathered)
  order = layout.token_order(query.shape[1]) if layout.load_balance else None
  mask = attention_mask(segment_ids, sliding_window, order, chunk)
  return masked_attention(
    query, key, value, mask, logits_soft_cap=logits_soft_cap, float32_logits=float32_logits, sinks=sinks
  )


def masked_attention(query, key, value, mask, logits_soft_cap: float = 0.0, float32_logits: bool = True, sinks=None):
  """softmax(soft_cap(q k^T), masked) v with grouped-query heads.

  Args:
    query: (B, T, Nq, D). key: (B, S, Nkv, D). value: (B, S, Nkv, Dv), Nq a multiple of Nkv; Dv may differ from D
      (multi-head latent attention).
    mask: (B, 1, 1, T, S) boolean, True where a query may see a key.
    sinks: None, or (Nq,) attention sinks (GPT-OSS): one more logit per head in each query's softmax, with no value,
      so that a query may give less than all of its weight to the keys.
  Returns:
    (B, T, Nq, Dv)
  """
  batch, length, num_q, head_dim = query.shape
  num_kv = key.shape[2]
  query = query.reshape(batch, length, num_kv, num_q // num_kv, head_dim)  # (B, T, Nkv, G, D)
  logits = jnp.einsum("btkgd,bskd->bkgts", query, key)  # (B, Nkv, G, T, S)
  if float32_logits:
    logits = logits.astype(jnp.float32)
  if logits_soft_cap > 0:
    logits = soft_cap(logits, logits_soft_cap)
  logits = jnp.where(mask, logits, MASK_VALUE)
  if sinks is not None:
    sink = sinks.astype(logits.dtype).reshape(1, num_kv, num_q // num_kv, 1, 1)
    logits = jnp.concatenate([logits, jnp.broadcast_to(sink, (*logits.shape[:-1], 1))], axis=-1)
  probs = nn.softmax(logits, axis=-1)
  probs = (probs[..., :-1] if sinks is not None else probs).astype(value.dtype)  # the sink's weight has no value
  out = jnp.einsum("bkgts,bskd->btkgd", probs, value)  # (B, T, Nkv, G, Dv)
  return out.reshape(batch, length, num_q, value.shape[-1])


@dataclasses.dataclass(frozen=True)
class LocalAttention:
  """Where local and global layers interleave (Gemma 3), what a local layer does instead: its sliding window and its
  RoPE base (a local layer's RoPE is never scaled)."""

  sliding_window: int
  rope_max_timescale: float
  scaled_rope: bool = False  # a local layer's RoPE is scaled as the global one's (GPT-OSS's YaRN); Gemma 3: not


def choose(is_local, compute):
  """compute(True) or compute(False): by Python for a known layer kind, by jax.lax.cond for a traced one (a scanned
  layer's kind follows from its index). compute must be pure (no Flax variables)."""
  if isinstance(is_local, bool):
    return compute(is_local)
  return jax.lax.cond(is_local, lambda: compute(True), lambda: compute(False))


class Attention(nn.Module):
  """Self-attention with query/key/value/out kernels named as in upstream MaxText checkpoints.

  Kernels are [E, N, D] (query, key, value) and [N, D, E] (out): a reshape of the Hugging Face [N*D, E]
  projections. Options a family picks: use_rope (False for GPT-3), use_bias (GPT-3), use_qk_norm (Qwen3:
  RMSNorm over head_dim of q and k before RoPE, `query_norm`/`key_norm`; qk_norm_plus_one: scaled by 1 + w, Gemma 3),
  fused_qkv (one `qkv_proj` kernel [E, 3, N, D], needs Nq == Nkv), local (a LocalAttention: the call's `is_local`
  picks it instead of sliding_window and the RoPE fields; the params are the same), attention_chunk (Llama 4's chunked
  local attention). A family's subclass may override `_rope` and `after_rope` (Llama 4's interleaved RoPE, L2 q/k norm
  and temperature tuning).

  KV cache (decoding): when the model is applied with the `cache` collection mutable (mutable=["cache"]),
  each call writes its keys and values at the slots of their positions in `cache/cached_key` and
  `cache/cached_value` (B, cache_length, Nkv, D), created as zeros on the first call, and its queries attend
  over the cache (dot-product, whatever attention_kernel). One path serves the prefill of a prompt (T
  tokens from position 0) and each generated token (T = 1). Training never makes `cache` mutable.
  """

  num_query_heads: int
  num_kv_heads: int
  head_dim: int
  attention_kernel: str  # a common_types.ATTENTION_KERNELS name other than autoselected
  attention_segments: str  # cudnn_flash_jax: gpu_attention.SEGMENTS (how packed segments are masked)
  rope_min_timescale: float
  rope_max_timescale: float
  rope_scaling: RopeScaling
  query_scale: float  # multiplies the query after RoPE: 1/sqrt(head_dim), or query_pre_attn_scalar**-0.5
  sliding_window: int
  logits_soft_cap: float
  norm_epsilon: float
  fused_qkv: bool
  cache_length: int  # slots of the KV cache: max_target_length
  quantize_kvcache: bool  # int8 keys and values in the cache, with a scale per kv_quant_axis
  kv_quant_axis: str  # "dkv": a scale per token and head; "heads_and_dkv": per token
  gemm: Gemm
  dtype: str
  weight_dtype: str
  # What a family picks (not config keys).
  use_rope: bool = True
  use_bias: bool = False
  use_qk_norm: bool = False
  qk_norm_plus_one: bool = False
  local: LocalAttention | None = None
  attention_chunk: int = 0  # > 0: each query sees the keys of its chunk only (Llama 4; dot_product and flash)
  use_sinks: bool = False  # attention_sink: a learned logit per query head in each softmax (`sinks`, GPT-OSS)
  # How the sequence is laid out over the devices (context parallelism); from the config (block_parts).
  layout: context_parallel.ContextParallel = context_parallel.NONE

  def _project(self, x):
    """(B, T, E) -> query (B, T, Nq, D), key and value (B, T, Nkv, D), with their remat names."""
    dense = functools.partial(
      DenseGeneral,
      dtype=self.dtype,
      weight_dtype=self.weight_dtype,
      kernel_init=initializers.attention_kernel_init,
      use_bias=self.use_bias,
      gemm=self.gemm,
    )
    if self.fused_qkv:
      qkv = dense((3, self.num_query_heads, self.head_dim), ("embed", None, "heads", "kv"), name="qkv_proj")(x)
      qkv = checkpoint_name(qkv, "qkv_proj")  # (B, T, 3, N, D)
      return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    query = dense((self.num_query_heads, self.head_dim), ("embed", "heads", "kv"), name="query")(x)
    key = dense((self.num_kv_heads, self.head_dim), ("embed", "kv_heads", "kv_head_dim"), name="key")(x)
    value = dense((self.num_kv_heads, self.head_dim), ("embed", "kv_heads", "kv_head_dim"), name="value")(x)
    return checkpoint_name(query, "query_proj"), checkpoint_name(key, "key_proj"), checkpoint_name(value, "value_proj")

  def _cached(self, name: str, new, positions):
    """Writes new (B, T, ...) at slots positions[:, 0] ... + T - 1 of each row of the cache variable `name`.

    A row's positions are consecutive within one call (a prompt from 0, or one generated token). Returns the
    whole cache (B, cache_length, ...).
    """
    axes = ("cache_batch", "cache_sequence", "cache_heads", "cache_kv")
    axes = tuple(a if size > 1 else None for a, size in zip(axes, new.shape))  # an int8 cache's scales: size 1
    zeros = nn.with_logical_partitioning(jnp.zeros, axes)
    cached = self.variable("cache", name, zeros, (new.shape[0], self.cache_length, *new.shape[2:]), new.dtype)
    write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice_in_dim(cache, new, start, axis=0))
    cached.value = nn.with_logical_constraint(write(cached.value, new, positions[:, 0]), axes)
    return cached.value

  def _update_cache(self, key, value, positions):
    """Writes (B, T, Nkv, D) keys and values into the cache; returns the cached keys and values (B, S, Nkv, D).

    With quantize_kvcache the cache holds them in int8 (cached_key) with their scales (cached_key_scale).
    """
    cached = []
    for name, x in (("cached_key", key), ("cached_value", value)):
      if self.quantize_kvcache:
        q = kv_cache.quantize(x, self.kv_quant_axis)
        q = kv_cache.Quantized(self._cached(name, q.values, positions), self._cached(f"{name}_scale", q.scale, positions))
        cached.append(kv_cache.dequantize(q, x.dtype))
      else:
        cached.append(self._cached(name, x, positions))
    return tuple(cached)

  def _rope(self, query, key, positions, is_local: bool):
    if not self.use_rope:
      return query, key
    timescale, scaling = self.rope_max_timescale, self.rope_scaling
    if is_local:
      timescale, scaling = self.local.rope_max_timescale, (scaling if self.local.scaled_rope else None)
    rope = functools.partial(
      apply_rotary_embedding, min_timescale=self.rope_min_timescale, max_timescale=timescale, scaling=scaling
    )
    return rope(query, positions), rope(key, positions)

  def after_rope(self, query, key, positions):
    """What a family does to the queries and keys between RoPE and the softmax scale (Llama 4: its L2 norm and
    temperature tuning); nothing here."""
    del positions
    return query, key

  def _window(self, is_local: bool) -> int:
    return self.local.sliding_window if is_local else self.sliding_window

  def _attend(self, query, key, value, segment_ids, sinks, is_local: bool):
    """The attention kernel over the whole (training or eval) sequence; sinks: None or (Nq,) (the kernels that take
    them: attention_selection refuses attention_sink with the others)."""
    kernels = {
      "dot_product": functools.partial(dot_product_attention, layout=self.layout),
      "flash": functools.partial(flash_attention, layout=self.layout),
      "cudnn_flash_jax": functools.partial(cudnn_attention, segments=self.attention_segments),
      "cudnn_flash_te": transformer_engine_attention,
    }
    kernel = kernels[self.attention_kernel]
    if self.layout.ring:  # the config allows ring with dot_product only
      kernel = functools.partial(sharded_ring_attention, layout=self.layout)
    if self.attention_chunk:  # the config allows it with dot_product and flash only
      kernel = functools.partial(kernel, chunk=self.attention_chunk)
    with_sinks = {} if sinks is None else {"sinks": sinks}
    return kernel(
      query,
      key,
      value,
      segment_ids,
      sliding_window=self._window(is_local),
      logits_soft_cap=self.logits_soft_cap,
      **with_sinks,
    )

  @nn.compact
  def __call__(self, x, positions, segment_ids, deterministic: bool, is_local=False):
    """x (B, T, E), positions and segment_ids (B, T) -> (B, T, E). `deterministic`: no dropout (none here yet).

    is_local: a bool, or a traced bool scalar (a scanned layer's): attend as `local` says (needs `local`)."""
    del deterministic
    if self.local is None and is_local is not False:
      raise ValueError("is_local needs the Attention's `local` field")
    query, key, value = self._project(x)
    if self.use_qk_norm:
      norm = functools.partial(
        RMSNorm,
        epsilon=self.norm_epsilon,
        dtype=self.dtype,
        weight_dtype=self.weight_dtype,
        scale_plus_one=self.qk_norm_plus_one,
      )
      query, key = norm(name="query_norm")(query), norm(name="key_norm")(key)
    query, key = choose(is_local, functools.partial(self._rope, query, key, positions))
    query, key = self.after_rope(query, key, positions)
    # The softmax scale is applied here, not folded into the query kernel, so that checkpoints convert by
    # permutation only. Scaling q (not the logits) serves every kernel, flash included.
    query = nn.with_logical_constraint(
      query * self.query_scale, ("activation_batch", "activation_length", "activation_heads", "activation_kv")
    )
    sinks = None
    if self.use_sinks:
      init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("heads",))
      sinks = self.param("sinks", init, (self.num_query_heads,), self.weight_dtype)
    if self.is_mutable_collection("cache") and not self.is_initializing():
      key, value = self._update_cache(key, value, positions)  # (B, S, Nkv, D): every slot
      mask = choose(
        is_local,
        lambda local: cache_mask(positions, self.cache_length, self._window(local), self.attention_chunk, segment_ids),
      )
      out = masked_attention(query, key, value, mask, logits_soft_cap=self.logits_soft_cap, sinks=sinks)
    else:
      out = choose(is_local, functools.partial(self._attend, query, key, value, segment_ids, sinks))
    out = checkpoint_name(out, "context")  # (B, T, Nq, D)
    out = DenseGeneral(
      x.shape[-1],
      ("heads", "kv", "embed"),
      axis=(-2, -1),
      dtype=self.dtype,
      weight_dtype=self.weight_dtype,
      kernel_init=initializers.attention_kernel_init,
      use_bias=self.use_bias,
      gemm=self.gemm,
      name="out",
    )(out)
    return checkpoint_name(out, "out_proj")
