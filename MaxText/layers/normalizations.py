"""RMSNorm (plain or Gemma's (1 + scale)) and LayerNorm with bias, reduced in float32 whatever the activation dtype."""

import flax.linen as nn
import jax.numpy as jnp
from jax import lax


class RMSNorm(nn.Module):
  """y = x / sqrt(mean(x^2) + epsilon) * scale, with scale initialised to ones.

  scale_plus_one (Gemma): y * (1 + scale) with scale initialised to zeros, multiplied in float32 before the cast
  (Llama multiplies in the activation dtype), so the stored scale is the reference checkpoint's weight.
  """

  epsilon: float
  dtype: str
  weight_dtype: str
  scale_plus_one: bool = False

  @nn.compact
  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    init = nn.initializers.zeros if self.scale_plus_one else nn.initializers.ones
    scale = self.param("scale", nn.with_logical_partitioning(init, ("norm",)), (x.shape[-1],), self.weight_dtype)
    if self.scale_plus_one:
      return (y * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
    return y.astype(self.dtype) * scale.astype(self.dtype)


class LayerNorm(nn.Module):
  """y = (x - mean(x)) / sqrt(var(x) + epsilon) * scale + bias (GPT), reduced in float32."""

  epsilon: float
  dtype: str
  weight_dtype: str

  @nn.compact
  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = ((x32 - mean) * lax.rsqrt(var + self.epsilon)).astype(self.dtype)
    features = (x.shape[-1],)
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), features, self.weight_dtype)
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), features, self.weight_dtype)
    return y * scale.astype(self.dtype) + bias.astype(self.dtype)
