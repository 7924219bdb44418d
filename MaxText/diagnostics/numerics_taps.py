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

COLLECTION = "numerics"
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


def reduce(x, reductions, fp8_dtype, scale=None):
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
  """
  size = jnp.asarray(x.size, jnp.float32)
  x32 = x.astype(jnp.float32)
  one = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
  flush_below = float(jnp.finfo(fp8_dtype).smallest_subnormal) / 2 / one
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
      beyond = float(jnp.finfo(fp8_dtype).max) / one
      out[name] = jnp.sum(jnp.abs(x32) > beyond, dtype=jnp.int32).astype(jnp.float32)
    else:
      raise ValueError(f"unknown reduction {name}")
  return out


def _gated_reduce(gate, x, reductions, fp8_dtype, scale=None):
  """reduce(x, scale) where gate > 0, else zeros; the off branch costs only the predicate."""

  def on(x, scale):
    return reduce(x, reductions, fp8_dtype, scale)

  def off(x, scale):
    del x, scale
    return {name: jnp.zeros((), jnp.float32) for name in reductions}

  return lax.cond(gate > 0, on, off, x, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gradient_tap(y, gate, scale, stats, reductions):
  """The identity on y; its backward pass reduces y's cotangent into the cotangent of `stats` (see the module doc)."""
  del gate, scale, stats, reductions
  return y


def _gradient_tap_fwd(y, gate, scale, stats, reductions):
  del reductions
  return y, (gate, scale, stats)


def _gradient_tap_bwd(reductions, residuals, g):
  gate, scale, stats = residuals
  reduced = _gated_reduce(gate, g, reductions, FP8_FORMAT["gradient"], scale)
  return g, jnp.zeros_like(gate), jnp.zeros_like(scale), {name: reduced[name].astype(stats[name].dtype) for name in stats}


_gradient_tap.defvjp(_gradient_tap_fwd, _gradient_tap_bwd)


def dot_general(module, inputs, kernel, dimension_numbers):
  """lax.dot_general of a dense layer's input and kernel (as the GEMM takes them), with this layer's taps.

  Args:
    module: the calling DenseGeneral (its `numerics` variables say what to collect).
    inputs, kernel: the GEMM's operands, already in the compute dtype.
    dimension_numbers: as lax.dot_general's.
  """
  taps = {t: module.get_variable(COLLECTION, t) for t in ("activation", "weight", "gradient")}
  taps = {t: tap for t, tap in taps.items() if tap is not None}
  if not taps:
    return lax.dot_general(inputs, kernel, dimension_numbers)
  for tensor, x in (("activation", inputs), ("weight", kernel)):
    if tensor in taps:
      reduced = _gated_reduce(taps[tensor]["gate"], lax.stop_gradient(x), tuple(taps[tensor]["stats"]), FP8_FORMAT[tensor])
      module.sow("intermediates", SOWN[tensor], reduced)
  out = lax.dot_general(inputs, kernel, dimension_numbers)
  if "gradient" in taps:
    tap = taps["gradient"]
    out = _gradient_tap(out, tap["gate"], tap["scale"], tap["stats"], tuple(tap["stats"]))
  return out
