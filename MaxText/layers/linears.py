"""Dense projections over several axes, and the gated MLP block."""

import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import initializers, qlora, quantizations
from MaxText.layers import lora as adapters
from MaxText.layers.dropout import Dropout

# The collection whose entries ask a dense layer's `Gemm.tap` for statistics of its operands (numerics debugging);
# the decoder stacks it over scanned layers like the params.
TAP_COLLECTION = "numerics"

ACTIVATIONS = {
  "silu": nn.silu,
  "swish": nn.swish,
  "gelu": nn.gelu,  # tanh approximation (transformers' gelu_pytorch_tanh / gelu_new), as upstream MaxText
  "gelu_exact": functools.partial(nn.gelu, approximate=False),  # erf form (transformers' "gelu")
  "relu": nn.relu,
  "tanh": jnp.tanh,
  "sigmoid": nn.sigmoid,
  "linear": lambda x: x,
}


def _canonical_axes(axes, ndim: int) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(a % ndim for a in axes)


@dataclasses.dataclass(frozen=True)
class Gemm:
  """How the dense layers of the decoder layers multiply, built once per model (train_state.create_model).

  Attributes:
    quant: quantization=int8|int8w|int4w|intmp|fp8, per layer and per GEMM (quantizations.from_config);
      None: lax.dot_general.
    tap: statistics of the GEMM's operands and output gradient, called as
      tap(module, inputs, kernel, dimension_numbers, gemm, fp8_scales) (diagnostics.numerics_taps.dot_general);
      None when the run collects none. It acts only where the model is applied with TAP_COLLECTION.
    lora: enable_lora's adapters, on the layers that its module_path selects (layers/lora.py); None: off.
    scope: the module path that a block applied on its own runs under (a pipelined stack's block is applied
      functionally, so its own path starts below decoder/<stack>); what selects layers by path sees it whole.
  """

  quant: quantizations.Quantization | None = None
  tap: Callable | None = None
  lora: adapters.LoraSpec | None = None
  scope: tuple[str, ...] = ()

  def __call__(self, module, inputs, kernel, dimension_numbers):
    """The GEMM of the DenseGeneral `module`."""
    gemm = functools.partial(quantizations.dot_general, module, self.quant, scope=self.scope)
    if self.tap is None:
      return gemm(inputs, kernel, dimension_numbers)
    fp8_scales = functools.partial(quantizations.fp8_tap_scales, module, self.quant, inputs, kernel, self.scope)
    return self.tap(module, inputs, kernel, dimension_numbers, gemm, fp8_scales)


PLAIN = Gemm()  # lax.dot_general: the logits, the MoE router and the experts


class DenseGeneral(nn.Module):
  """A projection contracting `axis` of the input into `features` (an int or a tuple of output dims).

  The kernel has shape input_dims[axis] + features and carries the logical axis names `kernel_axes`;
  use_bias adds a `bias` of shape features (zeros at init).
  """

  features: int | Sequence[int]
  kernel_axes: Sequence[str]
  dtype: str
  weight_dtype: str
  axis: int | Sequence[int] = -1
  kernel_init: callable = initializers.default_kernel_init
  use_bias: bool = False
  gemm: Gemm = PLAIN

  @nn.compact
  def __call__(self, inputs):
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    axis = _canonical_axes(self.axis, inputs.ndim)
    kernel_in = tuple(inputs.shape[a] for a in axis)
    kernel_shape = kernel_in + features
    in_axes = tuple(range(len(kernel_in)))
    out_axes = tuple(range(len(kernel_in), len(kernel_shape)))
    init = functools.partial(self.kernel_init, in_axis=in_axes, out_axis=out_axes)
    qtype = self.gemm.lora.weight_qtype if self.gemm.lora is not None else ""
    if qtype:  # QLoRA: the frozen base's kernels, adapted or not, are held quantized
      names = tuple(self.kernel_axes)
      kernel = qlora.declare(self, qtype, init, kernel_shape, in_axes, names, self.weight_dtype, self.dtype)
    else:
      kernel = self.param(
        "kernel", nn.with_logical_partitioning(init, tuple(self.kernel_axes)), kernel_shape, self.weight_dtype
      )
    adapted = self.gemm.lora is not None and self.gemm.lora.selects(self.gemm.scope + tuple(self.path))
    if adapted:
      kernel = jax.lax.stop_gradient(kernel)  # LoRA trains the adapters only: no gradient for the frozen base
    inputs = inputs.astype(self.dtype)
    kernel = kernel.astype(self.dtype)
    out = self.gemm(self, inputs, kernel, ((axis, in_axes), ((), ())))  # quantized and tapped as the run asks
    if adapted:
      out = out + adapters.delta(self, self.gemm.lora, inputs, axis, tuple(self.kernel_axes), features, self.dtype)
    if self.use_bias:
      bias_axes = tuple(self.kernel_axes)[len(kernel_in) :]
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, bias_axes), features, self.weight_dtype)
      out = out + bias.astype(self.dtype)
    return out


class MlpBlock(nn.Module):
  """Gated MLP: wo(prod_i act_i(wi_i x)); one activation gives a plain MLP with a single `wi`.

  fused (fused_mlp) holds the wi_i as one `wi` kernel [E, A, M] (A activations) and runs them as one matmul.
  """

  intermediate_dim: int
  activations: Sequence[str]
  dropout_rate: float
  dtype: str
  weight_dtype: str
  fused: bool
  gemm: Gemm
  use_bias: bool = False

  @nn.compact
  def __call__(self, x, deterministic: bool):
    dense = functools.partial(
      DenseGeneral, dtype=self.dtype, weight_dtype=self.weight_dtype, use_bias=self.use_bias, gemm=self.gemm
    )
    num = len(self.activations)
    if self.fused and num > 1:
      h = dense((num, self.intermediate_dim), ("embed", None, "mlp"), name="wi")(x)  # (B, T, A, M)
      h = checkpoint_name(h, "mlpwi")
      branches = [ACTIVATIONS[act](h[..., i, :]) for i, act in enumerate(self.activations)]
    else:
      branches = []
      for i, act in enumerate(self.activations):
        name = "wi" if num == 1 else f"wi_{i}"
        h = dense(self.intermediate_dim, ("embed", "mlp"), name=name)(x)
        if num > 1:
          h = checkpoint_name(h, f"mlpwi_{i}")  # for remat_policy=custom; all of them are "mlpwi" too
        h = checkpoint_name(h, "mlpwi")
        branches.append(ACTIVATIONS[act](h))
    h = functools.reduce(operator.mul, branches)  # (B, T, M)
    h = nn.with_logical_constraint(h, ("activation_batch", "activation_length", "activation_mlp"))
    h = Dropout(self.dropout_rate)(h, deterministic=deterministic)
    return checkpoint_name(dense(x.shape[-1], ("mlp", "embed"), name="wo")(h), "mlpwo")
