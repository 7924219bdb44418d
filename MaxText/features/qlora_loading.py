"""QLoRA's frozen base from load_parameters_path's float checkpoint, quantized on the devices as it is read.

Each float kernel that the run holds quantized (layers/qlora.py) is read alone and quantized at once, its float
copy donated, so the float base is never held whole: the peak is the codes, the other params and one float kernel
(the largest stack, e.g. a scanned MLP kernel of every layer), against the whole float base when it was read in one
go. A checkpoint in the other layer layout (scanned vs per-layer) is read whole first, then quantized: its kernels
are restacked together.
"""

import jax

from MaxText import max_logging
from MaxText.checkpoints import checkpointing, params_layout
from MaxText.layers import layer_names, qlora
from MaxText.layers import lora as adapters_layer


def load(path: str, tree: dict, float_params, held, scan_axis: int):
  """The params of float_params' keys (qlora.float_layout of the run's, maybe without adapters), each kernel that
  `held` (the run's abstract params) holds as codes quantized like it.

  Args:
    path: the checkpoint's items directory; tree: its metadata tree (checkpointing.tree_metadata).
  """
  if params_layout.is_scanned(tree["params"]) != params_layout.is_scanned(float_params):
    loaded = checkpointing.load_params(path, float_params, scan_axis)
    return quantize_all(loaded, held)
  checkpointing.check_checkpoint_fits(tree["params"], float_params, path)
  kernels = {keys for keys, leaf in layer_names.flatten(held) if keys[-1] == "kernel" and qlora.is_code(leaf)}
  others, floats = layer_names.partition(float_params, lambda keys, _: keys in kernels)
  params = checkpointing.restore_params(path, others)
  for keys, _ in layer_names.flatten(floats):
    kernel = layer_names.at(checkpointing.restore_params(path, _only(floats, keys)), keys)
    for name, value in _quantize(kernel, layer_names.at(held, keys[:-1])).items():
      layer_names.set_at(params, (*keys[:-1], name), value)
  max_logging.log(f"Loaded parameters from {path}, quantizing its {len(kernels)} dense kernels one at a time")
  return params


def quantize_all(float_params, held):
  """float_params with every kernel quantized at once (the float params are donated)."""
  if not adapters_layer.split(float_params)[1]:
    held = adapters_layer.split(held)[0]  # without the adapters that the checkpoint lacks
  shardings = jax.tree.map(lambda a: a.sharding, held)
  return jax.jit(lambda p: qlora.quantize_params(p, held), out_shardings=shardings, donate_argnums=0)(float_params)


def _quantize(kernel, held_layer) -> dict:
  """{"kernel": codes, "kernel_scale": scale} of one float kernel, sharded as the run holds them (kernel donated)."""
  codes, scale = held_layer["kernel"], held_layer["kernel_scale"]
  quantize = jax.jit(
    lambda w: qlora.quantize(w, qlora.qtype_of(codes), scale.shape),
    out_shardings=(codes.sharding, scale.sharding),
    donate_argnums=0,
  )
  return dict(zip(("kernel", "kernel_scale"), quantize(kernel)))


def _only(tree: dict, keys: tuple) -> dict:
  """The nested dict holding only the leaf at `keys`."""
  one = {}
  layer_names.set_at(one, keys, layer_names.at(tree, keys))
  return one
