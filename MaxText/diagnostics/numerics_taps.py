"""Statistics of a dense layer's GEMM operands, computed inside the jitted step: the tap in DenseGeneral's dot_general.

A dense layer is tapped when the model is applied with a `numerics` collection holding entries for it (see
numerics_stats.Plan.step_inputs); without one (the default, eval, decode) `dot_general` is lax.dot_general and nothing
else, so the compiled step is the same as without this module. For each tapped tensor the entry holds

    {"gate": f32 scalar (1: collect at this step and layer), "stats": {reduction: f32 placeholder, ...}}

whose `stats` keys say which reductions to compute (the values are unused), plus, for the gradient, a `scale`
(1 / the batch's real target tokens). Scanned layers get the entries stacked on axis 0, so that each scan
iteration reads its own layer's gate: layer selection costs no host round-trip, and an unselected layer or an
off-frequency step runs only a lax.cond predicate.

- activation (the GEMM's input, as it takes it: in `dtype`) and weight (the kernel in `dtype`): the reductions
  are sown into `intermediates` as numerics_activation / numerics_weight.
- gradient: the gradient of the training loss (learning/loss, the mean over the batch's real target tokens) with
  respect to the GEMM's output, the tensor that the dgrad and wgrad GEMMs take, as TransformerEngine's `gradient`.
  It only exists in the backward pass, so it leaves through a custom_vjp identity on the output: its backward
  rule reduces the cotangent and returns the reductions as the cotangent of the `stats` placeholders. The step
  differentiates the loss with respect to the whole `numerics` collection too, so the "gradient" of each
  placeholder is the statistic. Nothing else in the backward pass changes: the output's cotangent passes through.

Reductions are raw sums, extremes and counts (`count`, `sum`, `m2`, `min`, ...) that microbatches combine exactly
(numerics_stats.combine); numerics_stats.finalize turns them into the YAML's statistics.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from MaxText.layers import linears, microbatch_combine

COLLECTION = linears.TAP_COLLECTION
SOWN = {"activation": "numerics_activation", "weight": "numerics_weight"}  # names in `intermediates`
# The FP8 format each tensor is cast to in FP8 training (TE's and upstream MaxText's hybrid recipe).
FP8_FORMAT = {"activation": jnp.float8_e4m3fn, "weight": jnp.float8_e4m3fn, "gradient": jnp.float8_e5m2}

# The raw reductions each statistic needs.
REDUCTIONS = {
  "min": ("min",),
  "max": ("max",),
  "mean": ("count", "sum"),
  "std": ("count", "sum", "m2"),
  "l1_norm": ("abs_sum",),
  "l2_norm": ("sumsq",),
  "cur_amax": ("amax",),
  "dynamic_range": ("amax", "amin_nonzero"),
  "underflows": ("count", "underflows"),
  "overflows": ("count", "overflows"),
}


MIN_REDUCTIONS, MAX_REDUCTIONS = ("min", "amin_nonzero"), ("max", "amax")


def _safe_divide(x, n):
  return x / jnp.maximum(n, 1.0)


def combine_reductions(a: dict, b: dict) -> dict:
  """The raw reductions of two parts of a tensor (two microbatches') as the whole tensor's (Chan et al.'s update for
  m2)."""
  out = {}
  for name, value in a.items():
    if name in MIN_REDUCTIONS:
      out[name] = jnp.minimum(value, b[name])
    elif name in MAX_REDUCTIONS:
      out[name] = jnp.maximum(value, b[name])
    elif name == "m2":
      n_a, n_b = a["count"], b["count"]
      delta = _safe_divide(b["sum"], n_b) - _safe_divide(a["sum"], n_a)
      out[name] = value + b[name] + jnp.square(delta) * _safe_divide(n_a * n_b, n_a + n_b)
    else:
      out[name] = value + b[name]
  return out


def reduce(x, reductions, fp8_dtype, scale=None, fp8_scale=None):
  """The raw reductions of x * scale (any shape), each a float32 scalar, without forming x * scale.

  Args:
    x: the tensor.
    reductions: names from REDUCTIONS' values.
    fp8_dtype: the FP8 format of `underflows` (nonzero elements that the cast flushes to 0) and `overflows`
      (elements beyond the format's largest finite value), counted without a cast (a cast to FP8 is emulated, and
      slow, on hosts without FP8 units): a value rounds to 0 when at most half the smallest subnormal (a tie
      rounds to the even 0).
    scale: a positive factor (traced), or None for 1: the reductions are scaled instead of the tensor, which
      would otherwise be materialized in float32 beside it.
    fp8_scale: where a quantized GEMM casts x / fp8_scale to fp8 (quantization=fp8), that scale: underflows and
      overflows are then those of its real cast (of x, not x * scale).
  """
  size = jnp.asarray(x.size, jnp.float32)
  x32 = x.astype(jnp.float32)
  one = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
  cast_unit = 1 / one if fp8_scale is None else jnp.asarray(fp8_scale, jnp.float32)  # |x| per unit of the fp8 value
  flush_below = float(jnp.finfo(fp8_dtype).smallest_subnormal) / 2 * cast_unit
  out = {}
  for name in reductions:
    if name == "count":
      out[name] = size
    elif name == "sum":
      out[name] = jnp.sum(x32) * one
    elif name == "m2":  # two-pass: the squared deviations from this tensor's mean
      out[name] = jnp.sum(jnp.square(x32 - jnp.sum(x32) / size)) * jnp.square(one)
    elif name in ("min", "max"):  # scale > 0 keeps the order
      out[name] = (jnp.min(x) if name == "min" else jnp.max(x)).astype(jnp.float32) * one
    elif name == "abs_sum":
      out[name] = jnp.sum(jnp.abs(x32)) * one
    elif name == "sumsq":
      out[name] = jnp.sum(jnp.square(x32)) * jnp.square(one)
    elif name == "amax":
      out[name] = jnp.max(jnp.abs(x)).astype(jnp.float32) * one
    elif name == "amin_nonzero":
      out[name] = jnp.min(jnp.where(x != 0, jnp.abs(x32), jnp.inf)) * one
    elif name == "underflows":
      out[name] = jnp.sum((x != 0) & (jnp.abs(x32) <= flush_below), dtype=jnp.int32).astype(jnp.float32)
    elif name == "overflows":
      beyond = float(jnp.finfo(fp8_dtype).max) * cast_unit
      out[name] = jnp.sum(jnp.abs(x32) > beyond, dtype=jnp.int32).astype(jnp.float32)
    else:
      raise ValueError(f"unknown reduction {name}")
  return out


def _gated_reduce(gate, x, reductions, fp8_dtype, scale=None, fp8_scale=None):
  """reduce(x, scale, fp8_scale) where gate > 0, else zeros; the off branch costs only the predicate."""

  def on(x, scale, fp8_scale):
    return reduce(x, reductions, fp8_dtype, scale, fp8_scale)

  def off(x, scale, fp8_scale):
    del x, scale, fp8_scale
    return {name: jnp.zeros((), jnp.float32) for name in reductions}

  return lax.cond(gate > 0, on, off, x, scale, fp8_scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gradient_tap(y, gate, scale, stats, fp8_scaling, reductions, fp8_scale_of):
  """The identity on y; its backward pass reduces y's cotangent into the cotangent of `stats` (see the module doc).

  fp8_scale_of(g, fp8_scaling) is the scale that a quantized GEMM divides the gradient g by, or None.
  """
  del gate, scale, stats, fp8_scaling, reductions, fp8_scale_of
  return y


def _gradient_tap_fwd(y, gate, scale, stats, fp8_scaling, reductions, fp8_scale_of):
  del reductions, fp8_scale_of
  return y, (gate, scale, stats, fp8_scaling)


def _gradient_tap_bwd(reductions, fp8_scale_of, residuals, g):
  gate, scale, stats, fp8_scaling = residuals
  fp8_scale = None if fp8_scale_of is None else fp8_scale_of(g, fp8_scaling)
  reduced = _gated_reduce(gate, g, reductions, FP8_FORMAT["gradient"], scale, fp8_scale)
  zeros = jax.tree.map(jnp.zeros_like, (gate, scale, fp8_scaling))
  return g, zeros[0], zeros[1], {name: reduced[name].astype(stats[name].dtype) for name in stats}, zeros[2]


_gradient_tap.defvjp(_gradient_tap_fwd, _gradient_tap_bwd)


def dot_general(module, inputs, kernel, dimension_numbers, gemm=lax.dot_general, fp8_scales=None):
  """gemm (lax.dot_general, or a quantized one) of a dense layer's input and kernel, with this layer's taps.

  Args:
    module: the calling DenseGeneral (its `numerics` variables say what to collect).
    inputs, kernel: the GEMM's operands, already in the compute dtype.
    dimension_numbers: as lax.dot_general's.
    gemm: called as lax.dot_general; the taps see its operands and its output's gradient.
    fp8_scales: for a GEMM quantized to fp8, a function called only when a tensor is tapped, returning
      ({"activation": scale, "weight": scale}, gradient scaling (arrays), fn(g, gradient scaling) -> g's scale),
      the scales that the GEMM divides its operands by (quantizations.fp8_tap_scales); None otherwise.
  """
  taps = {t: module.get_variable(COLLECTION, t) for t in ("activation", "weight", "gradient")}
  taps = {t: tap for t, tap in taps.items() if tap is not None}
  if not taps:
    return gemm(inputs, kernel, dimension_numbers)
  operand_scales, gradient_scaling, gradient_scale_of = (fp8_scales and fp8_scales()) or ({}, None, None)
  for tensor, x in (("activation", inputs), ("weight", kernel)):
    if tensor in taps:
      x, fp8_scale = lax.stop_gradient(x), operand_scales.get(tensor)
      reduced = _gated_reduce(taps[tensor]["gate"], x, tuple(taps[tensor]["stats"]), FP8_FORMAT[tensor], None, fp8_scale)
      module.sow("intermediates", SOWN[tensor], reduced)
  out = gemm(inputs, kernel, dimension_numbers)
  if "gradient" in taps:
    tap = taps["gradient"]
    stats = (tap["gate"], tap["scale"], tap["stats"])
    out = _gradient_tap(out, *stats, gradient_scaling, tuple(tap["stats"]), gradient_scale_of)
  return out


def _combine_taps(a: dict, b: dict) -> dict:
  """Two microbatches' gradients of the taps' collection: each tensor's `stats` are its gradient's reductions (zero
  for the activation and weight, which are sown); the gates and scales are not differentiated."""
  if "stats" in a:
    return {**a, "stats": combine_reductions(a["stats"], b["stats"])}
  return {key: _combine_taps(a[key], b[key]) for key in a}


def _combine_sown(a: tuple, b: tuple) -> tuple:
  return tuple(combine_reductions(x, y) for x, y in zip(a, b))


# A pipelined layer runs once per microbatch (layers/microbatch_combine.py): its activations' reductions and its
# gradient taps combine as gradient accumulation combines them; its weight's are the same in every microbatch.
microbatch_combine.register(COLLECTION, microbatch_combine.folded(_combine_taps))
microbatch_combine.register(SOWN["activation"], microbatch_combine.folded(_combine_sown))
microbatch_combine.register(SOWN["weight"], lambda stacked: jax.tree.map(lambda x: x[-1], stacked))
