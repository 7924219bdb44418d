"""Names of the model's dense layers and parameters, as the numerics debug YAML and the diagnostics reports use them.

A name is the parameter path of a module joined by dots, with the layer index written the same way for scanned
and unrolled layers: the scanned params decoder/layers/self_attention/out/kernel (stacked over layers on
param_scan_axis) and the unrolled decoder/layers_4/self_attention/out/kernel both give
`decoder.layers.4.self_attention.out` for layer 4 (whose number, counted from 1 as TransformerEngine's, is 5).
DeepSeek's two stacks count on: with 3 dense layers, decoder/moe_layers' block 0 is decoder.layers.3.
Gemma 2 scans pairs of layers: its names read decoder.layers.<pair>.local... and decoder.layers.<pair>.global....
"""

import dataclasses
import re

from MaxText.configuration import common_types
from MaxText.configuration.common_types import STACK_NAMES

# The dense layers' types that `layer_types` selects, from the module's own name (attention: query, key, value,
# qkv_proj, out; MLP: wi or wi_<i>, wo). Others (the MoE router `gate`, `logits_dense`) have no type.
LAYER_TYPES = ("qkv", "attention_out", "fc1", "fc2")
_TYPE_OF_MODULE = {"query": "qkv", "key": "qkv", "value": "qkv", "qkv_proj": "qkv", "out": "attention_out", "wo": "fc2"}
_FC1 = re.compile(r"wi(_\d+)?")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_UNROLLED = re.compile(r"(\w*layers)_(\d+)")  # layers_4, and DeepSeek's dense_layers_0, moe_layers_2


@dataclasses.dataclass(frozen=True)
class DenseLayer:
  """One dense layer (a DenseGeneral) of one decoder layer.

  Attributes:
    name: e.g. decoder.layers.4.self_attention.out.
    module_path: the flax module path of the DenseGeneral, without the index of scanned layers
      (('decoder', 'layers', 'self_attention', 'out')), as the module sees itself while the model runs.
    index: the position in the scanned stack (the scan iteration), or None for a module outside a scan.
    kernel_shape: the kernel's shape in that layer.
  """

  name: str
  module_path: tuple[str, ...]
  index: int | None
  kernel_shape: tuple[int, ...]

  @property
  def type(self) -> str | None:
    return layer_type(self.name)

  @property
  def number(self) -> int | None:
    return layer_number(self.name)


def layer_type(name: str) -> str | None:
  """qkv, attention_out, fc1, fc2, or None for a dense layer of none of these types."""
  last = name.rsplit(".", 1)[-1]
  return "fc1" if _FC1.fullmatch(last) else _TYPE_OF_MODULE.get(last)


def layer_number(name: str) -> int | None:
  """The decoder layer of a name counted from 1 (decoder.layers.0.* is layer 1); None outside the layers."""
  match = _LAYER_INDEX.search(name)
  return int(match.group(1)) + 1 if match else None


def flatten(tree) -> list[tuple[tuple[str, ...], object]]:
  """(path keys, leaf) of a params (or gradients) tree, in tree order. Imports JAX here: the YAML checks don't."""
  import jax  # pylint: disable=import-outside-toplevel

  return [
    (tuple(str(getattr(p, "key", p)) for p in path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def at(tree: dict, keys: tuple[str, ...]):
  """The value at `keys` of a nested dict."""
  for key in keys:
    tree = tree[key]
  return tree


def set_at(tree: dict, keys: tuple[str, ...], value) -> None:
  """Puts `value` at `keys` of a nested dict, making the dicts on the way that are missing."""
  for key in keys[:-1]:
    tree = tree.setdefault(key, {})
  tree[keys[-1]] = value


def partition(tree: dict, belongs) -> tuple[dict, dict]:
  """(the leaves for which belongs(keys, leaf) is false, those for which it is true), each in the tree's nesting;
  dicts left empty are left out."""

  def part(node, wanted: bool, prefix=()):
    out = {}
    for key, value in node.items():
      keys = prefix + (key,)
      if isinstance(value, dict):
        sub = part(value, wanted, keys)
        if sub:
          out[key] = sub
      elif belongs(keys, value) == wanted:
        out[key] = value
    return out

  return part(tree, False), part(tree, True)


def merge(a: dict, b: dict) -> dict:
  """One tree of two whose leaves are apart (partition's two parts, or params and the leaves they lack)."""
  out = dict(a)
  for key, value in b.items():
    out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
  return out


def scan_axis(keys: tuple[str, ...], leaf, config) -> int | None:
  """The axis that stacks the scanned layers in the param (or gradient) at `keys`; None outside the scan.

  layer_stacking's rule: param_scan_axis, or 0 for a vector (a norm's scale stacks to (layers, dim)).
  """
  if not (config.scan_layers and len(keys) > 1 and keys[0] == "decoder" and keys[1] in STACK_NAMES):
    return None
  return config.param_scan_axis if len(leaf.shape) > 1 else 0


def stack_offsets(config) -> dict[str, int]:
  """Each stack of blocks' first block in the model: DeepSeek's moe_layers come after its dense_layers."""
  offsets, first = {}, 0
  for stack, blocks in common_types.layer_stacks(
    config.decoder_block, config.num_decoder_layers, config.first_num_dense_layers
  ).items():
    offsets[stack], first = first, first + blocks
  return offsets


def dotted(keys: tuple[str, ...], index: int | None = None, offsets: dict[str, int] | None = None) -> str:
  """'decoder.layers.<i>.<rest>' for a scanned path and its index in the stack, or for <stack>_<index>: i counts the
  model's blocks, from the stack's offset (stack_offsets; none: 0)."""
  parts = list(keys)
  if len(parts) > 1:
    unrolled = _UNROLLED.fullmatch(parts[1])
    stack, index = (unrolled.group(1), int(unrolled.group(2))) if unrolled else (parts[1], index)
    if index is not None and stack in STACK_NAMES:
      parts[1] = f"layers.{(offsets or {}).get(stack, 0) + index}"
  return ".".join(parts)


def dense_layers(params, config) -> list[DenseLayer]:
  """Every DenseGeneral of the model (a module holding a `kernel`), with scanned layers expanded by index.

  In layer order (then the param tree's order within a layer); dense layers outside the layers come last.

  Args:
    params: the params tree (arrays or jax.ShapeDtypeStructs).
    config: the Config (scan_layers, param_scan_axis).
  """
  layers, offsets = [], stack_offsets(config)
  for keys, leaf in flatten(params):
    if keys[-1] != "kernel":
      continue
    module = keys[:-1]
    axis = scan_axis(keys, leaf, config)
    if axis is not None:
      shape = tuple(d for i, d in enumerate(leaf.shape) if i != axis)
      layers += [DenseLayer(dotted(module, i, offsets), module, i, shape) for i in range(leaf.shape[axis])]
    else:
      layers.append(DenseLayer(dotted(module, offsets=offsets), module, None, tuple(leaf.shape)))
  return sorted(layers, key=lambda layer: (layer.number is None, layer.number or 0))


def param_names(params, config) -> list[str]:
  """The name of every parameter tensor, in the order of the flattened tree, with scanned params expanded by layer.

  e.g. decoder.layers.3.mlp.wi_0.kernel; nonfinite.locate reports params and gradients by these names.
  """
  names, offsets = [], stack_offsets(config)
  for keys, leaf in flatten(params):
    axis = scan_axis(keys, leaf, config)
    if axis is not None:
      names += [dotted(keys, i, offsets) for i in range(leaf.shape[axis])]
    else:
      names.append(dotted(keys, offsets=offsets))
  return names
