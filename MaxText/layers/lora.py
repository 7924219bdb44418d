"""LoRA adapters on the dense layers: out = x W + (alpha / rank) (x A) B, with W frozen.

A DenseGeneral whose module path matches `lora_module_path` holds, beside its kernel W (in... + out...), the params
`lora_a` (in... + (rank,)) and `lora_b` ((rank,) + out...). A starts as PEFT's (uniform in +-1/sqrt(fan_in)) and
B at zero, so a fresh adapter changes nothing. A carries the kernel's input axes' logical names and B its output
axes', so the adapters are sharded like the kernel they adapt and the kernel's own sharding is unchanged.
"""

import dataclasses
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.layers import layer_names

ADAPTER_PARAMS = ("lora_a", "lora_b")
_UNROLLED = re.compile(r"^layers_\d+$")


def module_name(path: tuple[str, ...]) -> str:
  """The '/'-joined module path that lora_module_path is searched in; unrolled layers_<i> read as layers, like
  scanned ones (decoder/layers/self_attention/query)."""
  return "/".join("layers" if _UNROLLED.match(p) else p for p in path)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """enable_lora's settings, built once per model (train_state.create_model)."""

  rank: int
  alpha: float
  module_path: str  # a regex searched in module_name(); '.' matches the '/' separators too
  weight_qtype: str = ""  # QLoRA: every dense kernel of the frozen base held quantized (layers/qlora.py)

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def selects(self, path: tuple[str, ...]) -> bool:
    return re.search(self.module_path, module_name(path)) is not None


def is_adapter(keys: tuple) -> bool:
  return bool(keys) and keys[-1] in ADAPTER_PARAMS


def split(params) -> tuple[dict, dict]:
  """(base, adapters): two trees of the params' nesting, each holding only its own leaves."""
  return layer_names.partition(params, lambda keys, _: is_adapter(keys))


def from_config(config) -> LoraSpec | None:
  if not config.enable_lora:
    return None
  return LoraSpec(config.lora_rank, float(config.lora_alpha), config.lora_module_path, config.lora_weight_qtype)


def _peft_a_init(key, shape, dtype, fan_in: int):
  bound = 1.0 / math.sqrt(fan_in)  # PEFT's kaiming_uniform_(a=sqrt(5)) on a (rank, fan_in) weight
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def delta(module, spec: LoraSpec, inputs, axis: tuple[int, ...], kernel_axes: tuple, features: tuple, dtype):
  """The adapter's term (alpha / rank) (x A) B of the DenseGeneral `module`, declaring its lora_a and lora_b.

  Args:
    inputs: x, already in the compute dtype; `axis` its contracted dims (the kernel's input dims).
    kernel_axes: the kernel's logical axis names (input dims, then output dims).
    features: the output dims.
  """
  kernel_in = tuple(inputs.shape[a] for a in axis)
  n_in = len(kernel_in)
  init_a = lambda key, shape, dt: _peft_a_init(key, shape, dt, math.prod(kernel_in))
  a = module.param(
    "lora_a",
    nn.with_logical_partitioning(init_a, tuple(kernel_axes[:n_in]) + (None,)),
    kernel_in + (spec.rank,),
    module.weight_dtype,
  )
  b = module.param(
    "lora_b",
    nn.with_logical_partitioning(nn.initializers.zeros, (None,) + tuple(kernel_axes[n_in:])),
    (spec.rank,) + features,
    module.weight_dtype,
  )
  h = jax.lax.dot_general(inputs, a.astype(dtype), ((axis, tuple(range(n_in))), ((), ())))  # (..., rank)
  out = jax.lax.dot_general(h, b.astype(dtype), (((h.ndim - 1,), (0,)), ((), ())))  # (..., out...)
  return out * jnp.asarray(spec.scale, dtype)
