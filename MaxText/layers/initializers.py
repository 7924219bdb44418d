"""Parameter initialisers, with the fan-in taken over the contracting axes of each kernel."""

import flax.linen as nn
import jax


def nd_dense_init(scale: float, mode: str, distribution: str):
  """variance_scaling whose in/out axes are given per kernel (DenseGeneral kernels have several)."""

  def init_fn(key, shape, dtype, in_axis, out_axis):
    return jax.nn.initializers.variance_scaling(scale, mode, distribution, in_axis, out_axis)(key, shape, dtype)

  return init_fn


default_kernel_init = nd_dense_init(1.0, "fan_in", "truncated_normal")
attention_kernel_init = nd_dense_init(1.0, "fan_in", "normal")
token_embedding_init = nn.initializers.normal(stddev=1.0)
