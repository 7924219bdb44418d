"""Quantized serving checkpoints, upstream MaxText's flow for decode.py with quantization=int8:

    decode.py ... quantization=int8 save_quantized_params_path=DIR load_parameters_path=<params>
    decode.py ... quantization=int8 checkpoint_is_quantized=true load_parameters_path=DIR

The kernels of the decoder layers' dense layers (those quantization=int8 quantizes: attention and MLP projections,
not the embedding, the norms, the logits, the MoE router or the experts) are stored as int8 with a float32 scale
per output channel (absmax / 127 over the contracting axes), beside `kernel` as `kernel_scale`; everything else
stays as it was. The files are about a quarter of float32 params. Reading them dequantizes the kernels
(int8 x scale, in weight_dtype) onto the run's shardings: decode.py then runs as with float params.
"""

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec

from MaxText import max_logging
from MaxText.configuration.common_types import STACK_NAMES
from MaxText.errors import UserError
from MaxText.layers import layer_names

SCALE = "kernel_scale"


def _contracting_axes(keys: tuple[str, ...], shape: tuple[int, ...], config) -> tuple[int, ...] | None:
  """The contracting axes of the kernel at `keys` when it is one that int8 quantizes, else None."""
  in_layers = len(keys) > 3 and keys[0] == "decoder" and keys[1].rstrip("_0123456789") in STACK_NAMES
  if keys[-1] != "kernel" or not in_layers or layer_names.layer_type(keys[-2]) is None:
    return None  # outside the decoder layers, or the MoE router
  count = 2 if keys[-2] == "out" else 1  # attention's out kernel contracts (heads, head_dim)
  axes = tuple(range(count))
  stack_axis = layer_names.scan_axis(keys, jax.ShapeDtypeStruct(shape, jnp.float32), config)
  if stack_axis is not None:  # the scanned layers' axis sits among the kernel's
    axes = tuple(a + (a >= stack_axis) for a in axes)
  return axes


def _quantize(kernel, axes):
  scale = jnp.max(jnp.abs(kernel.astype(jnp.float32)), axis=axes, keepdims=True) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)
  values = jnp.clip(jnp.round(kernel.astype(jnp.float32) / scale), -127, 127).astype(jnp.int8)
  return values, scale


def _map_kernels(params, config, fn):
  """params with fn(keys, kernel, axes) -> {name: array} replacing each quantized kernel's {"kernel": ...}."""

  def walk(node, keys):
    if not isinstance(node, dict):
      return node
    out = {}
    for name, child in node.items():
      path = (*keys, name)
      axes = None if isinstance(child, dict) else _contracting_axes(path, tuple(child.shape), config)
      if axes is None:
        out[name] = walk(child, path)
      else:
        out.update(fn(path, child, axes))
    return out

  return walk(params, ())


def save(config, params, path: str) -> None:
  """Writes params with int8 kernels and their scales to `path` (save_quantized_params_path)."""
  target = epath.Path(path)
  if target.exists() and any(target.iterdir()):
    raise UserError(f"save_quantized_params_path={path} exists and is not empty: give a new directory")

  def quantized(keys, kernel, axes):
    del keys
    values, scale = jax.jit(_quantize, static_argnums=1)(kernel, axes)
    return {"kernel": values, SCALE: scale}

  tree = _map_kernels(params, config, quantized)
  ocp.PyTreeCheckpointer().save(target, {"params": tree})
  max_logging.log(f"Saved the int8 params (kernels with their scales) to {path}")


def load(config, abstract_params):
  """The params of a quantized serving checkpoint (load_parameters_path with checkpoint_is_quantized), dequantized
  into abstract_params' dtypes and shardings."""
  path = config.load_parameters_path
  mesh = jax.tree.leaves(abstract_params)[0].sharding.mesh

  def quantized_target(keys, kernel, axes):
    del keys
    scale_shape = tuple(1 if i in axes else n for i, n in enumerate(kernel.shape))
    return {
      "kernel": jax.ShapeDtypeStruct(kernel.shape, jnp.int8, sharding=kernel.sharding),
      SCALE: jax.ShapeDtypeStruct(scale_shape, jnp.float32, sharding=NamedSharding(mesh, PartitionSpec())),
    }

  target = {"params": _map_kernels(abstract_params, config, quantized_target)}
  try:
    restored = ocp.PyTreeCheckpointer().restore(
      path, args=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    )["params"]
  except Exception as e:  # pylint: disable=broad-except  # Orbax raises many kinds for a wrong directory
    message = " ".join(str(e).split())[:300]
    raise UserError(
      f"load_parameters_path={path} is not a quantized serving checkpoint of this model (write one with "
      f"save_quantized_params_path): {type(e).__name__}: {message}"
    ) from None

  def dequantized(module, abstract_module):
    if not isinstance(module, dict):
      return module
    if SCALE in module:
      kernel = abstract_module["kernel"]
      dequantize = jax.jit(lambda q, s: (q.astype(jnp.float32) * s).astype(kernel.dtype), out_shardings=kernel.sharding)
      return {"kernel": dequantize(module["kernel"], module[SCALE])}
    return {name: dequantized(child, abstract_module[name]) for name, child in module.items()}

  max_logging.log(f"Loaded the int8 params of {path} (dequantized to {config.weight_dtype})")
  return dequantized(restored, abstract_params)
