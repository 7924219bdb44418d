"""quantize_kvcache: the decode KV cache in int8, with one absmax scale per token (kv_quant_axis=heads_and_dkv) or
per token and head (dkv), through qwix. The cache stores the int8 values under the usual name (cached_key) and
the scales beside them (cached_key_scale)."""

from typing import NamedTuple

import jax.numpy as jnp

# The axes of a (B, T, Nkv, D) key or value that keep their own scale.
SCALE_AXES = {"dkv": (0, 1, 2), "heads_and_dkv": (0, 1)}


class Quantized(NamedTuple):
  values: jnp.ndarray  # int8 (B, T, Nkv, D)
  scale: jnp.ndarray  # (B, T, Nkv or 1, 1) in the activation dtype


def quantize(x, kv_quant_axis: str) -> Quantized:
  import qwix  # pylint: disable=import-outside-toplevel  # only with quantize_kvcache: see quantizations.py

  q = qwix.quantize(x, jnp.int8, channelwise_axes=SCALE_AXES[kv_quant_axis])
  return Quantized(q.qvalue, q.scale.astype(x.dtype))


def dequantize(q: Quantized, dtype) -> jnp.ndarray:
  return q.values.astype(dtype) * q.scale.astype(dtype)
