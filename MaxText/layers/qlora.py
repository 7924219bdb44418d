"""QLoRA's frozen base: a dense kernel held quantized (lora_weight_qtype), dequantized to the compute dtype before
its matmul.

- int8: round(w / s) in [-127, 127], s = absmax / 127 per output channel (the max over the input dims).
- fp8: w / s in float8_e4m3fn, s = absmax / 448 (e4m3's largest finite value) per output channel.
- nf4 (QLoRA, Dettmers et al. 2023): blocks of 64 consecutive values along one input axis, each divided by its
  absmax and rounded to the nearest of the 16 NormalFloat values; the 4-bit indices are packed two per uint8 along
  the block axis (neighbours i, i + 1 of a block: i in the high nibble), so the codes have that axis halved and
  every other axis (and every logical axis name) of the float kernel.

The scale (float32) has the kernel's number of dims: 1 on the reduced dims (int8, fp8), or the block axis divided by
the block (nf4). quantize() finds the reduced dims (the block axis) from the two shapes, so a scanned stack of kernels
(a layers axis inserted in both) quantizes as each layer's kernel would; nf4's dequantize() finds its packed axis the
same way (codes n / 2, scale n / block: they differ since the block is at least 4). QLoRA's double quantization of the
scales is not done.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from MaxText.errors import ConfigError

QTYPES = ("int8", "fp8", "nf4")
NF4_BLOCK = 64
# The NF4 code book: bitsandbytes' functional.get_4bit_type("nf4") (QLoRA paper, appendix E): quantiles of N(0, 1)
# scaled to [-1, 1], with an exact 0.
NF4 = np.array(
  [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
  ],
  np.float32,
)
# nf4's indices are packed two per uint8 by hand (shifts and masks, elementwise beside the code book's take): a
# jnp.uint4 param got a packed layout that the compiled train step then refused ("compiled for input layouts that
# disagree with the layouts of arguments", XLA:CPU, jax 0.10), and one index per byte took as much memory as int8.
_CODE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "nf4": jnp.uint8}
_INT8_MAX, _FP8_MAX = 127.0, 448.0


def code_dtype(qtype: str):
  return _CODE_DTYPES[qtype]


def is_code(leaf) -> bool:
  """Whether a param (or its abstract shape) is a quantized kernel's codes: frozen, never differentiated."""
  return hasattr(leaf, "dtype") and any(leaf.dtype == d for d in _CODE_DTYPES.values())


def _nf4_block_axis(shape: tuple, in_axes: tuple, where: str = "a dense kernel") -> tuple[int, int]:
  """(axis, block): the input axis whose size shares the largest factor with NF4_BLOCK (the first on ties). The block
  must be a multiple of 4: two indices share a byte, and with a block of 2 the packed codes and the scale would have
  the same shape, leaving the packed axis unreadable from them."""
  axis = max(in_axes, key=lambda a: (math.gcd(shape[a], NF4_BLOCK), -a))
  block = math.gcd(shape[axis], NF4_BLOCK)
  if block % 4:
    dims = [shape[a] for a in in_axes]
    raise ConfigError(
      f"lora_weight_qtype=nf4 packs two 4-bit codes per byte within blocks along an input axis, which needs an input"
      f" dim divisible by 4: {where} of shape {tuple(shape)} has input dims {dims}; use int8 or fp8"
    )
  return axis, block


def scale_layout(qtype: str, shape: tuple, in_axes: tuple, axis_names: tuple, where: str = "a dense kernel"):
  """The scale's (shape, logical axis names) for a kernel of `shape` contracting `in_axes` (`where`: its name in an
  error)."""
  if qtype == "nf4":
    axis, block = _nf4_block_axis(shape, in_axes, where)
    return tuple(n // block if i == axis else n for i, n in enumerate(shape)), tuple(axis_names)
  reduced = tuple(1 if i in in_axes else n for i, n in enumerate(shape))
  return reduced, tuple(None if i in in_axes else name for i, name in enumerate(axis_names))


def _blocked(w, scale_shape: tuple):
  """w with its block axis split in two, (..., n_blocks, block, ...), and the index of the block dim."""
  axis = next((i for i, (n, m) in enumerate(zip(w.shape, scale_shape)) if n != m), 0)
  blocks = scale_shape[axis]
  return w.reshape(w.shape[:axis] + (blocks, w.shape[axis] // blocks) + w.shape[axis + 1 :]), axis + 1


def code_shape(qtype: str, shape: tuple, in_axes: tuple) -> tuple:
  """The codes' shape for a float kernel of `shape`: nf4 halves its block axis (two indices a byte)."""
  if qtype != "nf4":
    return tuple(shape)
  axis, _ = _nf4_block_axis(shape, in_axes)
  return tuple(n // 2 if i == axis else n for i, n in enumerate(shape))


def float_shape(codes_shape: tuple, scale_shape: tuple, qtype: str) -> tuple:
  """The float kernel's shape from its codes' and scale's (nf4: the packed axis is where the two differ)."""
  if qtype != "nf4":
    return tuple(codes_shape)
  axis = _packed_axis(codes_shape, scale_shape)
  return tuple(2 * n if i == axis else n for i, n in enumerate(codes_shape))


def _packed_axis(codes_shape: tuple, scale_shape: tuple) -> int:
  return next(i for i, (n, m) in enumerate(zip(codes_shape, scale_shape)) if n != m)


def _pack(index, axis: int):
  """uint8 indices (< 16) two per byte along `axis` (even): each pair of neighbours, the first in the high nibble."""
  pairs = index.reshape(index.shape[:axis] + (index.shape[axis] // 2, 2) + index.shape[axis + 1 :])
  high, low = (jax.lax.index_in_dim(pairs, i, axis + 1, keepdims=False) for i in (0, 1))
  return (high << 4) | low


def _unpack(codes, axis: int):
  """_pack's inverse: the indices with `axis` doubled, high then low nibble of each byte."""
  pairs = jnp.stack([codes >> 4, codes & 0xF], axis=axis + 1)
  return pairs.reshape(codes.shape[:axis] + (2 * codes.shape[axis],) + codes.shape[axis + 1 :])


def _safe(absmax):
  return jnp.where(absmax == 0, 1.0, absmax)


def quantize(w, qtype: str, scale_shape: tuple):
  """(codes, scale) of a float kernel w; scale_shape from scale_layout (the reduced dims are read from it)."""
  w = w.astype(jnp.float32)
  if qtype == "nf4":
    blocks, block_dim = _blocked(w, scale_shape)
    absmax = _safe(jnp.max(jnp.abs(blocks), axis=block_dim, keepdims=True))
    normed = blocks / absmax
    midpoints = jnp.asarray((NF4[1:] + NF4[:-1]) / 2)
    index = jnp.sum(normed[..., None] > midpoints, axis=-1)  # the nearest code (XLA fuses the 15 compares)
    codes = _pack(index.reshape(w.shape).astype(code_dtype("nf4")), block_dim - 1)
    return codes, absmax.reshape(scale_shape)
  reduced = tuple(i for i, (n, m) in enumerate(zip(w.shape, scale_shape)) if m == 1 and n != 1)
  absmax = jnp.max(jnp.abs(w), axis=reduced, keepdims=True)
  if qtype == "int8":
    scale = _safe(absmax) / _INT8_MAX
    return jnp.clip(jnp.round(w / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8), scale
  scale = _safe(absmax) / _FP8_MAX
  return (w / scale).astype(jnp.float8_e4m3fn), scale


def dequantize(codes, scale, qtype: str, dtype):
  """The kernel in `dtype` from quantize()'s codes and scale."""
  if qtype == "nf4":
    index = _unpack(codes, _packed_axis(codes.shape, scale.shape))
    values = jnp.take(jnp.asarray(NF4, dtype), index.astype(jnp.int32))
    blocks, block_dim = _blocked(values, scale.shape)
    return (blocks * jnp.expand_dims(scale.astype(dtype), block_dim)).reshape(index.shape)
  return codes.astype(dtype) * scale.astype(dtype)


def declare(module, qtype: str, init, shape: tuple, in_axes: tuple, axis_names: tuple, weight_dtype, dtype):
  """The DenseGeneral `module`'s kernel, declared quantized (params `kernel`: codes, `kernel_scale`), dequantized
  to `dtype` under stop_gradient. A fresh init quantizes a random kernel; a run's base comes from
  load_parameters_path instead (starting_state quantizes it as it loads)."""
  where = f"the kernel of {'/'.join(module.path)}"
  scale_shape, scale_names = scale_layout(qtype, shape, in_axes, axis_names, where)
  key = module.make_rng("params") if module.is_initializing() else None  # one draw for the codes and their scale
  # Flax also calls an init under eval_shape in apply (its shape check), with its own key: then `key` is None.
  quantized = lambda part: (
    lambda rng, *_: quantize(init(rng if key is None else key, shape, weight_dtype), qtype, scale_shape)[part]
  )
  codes_shape = code_shape(qtype, shape, in_axes)  # nf4: the block axis halved, under the same logical name
  codes = module.param("kernel", nn.with_logical_partitioning(quantized(0), axis_names), codes_shape, code_dtype(qtype))
  scale = module.param("kernel_scale", nn.with_logical_partitioning(quantized(1), scale_names), scale_shape, jnp.float32)
  return jax.lax.stop_gradient(dequantize(codes, scale, qtype, dtype))


def qtype_of(codes) -> str:
  return next(q for q, d in _CODE_DTYPES.items() if codes.dtype == d)


def float_layout(abstract_params, weight_dtype):
  """The float params that a QLoRA model's (abstract) params quantize: each kernel in weight_dtype, with the codes'
  sharding, and no kernel_scale (the layout of load_parameters_path's checkpoint)."""
  out = {}
  for key, value in abstract_params.items():
    if isinstance(value, dict):
      out[key] = float_layout(value, weight_dtype)
    elif key == "kernel" and is_code(value):
      shape = float_shape(value.shape, abstract_params["kernel_scale"].shape, qtype_of(value))
      out[key] = jax.ShapeDtypeStruct(shape, weight_dtype, sharding=getattr(value, "sharding", None))
    elif key != "kernel_scale":
      out[key] = value
  return out


def quantize_params(float_params, abstract_params):
  """float_params (float_layout's) with each kernel that abstract_params holds as codes quantized like it."""
  out = {}
  for key, value in abstract_params.items():
    if isinstance(value, dict):
      out[key] = quantize_params(float_params[key], value)
    elif key == "kernel" and is_code(value):
      out["kernel"], out["kernel_scale"] = quantize(
        float_params[key], qtype_of(value), abstract_params["kernel_scale"].shape
      )
    elif key != "kernel_scale":
      out[key] = float_params[key]
  return out
