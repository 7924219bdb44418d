"""Token embedding (shared with tied logits) and rotary position embedding."""

import dataclasses
import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from MaxText.layers import initializers
from MaxText.layers.yarn import YarnRopeScaling


class Embed(nn.Module):
  """A [vocab, embed] table; `attend` reuses it as the output projection for tied logits.

  `dtype` is the dtype of the looked-up embeddings, `attend_dtype` that of the `attend` dot (float32 for
  logits_dot_in_fp32, as the untied logits' DenseGeneral). use_iota (use_iota_embed) looks up by a one-hot
  matmul instead of a gather, which is faster on TPU; the values are the same.
  """

  num_embeddings: int
  features: int
  dtype: str
  weight_dtype: str
  use_iota: bool
  attend_dtype: str

  def setup(self):
    self.embedding = self.param(
      "embedding",
      nn.with_logical_partitioning(initializers.token_embedding_init, ("vocab", "embed")),
      (self.num_embeddings, self.features),
      self.weight_dtype,
    )

  def __call__(self, token_ids):
    if self.use_iota:
      one_hot = (token_ids[..., None] == jnp.arange(self.num_embeddings, dtype=token_ids.dtype)).astype(self.dtype)
      y = jnp.dot(one_hot, self.embedding.astype(self.dtype))  # (B, T, V) @ (V, E)
    else:
      y = jnp.take(self.embedding, token_ids, axis=0).astype(self.dtype)  # (B, T, E)
    # Rows split as the decoder layers' (not over stage, unlike the logits): split over stage as well, the scatter of
    # the embedding's gradient would gather the whole batch's activations on every device.
    return nn.with_logical_constraint(y, ("activation_batch", "activation_length", "activation_embed"))

  def attend(self, x):
    return jnp.einsum("bte,ve->btv", x.astype(self.attend_dtype), self.embedding.astype(self.attend_dtype))  # (B, T, V)


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3.1's frequency scaling (transformers' rope_type "llama3"): long wavelengths are divided by `factor`,
  short ones kept, and the band between original/low_freq_factor and original/high_freq_factor interpolated."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def apply(self, inv_freq):
    """(D/2,) float32 frequencies -> the scaled ones."""
    f32 = np.float32
    low_wavelen = f32(self.original_max_position_embeddings / self.low_freq_factor)
    high_wavelen = f32(self.original_max_position_embeddings / self.high_freq_factor)
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / f32(self.factor), inv_freq)
    # low == high (Llama 4 Scout) leaves no band to interpolate: max() only keeps the unused division finite.
    smooth = (f32(self.original_max_position_embeddings) / wavelen - f32(self.low_freq_factor)) / f32(
      max(self.high_freq_factor - self.low_freq_factor, 1e-6)
    )
    smoothed = (1 - smooth) * scaled / f32(self.factor) + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
  """Linear RoPE scaling (transformers' rope_type linear; Gemma 3's global layers): every frequency / factor."""

  factor: float

  def apply(self, inv_freq):
    return (inv_freq / np.float32(self.factor)).astype(np.float32)


RopeScaling = Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling | None


def rope_inverse_frequencies(head_dim: int, min_timescale: float, max_timescale: float, scaling: RopeScaling = None):
  """The (D/2,) angular frequencies of RoPE, 1 / (min * (max/min)^(2i/D)), computed as transformers does (float32).

  YaRN ramps over the unscaled timescales with max_timescale as its base (rope_min_timescale 1, as transformers')."""
  fraction = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
  timescale = np.float32(min_timescale) * (np.float32(max_timescale / min_timescale) ** fraction)
  if isinstance(scaling, YarnRopeScaling):
    return scaling.inverse_frequencies(timescale, max_timescale)
  inv_freq = (np.float32(1.0) / timescale).astype(np.float32)
  return scaling.apply(inv_freq) if scaling is not None else inv_freq


def apply_rotary_embedding(x, positions, min_timescale: float, max_timescale: float, scaling: RopeScaling = None):
  """RoPE in the split-halves convention: x = [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin].

  This is transformers' `rotate_half` convention, so Hugging Face q/k kernels map by a reshape only.

  Args:
    x: (B, T, N, D) queries or keys.
    positions: (B, T) integer positions (restarting at 0 in each packed segment).
  """
  inv_freq = jnp.asarray(rope_inverse_frequencies(x.shape[-1], min_timescale, max_timescale, scaling))  # (D/2,)
  angles = positions[:, :, None, None].astype(jnp.float32) * inv_freq  # (B, T, 1, D/2)
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  if isinstance(scaling, YarnRopeScaling):  # YaRN's attention factor multiplies cos and sin, as transformers does
    sin, cos = sin * scaling.attention_factor, cos * scaling.attention_factor
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
