"""Multi-head Latent Attention (MLA), the self-attention of DeepSeek-V2 and V3.

MLA compresses the keys and values of a token into one low-rank latent shared by every head. `wkv_a` projects
the token to a latent c_kv (kv_lora_rank, normalised by `kv_norm`) and to one single-head key part k_pe
(qk_rope_head_dim); `wkv_b` expands c_kv per head into a key part without position, k_nope (qk_nope_head_dim),
and a value (v_head_dim). Each head's key is [k_nope, k_pe], k_pe being the same for every head. The query is
[q_nope, q_pe] per head, projected directly (`query`, q_lora_rank = 0 as DeepSeek-V2-Lite) or through its own
low-rank bottleneck (`wq_a`, `q_norm`, `wq_b`). Only q_pe and k_pe carry RoPE ("decoupled RoPE"): a rotation
cannot pass through wkv_b, so keeping position out of c_kv is what lets decoding work on the latents alone.

KV cache (decoding): the cache stores the compressed latent, not per-head keys and values: `cached_kv_latent`
(B, cache_length, kv_lora_rank) after kv_norm and `cached_k_rope` (B, cache_length, qk_rope_head_dim) after RoPE,
kv_lora_rank + qk_rope_head_dim numbers a token instead of num_heads * (qk_head_dim + v_head_dim) (576 instead of
40,960 for DeepSeek-V3): that saving is MLA's purpose. Decoding never expands the cache: the key half of wkv_b,
W_uk, is absorbed into the query (q_nope W_uk^T, a kv_lora_rank vector per head), a query sees slot s with the
logit q_latent . c_kv[s] + q_pe . k_pe[s] (one shared "key head" over the latents, as multi-query attention), and
the value half, W_uv, maps each head's weighted sum of latents to its value space afterwards.

Reference: transformers' DeepseekV3Attention, whose default config (rope_interleave=True) reads the RoPE part of
the query and of k_pe as interleaved pairs (x0, x1), (x2, x3), ...: DeepSeek's original weight layout, kept here
so that Hugging Face checkpoints convert by transposes and reshapes only.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import context_parallel, initializers
from MaxText.layers.attention_masks import cache_mask
from MaxText.layers.attentions import dot_product_attention, masked_attention
from MaxText.layers.flash_attention import flash_attention
from MaxText.layers.linears import DenseGeneral, Gemm
from MaxText.layers.normalizations import RMSNorm
from MaxText.layers.ring_attention import sharded_ring_attention
from MaxText.layers.yarn import YarnRopeScaling, rope_frequencies, yarn_rope_scaling  # noqa: F401  (deepseek's names)

# The kernels MLA runs over a whole sequence; both take a value head dim that differs from the query's.
ATTENTION_KERNELS = ("dot_product", "flash")


def apply_decoupled_rope(x, positions, inv_freq, attention_factor: float = 1.0, interleaved: bool = True):
  """RoPE of the positional part of MLA's queries and keys; returns it in the split-halves layout.

  interleaved: x holds pairs (x0, x1), (x2, x3), ..., pair i rotated by inv_freq[i] (DeepSeek's weights,
  transformers' apply_rotary_pos_emb_interleave); else halves [x1, x2] rotated elementwise (rotate_half). Either
  way the result is [x1 cos - x2 sin, x2 cos + x1 sin]: queries and keys get the same layout, so their dot is
  what the reference computes.

  Args:
    x: (B, T, N, R) float.
    positions: (B, T) integer positions.
    inv_freq: (R/2,) angular frequencies.
    attention_factor: multiplies cos and sin (YaRN's attention_factor, as transformers applies it).
  """
  angles = positions[:, :, None, None].astype(jnp.float32) * jnp.asarray(inv_freq)  # (B, T, 1, R/2)
  cos, sin = jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor
  x = x.astype(jnp.float32)
  x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class MLA(nn.Module):
  """Multi-head Latent Attention (module docstring), called as attentions.Attention.

  Params and their logical axes: `wq_a` [E, q_lora] ("embed", "q_lora"), `q_norm`, `wq_b` [q_lora, N, Dqk]
  ("q_lora", "heads", "kv"), or `query` [E, N, Dqk] ("embed", "heads", "kv") when q_lora_rank is 0; `wkv_a`
  [E, kv_lora + R] ("embed", "kv_lora"), `kv_norm`, `wkv_b` [kv_lora, N, nope + Dv] ("kv_lora", "heads", "kv"),
  `out` [N, Dv, E] ("heads", "kv", "embed"); norms' scales ("norm",). Dqk = qk_nope_head_dim + qk_rope_head_dim
  (R), each head's Dqk ordered [nope, rope]; wkv_a's output is [latent, k_pe]; wkv_b's per head [k_nope, value].

  KV cache: with the `cache` collection mutable (and not initializing) each call writes its latents at the slots
  of its positions in `cache/cached_kv_latent` and `cache/cached_k_rope` and attends over the cache in the
  absorbed form (module docstring), whatever attention_kernel. One path serves the prefill of a prompt from
  position 0 and each generated token.
  """

  num_heads: int
  q_lora_rank: int  # 0: the query is projected directly (`query`)
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  rope_max_timescale: float  # rope_theta
  rope_scaling: YarnRopeScaling | None  # yarn_rope_scaling(...); None: plain RoPE
  norm_epsilon: float  # q_norm and kv_norm (transformers hard-codes 1e-6 for these two)
  attention_kernel: str  # ATTENTION_KERNELS
  cache_length: int  # slots of the KV cache: max_target_length
  gemm: Gemm
  dtype: str
  weight_dtype: str
  rope_interleave: bool = True  # transformers' DeepseekV3Config.rope_interleave (default True)
  # How the sequence is laid out over the devices (context parallelism), as Attention's; from the config.
  layout: context_parallel.ContextParallel = context_parallel.NONE

  def __post_init__(self):
    if self.attention_kernel not in ATTENTION_KERNELS:
      raise ValueError(
        f"MLA: attention_kernel={self.attention_kernel!r} is not supported; use one of {ATTENTION_KERNELS}. MLA's"
        f" value head dim ({self.v_head_dim}) differs from its query/key head dim"
        f" ({self.qk_nope_head_dim + self.qk_rope_head_dim}), which only these kernels are written and tested for."
      )
    if self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
      raise ValueError(
        f"MLA: q_lora_rank={self.q_lora_rank} must be >= 0 (0: no query compression) and"
        f" qk_rope_head_dim={self.qk_rope_head_dim} even (RoPE rotates pairs)."
      )
    super().__post_init__()

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def query_scale(self) -> float:
    """The softmax scale, applied to the query: qk_head_dim**-0.5, times YaRN's mscale^2 (DeepseekV3Attention)."""
    multiplier = self.rope_scaling.softmax_scale_multiplier if self.rope_scaling else 1.0
    return self.qk_head_dim**-0.5 * multiplier

  def _rope(self, x, positions):
    inv_freq = rope_frequencies(self.qk_rope_head_dim, self.rope_max_timescale, self.rope_scaling)
    factor = self.rope_scaling.attention_factor if self.rope_scaling else 1.0
    return apply_decoupled_rope(x, positions, inv_freq, factor, self.rope_interleave).astype(x.dtype)

  def _cached(self, name: str, new, positions):
    """Writes new (B, T, D) at slots positions[:, 0] ... + T - 1 of each row of cache variable `name`; returns
    the whole cache (B, cache_length, D). A row's positions are consecutive within one call."""
    axes = ("cache_batch", "cache_sequence", "cache_kv")
    zeros = nn.with_logical_partitioning(jnp.zeros, axes)
    cached = self.variable("cache", name, zeros, (new.shape[0], self.cache_length, new.shape[2]), new.dtype)
    write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice_in_dim(cache, new, start, axis=0))
    cached.value = nn.with_logical_constraint(write(cached.value, new, positions[:, 0]), axes)
    return cached.value

  def _decode(self, query, kv_latent, k_rope, positions, wkv_b):
    """Absorbed attention over the latent cache: query (B, T, N, Dqk), scaled, RoPE'd -> (B, T, N, Dv)."""
    kv_latent = self._cached("cached_kv_latent", kv_latent, positions)  # (B, S, L)
    k_rope = self._cached("cached_k_rope", k_rope, positions)  # (B, S, R)
    # wkv_b's kernel, not its matmul: the absorbed form contracts it along other axes (its GEMM, and so any
    # quantization of it, is left out of decoding).
    kernel = nn.unbox(wkv_b.variables["params"]["kernel"]).astype(self.dtype)  # (L, N, nope + Dv)
    w_uk, w_uv = kernel[..., : self.qk_nope_head_dim], kernel[..., self.qk_nope_head_dim :]
    q_nope, q_rope = query[..., : self.qk_nope_head_dim], query[..., self.qk_nope_head_dim :]
    q_latent = jnp.einsum("btnd,lnd->btnl", q_nope, w_uk)  # (B, T, N, L)
    latent_query = jnp.concatenate([q_latent, q_rope], axis=-1)  # (B, T, N, L + R)
    latent_key = jnp.concatenate([kv_latent, k_rope], axis=-1)[:, :, None, :]  # (B, S, 1, L + R)
    mask = cache_mask(positions, self.cache_length)
    out = masked_attention(latent_query, latent_key, kv_latent[:, :, None, :], mask)  # (B, T, N, L)
    return jnp.einsum("btnl,lnv->btnv", out, w_uv)  # (B, T, N, Dv)

  @nn.compact
  def __call__(self, x, positions, segment_ids, deterministic: bool):
    """x (B, T, E), positions and segment_ids (B, T) -> (B, T, E). `deterministic`: no dropout (none here)."""
    del deterministic
    dense = functools.partial(
      DenseGeneral,
      dtype=self.dtype,
      weight_dtype=self.weight_dtype,
      kernel_init=initializers.attention_kernel_init,
      gemm=self.gemm,
    )
    norm = functools.partial(RMSNorm, epsilon=self.norm_epsilon, dtype=self.dtype, weight_dtype=self.weight_dtype)
    heads = (self.num_heads, self.qk_head_dim)
    if self.q_lora_rank > 0:
      q = norm(name="q_norm")(dense(self.q_lora_rank, ("embed", "q_lora"), name="wq_a")(x))  # (B, T, q_lora)
      q = checkpoint_name(q, "mla_q")
      query = dense(heads, ("q_lora", "heads", "kv"), name="wq_b")(q)
    else:
      query = dense(heads, ("embed", "heads", "kv"), name="query")(x)  # (B, T, N, Dqk)
    q_nope, q_rope = query[..., : self.qk_nope_head_dim], query[..., self.qk_nope_head_dim :]
    query = jnp.concatenate([q_nope, self._rope(q_rope, positions)], axis=-1) * self.query_scale
    query = nn.with_logical_constraint(query, ("activation_batch", "activation_length", "activation_heads", "activation_kv"))
    query = checkpoint_name(query, "query_proj")

    kv = dense(self.kv_lora_rank + self.qk_rope_head_dim, ("embed", "kv_lora"), name="wkv_a")(x)  # (B, T, L + R)
    kv = checkpoint_name(kv, "mla_kv")
    kv_latent = norm(name="kv_norm")(kv[..., : self.kv_lora_rank])  # (B, T, L)
    k_rope = self._rope(kv[..., None, self.kv_lora_rank :], positions)  # (B, T, 1, R): one head, shared
    wkv_b = dense((self.num_heads, self.qk_nope_head_dim + self.v_head_dim), ("kv_lora", "heads", "kv"), name="wkv_b")

    if self.is_mutable_collection("cache") and not self.is_initializing():
      out = self._decode(query, kv_latent, k_rope[:, :, 0], positions, wkv_b)
    else:
      kv = wkv_b(kv_latent)  # (B, T, N, nope + Dv)
      k_nope, value = kv[..., : self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim :]
      k_rope = jnp.broadcast_to(k_rope, (*k_nope.shape[:3], self.qk_rope_head_dim))
      key = checkpoint_name(jnp.concatenate([k_nope, k_rope], axis=-1), "key_proj")  # (B, T, N, Dqk)
      value = checkpoint_name(value, "value_proj")  # (B, T, N, Dv)
      kernel = flash_attention if self.attention_kernel == "flash" else dot_product_attention
      if self.layout.ring:  # context parallelism's ring strategy (the config allows it with dot_product only)
        kernel = sharded_ring_attention
      out = kernel(query, key, value, segment_ids, layout=self.layout)
    out = checkpoint_name(out, "context")  # (B, T, N, Dv)
    out = dense(x.shape[-1], ("heads", "kv", "embed"), axis=(-2, -1), name="out")(out)
    return checkpoint_name(out, "out_proj")
