"""quantization=int8 | int8w | int4w | intmp | fp8: the GEMMs of the dense layers in low precision, chosen per layer
and per GEMM.

- int8: the forward GEMM (fprop) and both backward GEMMs (dgrad: the input's gradient, wgrad: the kernel's) take
  int8 operands with per-channel absmax scales, through qwix's quantized-training dot_general.
  quantization_local_shard_count (upstream's AQT key; -1: num_slices) splits wgrad's batch axis into that many
  parts, each with its own scales, so that no scale spans data held by different slices; 0 keeps wgrad in high
  precision.
- int8w, int4w: the kernel only, in fprop, as 8 or 4-bit integers (the backward GEMMs stay in high precision).
  intmp: the same, with each layer's bits, clipping and tiling from quant_cfg_path (quant_rules.py).
- fp8: E4M3 activations and kernels, E5M2 gradients (the hybrid recipe of TransformerEngine and upstream
  MaxText), one scale per tensor. fp8_scaling=delayed (the default) takes the scale from the largest amax of the
  last fp8_amax_history_length steps; fp8_scaling=current from the tensor's own amax. Each fp8 dense layer keeps
  its scales and amax histories in the `fp8_meta` collection, which the train state holds next to the params
  (train_state.Fp8TrainState): the step differentiates the loss with respect to them too, and the custom VJP below
  returns their updated values as that "gradient" (as flax's fp8_ops do), so no optimizer, clipping or weight
  decay touches them. Without that collection (eval, decode) every tensor is scaled by its own amax.

Per layer and per GEMM, the numerics debug YAML (numerics_debug_config) overrides the default (every GEMM of
every layer in low precision): disable_fp8_layer and disable_fp8_gemm keep GEMMs in high precision (exactly
lax.dot_general), per_tensor_scaling switches them to current scaling with scale = amax * 2**margin / max. The
same selectors apply to int8, whose scales are always current. Only the dense layers inside the decoder layers
are quantized: not the logits, the MoE router or the experts.

Scanned layers run one traced body for every layer, so where a module's layers differ, the decoder feeds each
layer the index of its recipe (the `quantization` collection, stacked by nn.scan; see layer_tables) and the
module picks the GEMM with lax.switch.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax import lax

from MaxText.configuration import common_types
from MaxText.errors import UserError
from MaxText.layers import layer_names, microbatch_combine, quant_rules

FP8_COLLECTION = "fp8_meta"
TABLE_COLLECTION = "quantization"

# The fp8 state's "gradient" is its new value (_fp8_dot's VJP): over microbatches, the largest amax seen (the
# whole batch's), as gradient accumulation combines it (features/quantization.py).
microbatch_combine.register(FP8_COLLECTION, microbatch_combine.folded(lambda a, b: jax.tree.map(jnp.maximum, a, b)))
GEMMS = common_types.GEMMS  # fprop, dgrad, wgrad
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# One fp8 dense layer's state, per operand: the delayed scale and the amax of the last steps.
FP8_FORMATS = {"input": E4M3, "kernel": E4M3, "output_grad": E5M2}
FP8_TENSORS = tuple(FP8_FORMATS)


@dataclasses.dataclass(frozen=True, order=True)
class Recipe:
  """How one dense layer's three GEMMs (GEMMS order) run."""

  low: tuple[bool, bool, bool] = (False, False, False)  # in low precision
  current: tuple[bool, bool, bool] = (False, False, False)  # fp8: current (not delayed) scaling of the operands
  margin: tuple[int, int, int] = (0, 0, 0)  # fp8 current scaling: amax * 2**margin
  weight: quant_rules.WeightQuant = quant_rules.WeightQuant()  # the kernel's bits, clipping and tiling (int*)

  @property
  def high(self) -> bool:
    return not any(self.low)


HIGH = Recipe()
WEIGHT_ONLY = ("int8w", "int4w", "intmp")  # the kernel alone, in fprop


def describe(mode: str, recipe: Recipe) -> str:
  """e.g. "fp8: fprop dgrad, wgrad high; current scaling (margin 1): fprop" (list_layers.py)."""
  if recipe.high:
    return "high precision"
  low = [g for g, on in zip(GEMMS, recipe.low) if on]
  high = [g for g, on in zip(GEMMS, recipe.low) if not on]
  text = f"{mode}: {' '.join(low)}" + (f", {' '.join(high)} high" if high and mode not in WEIGHT_ONLY else "")
  current = [
    f"{g}" + (f" (margin {m})" if m else "")
    for g, on, c, m in zip(GEMMS, recipe.low, recipe.current, recipe.margin)
    if on and c
  ]
  text += f"; current scaling: {' '.join(current)}" if current else ""
  return text + (f" ({recipe.weight.describe()})" if mode in ("int4w", "intmp") else "")


@dataclasses.dataclass(frozen=True)
class Quantization:
  """The config's quantization, which every dense layer of the decoder layers reads (linears.Gemm.quant).

  Attributes:
    numerics: the run's parsed numerics debug YAML (config.numerics_debug), whose gemm_precision(name, gemm)
      chooses each GEMM's recipe.
    stacks: the decoder's stacks of blocks, ((name, first block in the model, blocks), ...) in order (DeepSeek has
      two); scanned: whether they are scanned (decoder/<name>) or unrolled (decoder/<name>_<i>).
    weight_rules: intmp's per-layer kernel settings (quant_cfg_path); None for the other modes.
    wgrad_shards: int8's wgrad: the batch axis in that many parts with their own scales; 0: wgrad high precision.
  """

  mode: str
  fp8_current_scaling: bool
  amax_history_length: int
  numerics: object
  stacks: tuple[tuple[str, int, int], ...]
  scanned: bool
  weight_rules: quant_rules.QuantRules | None = None
  wgrad_shards: int = 1

  @property
  def fp8(self) -> bool:
    return self.mode == "fp8"

  def recipe(self, name: str) -> Recipe:
    """The recipe of the dense layer `name` (as list_layers.py prints it)."""
    if layer_names.layer_number(name) is None or layer_names.layer_type(name) is None:
      return HIGH  # outside the decoder layers, or the MoE router: modules built without `quant`
    low, current, margin = [], [], []
    quantized = {"fprop": True, "dgrad": self.mode in ("int8", "fp8"), "wgrad": self.mode == "fp8" or self._wgrad}
    for gemm in GEMMS:
      precision = self.numerics.gemm_precision(name, gemm)
      low.append(precision.low_precision and quantized[gemm])
      use_current = self.fp8 and (self.fp8_current_scaling or precision.per_tensor_scaling)
      current.append(use_current)
      margin.append(precision.margin if self.fp8 and precision.per_tensor_scaling else 0)
    return Recipe(tuple(low), tuple(current), tuple(margin), self._weight(name))

  @property
  def _wgrad(self) -> bool:
    return self.mode == "int8" and self.wgrad_shards > 0

  def _weight(self, name: str) -> quant_rules.WeightQuant:
    if self.mode == "intmp":
      return self.weight_rules.find(self.module_path(name))
    return quant_rules.WeightQuant(bits=4 if self.mode == "int4w" else 8)

  def module_path(self, name: str) -> str:
    """The flax module path (slash-separated, as upstream's quant_cfg_path patterns match it) of the dense layer
    `name`: decoder.layers.3.mlp.wo is decoder/layers/mlp/wo when scanned, decoder/layers_3/mlp/wo when not."""
    parts = name.split(".")
    if parts[1:2] == ["layers"] and len(parts) > 2 and parts[2].isdigit():
      block = int(parts[2])
      stack, first = next(((n, f) for n, f, blocks in self.stacks if f <= block < f + blocks), ("layers", 0))
      parts = [parts[0], stack if self.scanned else f"{stack}_{block - first}", *parts[3:]]
    return "/".join(parts)

  @property
  def _offsets(self) -> dict[str, int]:
    return {name: first for name, first, _ in self.stacks}

  def _scanned_blocks(self, module_path: tuple[str, ...]) -> int:
    """The blocks of the scanned stack that module_path is in (decoder/<stack>/...); 0 outside one."""
    if not self.scanned or module_path[:1] != ("decoder",):
      return 0
    return next((blocks for name, _, blocks in self.stacks if module_path[1:2] == (name,)), 0)

  def layer_recipes(self, module_path: tuple[str, ...]) -> tuple[list[Recipe], list[int]]:
    """(the distinct recipes of a dense module, the index in them of each layer it runs for).

    A module of the scanned stack (decoder/layers/...) runs for every layer; any other module for itself.
    """
    blocks = self._scanned_blocks(module_path)
    if blocks:
      recipes = [self.recipe(layer_names.dotted(module_path, i, self._offsets)) for i in range(blocks)]
    else:
      recipes = [self.recipe(layer_names.dotted(module_path, offsets=self._offsets))]
    distinct = sorted(set(recipes))
    return distinct, [distinct.index(r) for r in recipes]

  def quantizes(self, module_path: tuple[str, ...]) -> bool:
    """Whether a dense module is one of the decoder layers' (quantized unless the YAML says otherwise)."""
    if self._scanned_blocks(module_path):
      return True
    return layer_names.layer_number(layer_names.dotted(module_path, offsets=self._offsets)) is not None


def from_config(config) -> Quantization | None:
  """The config's quantization, or None for quantization=''."""
  if not config.quantization:
    return None
  return Quantization(
    mode=config.quantization,
    fp8_current_scaling=config.fp8_scaling == "current",
    amax_history_length=config.fp8_amax_history_length,
    numerics=config.numerics_debug,
    stacks=tuple(
      (name, first, blocks)
      for (name, blocks), first in zip(
        common_types.layer_stacks(config.decoder_block, config.num_decoder_layers, config.first_num_dense_layers).items(),
        layer_names.stack_offsets(config).values(),
      )
    ),
    scanned=config.scan_layers,
    weight_rules=config.quant_rules,
    wgrad_shards=quant_rules.wgrad_parts(config.quantization_local_shard_count, config.num_slices),
  )


def layer_tables(quant: Quantization | None, stack: str, block_params) -> dict | None:
  """The `quantization` collection of a scanned stack: for each dense module whose layers differ, the index of
  each layer's recipe (int32, stacked on axis 0); None when no module needs one.

  Args:
    quant: the Quantization.
    stack: the stack's name (decoder/<stack>).
    block_params: the scanned stack's params (decoder/<stack>), arrays or shapes.
  """
  if quant is None or not quant.scanned:
    return None
  tables = {}
  for keys, _ in layer_names.flatten(nn.unbox(block_params)):
    if keys[-1] != "kernel":
      continue
    distinct, indices = quant.layer_recipes(("decoder", stack, *keys[:-1]))
    if len(distinct) > 1:
      node = tables
      for key in keys[:-1]:
        node = node.setdefault(key, {})
      node["recipe"] = jnp.asarray(indices, jnp.int32)
  return {TABLE_COLLECTION: tables} if tables else None


# --- the GEMMs ---------------------------------------------------------------------------------------------------


def _qwix_dot_general_qt():
  """qwix's quantized-training dot_general (per-GEMM types), imported only for int8: the other paths run without
  qwix installed (hosts that carry their packages: docs/setup.md)."""
  from qwix._src.core import dot_general_qt  # pylint: disable=import-outside-toplevel

  return dot_general_qt


_INTEGER_TYPES = {8: jnp.int8, 4: jnp.int4}


def _integer_config(quant: Quantization, recipe: Recipe):
  fprop, dgrad, wgrad = recipe.low
  int8, weight = jnp.int8, recipe.weight
  return _qwix_dot_general_qt().DotGeneralQtConfig(
    lhs_qtype=int8 if fprop and quant.mode == "int8" else None,
    rhs_qtype=_INTEGER_TYPES.get(weight.bits, f"int{weight.bits}") if fprop else None,  # qwix names int2..int7
    rhs_calibration_method="absmax" if weight.scale == 1 else f"absmax,{weight.scale}",
    tile_size=weight.tile_size if weight.tile_size > 0 else None,
    # A clipped kernel (scale < 1) still gets its full gradient: the backward GEMMs see the unquantized operands.
    disable_gradient_clipping=True,
    dlhs_grad_qtype=int8 if dgrad else None,
    drhs_grad_qtype=int8 if wgrad else None,
    # wgrad contracts the batch (axis 0 of both its operands): a scale per part of it
    drhs_tile_size={0: 1 / quant.wgrad_shards} if wgrad and quant.wgrad_shards > 1 else None,
    # A backward GEMM in high precision must see the operands as they were, not their int8 copies; a quantized
    # one then quantizes its own (the kernel for dgrad, the input for wgrad).
    use_original_residuals=not (fprop == dgrad == wgrad),
    dlhs_residual_qtype=int8 if dgrad else None,
    drhs_residual_qtype=int8 if wgrad else None,
  )


def _fp8_scale(x, old_scale, history, fp8_dtype, current: bool, margin: int):
  """The dequantization scale of x (x / scale is cast to fp8): from x's amax (current) or the history (delayed)."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32) if current else jnp.max(history)
  return fp8_ops.compute_scale(amax, old_scale, fp8_ops.get_fp8_max(fp8_dtype, jnp.float32), margin)


def _qdq(x, fp8_dtype, scale):
  return fp8_ops.qdq(x, fp8_dtype, scale, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_dot(x, kernel, meta, dims, recipe):
  return _fp8_dot_fwd(x, kernel, meta, dims, recipe)[0]


def _fp8_dot_fwd(x, kernel, meta, dims, recipe):
  delayed = {t: _fp8_scale(None, meta[f"{t}_scale"], meta[f"{t}_amax_history"], f, False, 0) for t, f in FP8_FORMATS.items()}
  if recipe.low[0]:
    sx = _fp8_scale(x, meta["input_scale"], meta["input_amax_history"], E4M3, recipe.current[0], recipe.margin[0])
    sw = _fp8_scale(kernel, meta["kernel_scale"], meta["kernel_amax_history"], E4M3, recipe.current[0], recipe.margin[0])
    out = lax.dot_general(_qdq(x, E4M3, sx), _qdq(kernel, E4M3, sw), dims)
  else:
    out = lax.dot_general(x, kernel, dims)
  new_meta = {
    "input_scale": delayed["input"],
    "input_amax_history": fp8_ops.compute_amax_history(x, meta["input_amax_history"]),
    "kernel_scale": delayed["kernel"],
    "kernel_amax_history": fp8_ops.compute_amax_history(kernel, meta["kernel_amax_history"]),
    "output_grad_scale": delayed["output_grad"],
    "output_grad_amax_history": meta["output_grad_amax_history"],
  }
  return out, (x, kernel, meta, new_meta)


def _fp8_dot_bwd(dims, recipe, residuals, g):
  x, kernel, meta, new_meta = residuals
  new_meta = dict(new_meta, output_grad_amax_history=fp8_ops.compute_amax_history(g, meta["output_grad_amax_history"]))

  def operands(gemm: int):
    """The (x, kernel, g) that GEMM `gemm` takes: fp8 copies when it runs in low precision."""
    if not recipe.low[gemm]:
      return x, kernel, g
    current, margin = recipe.current[gemm], recipe.margin[gemm]
    sx = _fp8_scale(x, meta["input_scale"], meta["input_amax_history"], E4M3, current, margin)
    sw = _fp8_scale(kernel, meta["kernel_scale"], meta["kernel_amax_history"], E4M3, current, margin)
    sg = _fp8_scale(g, meta["output_grad_scale"], meta["output_grad_amax_history"], E5M2, current, margin)
    return _qdq(x, E4M3, sx), _qdq(kernel, E4M3, sw), _qdq(g, E5M2, sg)

  _, kernel_d, g_d = operands(1)
  dx = jax.vjp(lambda x_: lax.dot_general(x_, kernel_d, dims), x)[1](g_d)[0]
  x_w, _, g_w = operands(2)
  dkernel = jax.vjp(lambda k_: lax.dot_general(x_w, k_, dims), kernel)[1](g_w)[0]
  # The "gradient" of the state is its new value (train_step stores it instead of applying it).
  return dx, dkernel, jax.tree.map(lambda new, old: new.astype(old.dtype), new_meta, meta)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def _gemm(quant: Quantization, recipe: Recipe, meta, x, kernel, dims):
  """One dense layer's GEMM under `recipe`; the result has lax.dot_general's dtype."""
  if quant.fp8:  # a layer in high precision too: its fp8 state follows its tensors
    return _fp8_dot(x, kernel, meta, dims, recipe)
  if recipe.high:
    return lax.dot_general(x, kernel, dims)
  out = _qwix_dot_general_qt().dot_general_qt(x, kernel, dims, _integer_config(quant, recipe))
  return out.astype(jnp.result_type(x, kernel))


def _fp8_meta(module, quant: Quantization):
  """The module's fp8 state (created at init: scales 1, histories 0), or None where none is given (eval, decode)."""
  if module.is_initializing():
    for t in FP8_TENSORS:
      module.variable(FP8_COLLECTION, f"{t}_scale", jnp.ones, (), jnp.float32)
      module.variable(FP8_COLLECTION, f"{t}_amax_history", jnp.zeros, (quant.amax_history_length,), jnp.float32)
  if not module.has_variable(FP8_COLLECTION, "input_scale"):
    return None
  return {
    f"{t}_{v}": module.get_variable(FP8_COLLECTION, f"{t}_{v}") for t in FP8_TENSORS for v in ("scale", "amax_history")
  }


def _stateless_fp8(recipe: Recipe, length: int):
  """Without fp8 state, every operand is scaled by its own amax: (the recipe so, a placeholder state)."""
  meta = {f"{t}_scale": jnp.ones((), jnp.float32) for t in FP8_TENSORS}
  meta.update({f"{t}_amax_history": jnp.zeros((length,), jnp.float32) for t in FP8_TENSORS})
  return dataclasses.replace(recipe, current=(True, True, True)), meta


def _layer(module, quant: Quantization, path: tuple[str, ...]):
  """(this module's distinct recipes, its fp8 state or None, the index of this layer's recipe or None)."""
  distinct, _ = quant.layer_recipes(path)
  meta = _fp8_meta(module, quant) if quant.fp8 else None
  if quant.fp8 and meta is None:
    pairs = [_stateless_fp8(r, quant.amax_history_length) for r in distinct]
    distinct, meta = [r for r, _ in pairs], pairs[0][1]
  index = None
  if len(distinct) > 1:
    index = module.get_variable(TABLE_COLLECTION, "recipe")
    if index is None and not module.is_initializing():  # init needs the shapes only
      raise ValueError(f"{'/'.join(path)}: its layers are quantized differently but no recipe table was given")
  return distinct, meta, index


def _per_layer(distinct, index, values):
  """values[i] belongs to distinct[i]: this layer's, as an array."""
  return values[0] if index is None else jnp.asarray(values)[index]


def _check_tiles(path: tuple[str, ...], distinct, size: int) -> None:
  """A quant_cfg_path tile_size must divide the kernel's innermost contracting dimension (`size`), which it tiles."""
  for recipe in distinct:
    tile = recipe.weight.tile_size
    if recipe.low[0] and tile > 0 and size % tile:
      raise UserError(
        f"quant_cfg_path: tile_size={tile} for {'/'.join(path)}, whose kernel's innermost contracting "
        f"dimension is {size}: choose a divisor of {size}, or -1 (one scale per channel)"
      )


def dot_general(module, quant: Quantization | None, x, kernel, dims, scope: tuple[str, ...] = ()):
  """The GEMM of the DenseGeneral `module`: quantized as `quant` says for this layer, else lax.dot_general."""
  path = scope + tuple(module.path)
  if quant is None or not quant.quantizes(path):
    return lax.dot_general(x, kernel, dims)
  distinct, meta, index = _layer(module, quant, path)
  _check_tiles(path, distinct, kernel.shape[dims[0][1][-1]])
  branches = [functools.partial(_gemm, quant, recipe, meta, dims=dims) for recipe in distinct]
  if index is None:
    return branches[0](x, kernel)
  return lax.switch(index, branches, x, kernel)


def gradient_fp8_scale(g, scaling):
  """The scale of the gradient g in its dgrad GEMM, from scaling = (delayed scale, current 0/1, margin)."""
  delayed, current, margin = scaling
  fp8_max = fp8_ops.get_fp8_max(E5M2, jnp.float32)
  own = fp8_ops.compute_scale(jnp.max(jnp.abs(g)).astype(jnp.float32), jnp.ones((), jnp.float32), fp8_max, margin)
  return jnp.where(current > 0, own, delayed)


def fp8_tap_scales(module, quant: Quantization | None, x, kernel, scope: tuple[str, ...] = ()):
  """The scales that this layer's fp8 GEMMs divide their operands by, for the FP8 statistics of numerics_taps:
  (fprop's {"activation": scale, "weight": scale}, dgrad's gradient scaling, gradient_fp8_scale); None unless fp8."""
  path = scope + tuple(module.path)
  if quant is None or not quant.fp8 or not quant.quantizes(path):
    return None
  distinct, meta, index = _layer(module, quant, path)

  def scale(tensor, value, gemm, recipe):
    fmt = FP8_FORMATS[tensor]
    current, margin = recipe.current[gemm], recipe.margin[gemm]
    return _fp8_scale(value, meta[f"{tensor}_scale"], meta[f"{tensor}_amax_history"], fmt, current, margin)

  operands = {
    name: _per_layer(distinct, index, [scale(tensor, value, 0, r) for r in distinct])
    for name, tensor, value in (("activation", "input", x), ("weight", "kernel", kernel))
  }
  delayed = _fp8_scale(None, meta["output_grad_scale"], meta["output_grad_amax_history"], E5M2, False, 0)
  current = _per_layer(distinct, index, [float(r.current[1]) for r in distinct])
  margin = _per_layer(distinct, index, [float(r.margin[1]) for r in distinct])
  return operands, (delayed, jnp.asarray(current, jnp.float32), jnp.asarray(margin, jnp.float32)), gradient_fp8_scale
