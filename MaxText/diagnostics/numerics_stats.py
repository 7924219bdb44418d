"""Numerics statistics of the selected layers in the train step: what each step collects, and what it returns.

The Plan maps numerics_debug_config onto the model's dense layers (layer_names.dense_layers). In the step it
builds the `numerics` collection that turns the taps on (numerics_taps: a gate per layer and tensor from the
step number and each feature's freq/start_step/end_step, stacked over scanned layers), collects the raw
reductions from the sown intermediates and the gradient of the collection, combines microbatches and returns
the statistics under metrics["numerics"]: {module path: {tensor: {stat: (layers,) or scalar}}}. On the host,
`rows` turns them into (step, layer, tensor, stat, value) for the steps and layers each feature asked for.
"""

import dataclasses

import jax.numpy as jnp

from MaxText.diagnostics import numerics_config, numerics_taps
from MaxText.layers import layer_names

METRICS_KEY = "numerics"
_MIN, _MAX = numerics_taps.MIN_REDUCTIONS, numerics_taps.MAX_REDUCTIONS
_ORDER = {name: i for i, name in enumerate((*numerics_config.STATS, *numerics_config.FP8_STATS))}


@dataclasses.dataclass(frozen=True)
class Request:
  """One statistic of one tensor of a layer, and the feature whose schedule asked for it."""

  feature: numerics_config.StatsFeature
  tensor: str
  stat: str


@dataclasses.dataclass(frozen=True)
class Tap:
  """One tapped DenseGeneral: a single layer, or a scanned module with one entry per layer (scan order)."""

  module_path: tuple[str, ...]
  layers: tuple[layer_names.DenseLayer, ...]
  requests: tuple[tuple[Request, ...], ...]  # per layer
  scanned: bool

  @property
  def key(self) -> str:
    return ".".join(self.module_path)

  def tensors(self) -> tuple[str, ...]:
    wanted = {r.tensor for requests in self.requests for r in requests}
    return tuple(t for t in numerics_config.TENSORS if t in wanted)

  def stats(self, tensor: str) -> tuple[str, ...]:
    return tuple(sorted({r.stat for requests in self.requests for r in requests if r.tensor == tensor}, key=_ORDER.get))

  def reductions(self, tensor: str) -> tuple[str, ...]:
    return tuple(sorted({name for stat in self.stats(tensor) for name in numerics_taps.REDUCTIONS[stat]}))


def _feature_active(feature: numerics_config.StatsFeature, step):
  """StatsFeature.active for a traced step."""
  active = (step % feature.freq == 0) & (step >= feature.start_step)
  return active & (step <= feature.end_step) if feature.end_step >= 0 else active


def _safe_divide(x, n):
  return x / jnp.maximum(n, 1.0)


def combine(a: dict, b: dict) -> dict:
  """Two microbatches' reductions (as `reductions` returns them) as the whole batch's.

  Weights are the same in every microbatch: the later one's are kept, as TE does not accumulate weight statistics.
  """
  return {
    key: {
      tensor: b[key][tensor] if tensor == "weight" else numerics_taps.combine_reductions(a[key][tensor], b[key][tensor])
      for tensor in a[key]
    }
    for key in a
  }


def finalize_tensor(reduced: dict, stats: tuple[str, ...]) -> dict:
  """The statistics from a tensor's raw reductions (std with Bessel's correction, as torch.std in TE)."""
  n = reduced.get("count")
  out = {}
  for stat in stats:
    if stat in ("min", "max"):
      out[stat] = reduced[stat]
    elif stat == "mean":
      out[stat] = _safe_divide(reduced["sum"], n)
    elif stat == "std":
      out[stat] = jnp.sqrt(_safe_divide(reduced["m2"], n - 1))
    elif stat == "l1_norm":
      out[stat] = reduced["abs_sum"]
    elif stat == "l2_norm":
      out[stat] = jnp.sqrt(reduced["sumsq"])
    elif stat == "cur_amax":
      out[stat] = reduced["amax"]
    elif stat == "dynamic_range":  # log2(amax) - log2(smallest nonzero |x|); 0 for an all-zero tensor
      amax, amin = reduced["amax"], reduced["amin_nonzero"]
      nonzero = jnp.isfinite(amin) & (amin > 0)
      out[stat] = jnp.where(nonzero, jnp.log2(amax) - jnp.log2(jnp.where(nonzero, amin, 1.0)), 0.0)
    else:  # underflows, overflows: a fraction of the elements
      out[stat] = _safe_divide(reduced[stat], n)
  return out


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which dense layers collect which statistics, for the step (inputs, outputs) and the host (rows)."""

  taps: tuple[Tap, ...]

  @classmethod
  def create(cls, numerics: numerics_config.NumericsDebugConfig, dense_layers: list[layer_names.DenseLayer]) -> "Plan":
    grouped: dict[tuple[str, ...], list] = {}
    for layer in dense_layers:
      requests = tuple(
        Request(feature, tensor, stat)
        for _, feature in numerics.stats_requests(layer.name)
        for tensor in feature.tensors
        for stat in feature.stats
      )
      grouped.setdefault(layer.module_path, []).append((layer, requests))
    taps = []
    for path, entries in grouped.items():
      if any(requests for _, requests in entries):
        scanned = entries[0][0].index is not None
        taps.append(Tap(path, tuple(e[0] for e in entries), tuple(e[1] for e in entries), scanned))
    return cls(tuple(taps))

  def selected_layers(self) -> list[tuple[layer_names.DenseLayer, tuple[Request, ...]]]:
    return [(layer, requests) for tap in self.taps for layer, requests in zip(tap.layers, tap.requests) if requests]

  def active(self, step: int) -> bool:
    """Whether any statistic is reported at `step` (host side)."""
    return any(r.feature.active(step) for tap in self.taps for requests in tap.requests for r in requests)

  def step_inputs(self, step, gradient_scale) -> dict:
    """The `numerics` collection of one step: the taps' gates, the gradient scale and the reductions' placeholders.

    Args:
      step: the step number (traced).
      gradient_scale: 1 / the batch's real target tokens, so gradients are those of the mean loss (learning/loss).
    """
    tree = {}
    for tap in self.taps:
      entry = {}
      for tensor in tap.tensors():
        gates = []
        for requests in tap.requests:
          features = {id(r.feature): r.feature for r in requests if r.tensor == tensor}.values()
          gate = jnp.zeros((), bool)
          for feature in features:
            gate = gate | _feature_active(feature, step)
          gates.append(gate)
        gate = (jnp.stack(gates) if tap.scanned else gates[0]).astype(jnp.float32)
        entry[tensor] = {"gate": gate, "stats": {name: jnp.zeros_like(gate) for name in tap.reductions(tensor)}}
        if tensor == "gradient":
          entry[tensor]["scale"] = jnp.broadcast_to(jnp.asarray(gradient_scale, jnp.float32), gate.shape)
      layer_names.set_at(tree, tap.module_path, entry)
    return tree

  def reductions(self, sown: dict, inputs_grad: dict) -> dict:
    """One microbatch's raw reductions: {module path: {tensor: {reduction: value}}}.

    Args:
      sown: the mutable collections of model.apply (numerics_taps sows activation and weight reductions).
      inputs_grad: the gradient of the loss with respect to the step inputs (gradient reductions).
    """
    out = {}
    for tap in self.taps:
      entry = {}
      for tensor in tap.tensors():
        if tensor == "gradient":
          entry[tensor] = dict(layer_names.at(inputs_grad, tap.module_path)[tensor]["stats"])
        else:
          (entry[tensor],) = layer_names.at(sown["intermediates"], tap.module_path)[numerics_taps.SOWN[tensor]]
      out[tap.key] = entry
    return out

  def identity(self, inputs: dict) -> dict:
    """Reductions that `combine` leaves unchanged (where a sum over microbatches starts), shaped as the step's."""
    out = {}
    for tap in self.taps:
      entry = {}
      for tensor in tap.tensors():
        shape = layer_names.at(inputs, tap.module_path)[tensor]["gate"].shape
        fill = {name: jnp.inf if name in _MIN else -jnp.inf if name in _MAX else 0.0 for name in tap.reductions(tensor)}
        entry[tensor] = {name: jnp.full(shape, value, jnp.float32) for name, value in fill.items()}
      out[tap.key] = entry
    return out

  def finalize(self, reductions: dict) -> dict:
    """The statistics of each tap and tensor: what the step returns under metrics["numerics"]."""
    return {tap.key: {t: finalize_tensor(reductions[tap.key][t], tap.stats(t)) for t in tap.tensors()} for tap in self.taps}

  def rows(self, step: int, stats: dict) -> list[dict]:
    """The statistics to report at `step`, from the host copy of `finalize`'s output, one dict per value."""
    rows = {}
    for tap in self.taps:
      for i, (layer, requests) in enumerate(zip(tap.layers, tap.requests)):
        for r in requests:
          if r.feature.active(step):
            value = stats[tap.key][r.tensor][r.stat]
            rows[(layer.name, r.tensor, r.stat)] = float(value[i] if tap.scanned else value)
    ordered = sorted(
      rows.items(),
      key=lambda kv: (
        layer_names.layer_number(kv[0][0]) or 0,
        kv[0][0],
        numerics_config.TENSORS.index(kv[0][1]),
        _ORDER[kv[0][2]],
      ),
    )
    return [
      {"step": step, "layer": name, "tensor": tensor, "stat": stat, "value": value}
      for (name, tensor, stat), value in ordered
    ]


def create_plan(config, params) -> Plan | None:
  """The statistics plan of numerics_debug_config for these params (shapes suffice), or None when none are asked for."""
  numerics = config.numerics_debug
  if not numerics.collects_stats:
    return None
  plan = Plan.create(numerics, layer_names.dense_layers(params, config))
  return plan if plan.taps else None
