"""RMSNorm, reduced in float32 whatever the activation dtype."""

import flax.linen as nn
import jax.numpy as jnp
from jax import lax


class RMSNorm(nn.Module):
  """y = x / sqrt(mean(x^2) + epsilon) * scale, with scale initialised to ones."""

  epsilon: float = 1e-6
  dtype: str = "float32"
  weight_dtype: str = "float32"

  @nn.compact
  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    scale = self.param(
      "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],), self.weight_dtype
    )
    return y.astype(self.dtype) * scale.astype(self.dtype)
