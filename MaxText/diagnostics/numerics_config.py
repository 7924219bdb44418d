r"""The numerics debug YAML (config key numerics_debug_config), in TransformerEngine's debug-module format.

One or more named sections, each selecting layers and turning features on for them:

    fc_stats:                         # any name
      enabled: true
      layers:                         # at least one selector; only layer_numbers and layer_types combine
        layer_name_regex_pattern: .*\.mlp\.(wi_0|wo)   # matched against the whole name (list_layers.py)
        layer_numbers: [1-4, 7]       # counted from 1: decoder.layers.0.* is layer 1; [all]
        layer_types: [qkv, attention_out, mlp, fc1, fc2, all]   # mlp = fc1 + fc2
      collect_tensor_stats:
        enabled: true
        type: [min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range]
        tensors: [activation, gradient, weight]
        freq: 100                     # steps where step % freq == 0, from start_step to end_step (both included)
        start_step: 0
        end_step: -1                  # -1: no end
      transformer_engine:             # TE's namespace for its own features; optional, they may also sit above
        collect_fp8_tensor_stats: {enabled: true, type: [underflows, overflows], tensors: [activation], freq: 100}
        disable_fp8_gemm: {enabled: true, gemms: [fprop, dgrad, wgrad]}
        disable_fp8_layer: {enabled: true}
        per_tensor_scaling: {enabled: true, gemms: [fprop, dgrad, wgrad], margin: 0}

`enabled` is required in every section and feature. A mistake is one ConfigError naming the file, the section
and the field. The low-precision features (disable_fp8_gemm, disable_fp8_layer, per_tensor_scaling) are only
parsed here, for the quantized dense layers to read through NumericsDebugConfig.gemm_precision.

Pure Python (no JAX): pyconfig parses the file once, with the other config checks, into the derived key
`numerics_debug` (a NumericsDebugConfig) that the run carries; the resolved config and the compiled step's
signature hold its canonical form (`to_plain`: every default written out, disabled features left out), so the
signature holds the file's content, not only its path.
"""

import dataclasses
import os
import re

from MaxText.configuration import config_loader
from MaxText.errors import ConfigError
from MaxText.layers import layer_names

STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range")
FP8_STATS = ("underflows", "overflows")
TENSORS = ("activation", "gradient", "weight")
GEMMS = ("fprop", "dgrad", "wgrad")
MAX_MARGIN = 8  # per_tensor_scaling's margin: 0 to 8 powers of two of headroom
SELECTABLE_TYPES = ("qkv", "attention_out", "mlp", "fc1", "fc2", "all")
TE_NAMESPACE = "transformer_engine"
STATS_FEATURES = {"collect_tensor_stats": STATS, "collect_fp8_tensor_stats": FP8_STATS}
_PRECISION_FEATURES = ("disable_fp8_gemm", "disable_fp8_layer", "per_tensor_scaling")
_SELECTORS = ("layer_name_regex_pattern", "layer_numbers", "layer_types")
_RANGE = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*")


class _Invalid(Exception):
  """A mistake in one field: (field, problem), turned into the ConfigError line by `parse`."""


@dataclasses.dataclass(frozen=True)
class LayerSelector:
  """`layers:` of a section. Matching is on the names that MaxText/list_layers.py prints."""

  regex: str = ""
  number_ranges: tuple[tuple[int, int], ...] = ()  # inclusive, counted from 1
  all_numbers: bool = False
  types: tuple[str, ...] = ()

  def matches(self, name: str) -> bool:
    if self.regex:
      return re.fullmatch(self.regex, name) is not None
    if self.number_ranges or self.all_numbers:
      number = layer_names.layer_number(name)
      if number is None or not (self.all_numbers or any(lo <= number <= hi for lo, hi in self.number_ranges)):
        return False
    if self.types and "all" not in self.types:
      wanted = set(self.types) | ({"fc1", "fc2"} if "mlp" in self.types else set())
      return layer_names.layer_type(name) in wanted
    return True

  def to_plain(self) -> dict:
    if self.regex:
      return {"layer_name_regex_pattern": self.regex}
    plain = {}
    if self.all_numbers:
      plain["layer_numbers"] = ["all"]
    elif self.number_ranges:
      plain["layer_numbers"] = [lo if lo == hi else f"{lo}-{hi}" for lo, hi in self.number_ranges]
    if self.types:
      plain["layer_types"] = list(self.types)
    return plain


@dataclasses.dataclass(frozen=True)
class StatsFeature:
  """collect_tensor_stats or collect_fp8_tensor_stats of a section."""

  feature: str  # "collect_tensor_stats" | "collect_fp8_tensor_stats"
  stats: tuple[str, ...]
  tensors: tuple[str, ...]
  freq: int = 1
  start_step: int = 0
  end_step: int = -1  # -1: no end
  in_namespace: bool = False  # written under transformer_engine:

  def active(self, step: int) -> bool:
    """Whether the statistics are collected at `step` (TE's rule: step % freq == 0 within [start, end])."""
    return step % self.freq == 0 and step >= self.start_step and (self.end_step < 0 or step <= self.end_step)

  def to_plain(self) -> dict:
    return {
      "enabled": True,
      "type": list(self.stats),
      "tensors": list(self.tensors),
      "freq": self.freq,
      "start_step": self.start_step,
      "end_step": self.end_step,
    }


@dataclasses.dataclass(frozen=True)
class GemmPrecision:
  """How one GEMM (fprop, dgrad or wgrad) of one layer runs when the model is quantized.

  Attributes:
    low_precision: False where disable_fp8_layer or disable_fp8_gemm keeps it in high precision.
    per_tensor_scaling: current (per-tensor, dynamic) scaling instead of the default delayed scaling.
    margin: with per_tensor_scaling, the scale uses amax * 2**margin.
  """

  low_precision: bool = True
  per_tensor_scaling: bool = False
  margin: int = 0


@dataclasses.dataclass(frozen=True)
class Section:
  name: str
  enabled: bool
  layers: LayerSelector
  stats: tuple[StatsFeature, ...] = ()
  disable_fp8_gemm: tuple[str, ...] = ()  # the gemms kept in high precision
  disable_fp8_layer: bool = False
  per_tensor_scaling: tuple[str, ...] = ()  # the gemms with current scaling
  per_tensor_scaling_margin: int = 0
  precision_in_namespace: tuple[str, ...] = ()  # which low-precision features were written under transformer_engine:

  def to_plain(self) -> dict:
    plain = {"enabled": self.enabled, "layers": self.layers.to_plain()}
    namespace = {}
    for feature in self.stats:
      (namespace if feature.in_namespace else plain)[feature.feature] = feature.to_plain()
    precision = {}
    if self.disable_fp8_gemm:
      precision["disable_fp8_gemm"] = {"enabled": True, "gemms": list(self.disable_fp8_gemm)}
    if self.disable_fp8_layer:
      precision["disable_fp8_layer"] = {"enabled": True}
    if self.per_tensor_scaling:
      precision["per_tensor_scaling"] = {
        "enabled": True,
        "gemms": list(self.per_tensor_scaling),
        "margin": self.per_tensor_scaling_margin,
      }
    for key, value in precision.items():
      (namespace if key in self.precision_in_namespace else plain)[key] = value
    if namespace:
      plain[TE_NAMESPACE] = namespace
    return plain


@dataclasses.dataclass(frozen=True)
class NumericsDebugConfig:
  """The parsed numerics debug YAML; empty (falsy) when numerics_debug_config is "" or every section is disabled."""

  sections: tuple[Section, ...] = ()

  def __bool__(self) -> bool:
    return any(s.enabled for s in self.sections)

  def sections_for(self, name: str) -> list[Section]:
    """The enabled sections whose `layers:` select the layer `name`."""
    return [s for s in self.sections if s.enabled and s.layers.matches(name)]

  def stats_requests(self, name: str) -> list[tuple[Section, StatsFeature]]:
    """The statistics features that apply to the layer `name`, with their sections."""
    return [(s, f) for s in self.sections_for(name) for f in s.stats]

  @property
  def collects_stats(self) -> bool:
    return any(s.enabled and s.stats for s in self.sections)

  def gemm_precision(self, name: str, gemm: str) -> GemmPrecision:
    """The precision of one GEMM of the layer `name` (fprop, dgrad or wgrad) under the low-precision features.

    With no section selecting the layer: low precision with delayed scaling (TE's default run). A section's
    disable_fp8_layer keeps all three GEMMs in high precision, disable_fp8_gemm the ones it names; the first
    selecting section with per_tensor_scaling for the GEMM gives its margin.
    """
    if gemm not in GEMMS:
      raise ValueError(f"gemm={gemm} is not one of {', '.join(GEMMS)}")
    sections = self.sections_for(name)
    if any(s.disable_fp8_layer or gemm in s.disable_fp8_gemm for s in sections):
      return GemmPrecision(low_precision=False)
    for s in sections:
      if gemm in s.per_tensor_scaling:
        return GemmPrecision(per_tensor_scaling=True, margin=s.per_tensor_scaling_margin)
    return GemmPrecision()

  def to_plain(self) -> dict:
    return {s.name: s.to_plain() for s in self.sections}

  def ignored_by(self, quantization: str) -> str | None:
    """Why this file's low-precision features do nothing under `quantization` (a warning), or None."""
    enabled = [s for s in self.sections if s.enabled]
    if not quantization and any(s.disable_fp8_gemm or s.disable_fp8_layer or s.per_tensor_scaling for s in enabled):
      return "its disable_fp8_gemm, disable_fp8_layer and per_tensor_scaling apply with a quantization (int8, fp8, ...)"
    if quantization not in ("", "fp8") and any(s.per_tensor_scaling for s in enabled):
      return f"per_tensor_scaling applies to quantization=fp8 (quantization={quantization} scales each channel)"
    return None


def _show(value) -> str:
  return repr(value) if isinstance(value, str) else str(value)


def _join(field: str, key: str) -> str:
  return f"{field}.{key}" if field else key


def _mapping(value, field: str) -> dict:
  if not isinstance(value, dict):
    raise _Invalid(field, f"must be a mapping of field: value, got {_show(value)}")
  return value


def _check_keys(mapping: dict, allowed, field: str) -> None:
  for key in mapping:
    if key not in allowed:
      hint = config_loader.closest_key_hint(str(key), allowed)
      raise _Invalid(_join(field, str(key)), f"unknown field{hint} (valid: {', '.join(allowed)})")


def _bool(mapping: dict, key: str, field: str) -> bool:
  if key not in mapping:
    raise _Invalid(_join(field, key), "is missing (write enabled: true or enabled: false)")
  value = mapping[key]
  if not isinstance(value, bool):
    raise _Invalid(_join(field, key), f"{_show(value)} is not true or false")
  return value


def _int(mapping: dict, key: str, field: str, default: int, minimum: int) -> int:
  value = mapping.get(key, default)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise _Invalid(_join(field, key), f"{_show(value)} must be an integer >= {minimum}")
  return value


def _choices(mapping: dict, key: str, field: str, valid) -> tuple[str, ...]:
  if key not in mapping:
    raise _Invalid(_join(field, key), f"is missing; give a list of {', '.join(valid)}")
  values = mapping[key]
  if not isinstance(values, list) or not values:
    raise _Invalid(_join(field, key), f"{_show(values)} must be a non-empty list, e.g. [{valid[0]}]")
  for v in values:
    if v not in valid:
      raise _Invalid(_join(field, key), f"{_show(v)} is not one of {', '.join(valid)}")
  return tuple(dict.fromkeys(values))


def _layer_numbers(values, field: str) -> tuple[tuple[tuple[int, int], ...], bool]:
  if not isinstance(values, list) or not values:
    raise _Invalid(field, f"{_show(values)} must be a non-empty list such as [1-12], [3, 5] or [all]")
  ranges = []
  for v in values:
    if v == "all":
      if len(values) > 1:
        raise _Invalid(field, "all cannot be combined with layer numbers: write [all] alone")
      return (), True
    match = _RANGE.fullmatch(v) if isinstance(v, str) else None
    if isinstance(v, int) and not isinstance(v, bool):
      lo = hi = v
    elif match:
      lo, hi = int(match.group(1)), int(match.group(2))
    else:
      raise _Invalid(field, f"{_show(v)} is not a layer number, a range such as 1-12, or all")
    if lo < 1 or hi < lo:
      raise _Invalid(field, f"{_show(v)} must count from 1 (layer 1 is decoder.layers.0), low to high")
    ranges.append((lo, hi))
  return tuple(sorted(set(ranges))), False


def _selector(value, field: str) -> LayerSelector:
  layers = _mapping(value, field)
  _check_keys(layers, _SELECTORS, field)
  given = [k for k in _SELECTORS if layers.get(k) is not None]
  if not given:
    raise _Invalid(field, f"needs at least one of {', '.join(_SELECTORS)}")
  regex = layers.get("layer_name_regex_pattern")
  if regex is not None:
    if len(given) > 1:
      raise _Invalid(field, "layer_name_regex_pattern cannot be combined with layer_numbers or layer_types")
    if not isinstance(regex, str) or not regex:
      raise _Invalid(f"{field}.layer_name_regex_pattern", f"{_show(regex)} must be a regular expression")
    try:
      re.compile(regex)
    except re.error as e:
      raise _Invalid(f"{field}.layer_name_regex_pattern", f"{_show(regex)} is not a valid regular expression: {e}") from None
    return LayerSelector(regex=regex)
  ranges, all_numbers = (), False
  if layers.get("layer_numbers") is not None:
    ranges, all_numbers = _layer_numbers(layers["layer_numbers"], f"{field}.layer_numbers")
  types = _choices(layers, "layer_types", field, SELECTABLE_TYPES) if layers.get("layer_types") is not None else ()
  return LayerSelector(number_ranges=ranges, all_numbers=all_numbers, types=types)


def _stats_feature(value, feature: str, field: str, in_namespace: bool) -> StatsFeature | None:
  spec = _mapping(value, field)
  _check_keys(spec, ("enabled", "type", "tensors", "freq", "start_step", "end_step"), field)
  if not _bool(spec, "enabled", field):
    return None
  start = _int(spec, "start_step", field, 0, 0)
  end = _int(spec, "end_step", field, -1, -1)
  if 0 <= end < start:
    raise _Invalid(f"{field}.end_step", f"{end} is before start_step={start}")
  return StatsFeature(
    feature=feature,
    stats=_choices(spec, "type", field, STATS_FEATURES[feature]),
    tensors=_choices(spec, "tensors", field, TENSORS),
    freq=_int(spec, "freq", field, 1, 1),
    start_step=start,
    end_step=end,
    in_namespace=in_namespace,
  )


def _section(name: str, value) -> Section:
  section = _mapping(value, "")
  features = (*STATS_FEATURES, *_PRECISION_FEATURES)
  _check_keys(section, ("enabled", "layers", *features, TE_NAMESPACE), "")
  enabled = _bool(section, "enabled", "")
  if "layers" not in section:
    raise _Invalid("layers", f"is missing; select layers with {', '.join(_SELECTORS)}")
  layers = _selector(section["layers"], "layers")
  namespace = _mapping(section.get(TE_NAMESPACE) or {}, TE_NAMESPACE)
  _check_keys(namespace, features, TE_NAMESPACE)
  stats, precision, in_namespace = [], {}, []
  for where, mapping in (("", section), (f"{TE_NAMESPACE}.", namespace)):
    for key in features:
      if key not in mapping:
        continue
      field = f"{where}{key}"
      if key in STATS_FEATURES:
        feature = _stats_feature(mapping[key], key, field, bool(where))
        stats += [feature] if feature else []
        continue
      if key in precision:
        raise _Invalid(field, f"is given twice (in the section and under {TE_NAMESPACE}:)")
      precision[key] = (_mapping(mapping[key], field), field)
      in_namespace += [key] if where else []
  options = {}
  if "disable_fp8_gemm" in precision:
    spec, field = precision["disable_fp8_gemm"]
    _check_keys(spec, ("enabled", "gemms"), field)
    if _bool(spec, "enabled", field):
      options["disable_fp8_gemm"] = _choices(spec, "gemms", field, GEMMS)
  if "disable_fp8_layer" in precision:
    spec, field = precision["disable_fp8_layer"]
    _check_keys(spec, ("enabled",), field)
    options["disable_fp8_layer"] = _bool(spec, "enabled", field)
  if "per_tensor_scaling" in precision:
    spec, field = precision["per_tensor_scaling"]
    _check_keys(spec, ("enabled", "gemms", "margin"), field)
    margin = spec.get("margin", 0)
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin <= MAX_MARGIN:
      # Beyond a few powers of two the scaled values fall below FP8's normal range and flush to zero.
      raise _Invalid(
        f"{field}.margin", f"{_show(margin)} must be an integer from 0 to {MAX_MARGIN} (scale from amax * 2**margin)"
      )
    if _bool(spec, "enabled", field):
      options.update(per_tensor_scaling=_choices(spec, "gemms", field, GEMMS), per_tensor_scaling_margin=margin)
  return Section(name, enabled, layers, tuple(stats), precision_in_namespace=tuple(in_namespace), **options)


def parse(data, where: str) -> NumericsDebugConfig:
  """Validates a parsed numerics debug YAML document.

  Args:
    data: the document (a mapping of section name -> section).
    where: how messages name the file, e.g. "numerics_debug_config=debug.yml".

  Raises:
    ConfigError: one line naming the section and the field, e.g. "numerics_debug_config=x.yml: section 'stats1'
      layers.layer_types: 'qkvv' is not one of qkv, attention_out, mlp, fc1, fc2, all".
  """
  if not isinstance(data, dict) or not data:
    raise ConfigError(f"{where}: must be a mapping of named sections (e.g. 'stats:' with enabled, layers, ...)")
  sections = []
  for name, value in data.items():
    try:
      sections.append(_section(str(name), value))
    except _Invalid as e:
      field, problem = e.args
      field = f" {field}" if field else ""
      raise ConfigError(f"{where}: section '{name}'{field}: {problem}") from None
  return NumericsDebugConfig(tuple(sections))


def load(path: str, num_layers: int) -> NumericsDebugConfig:
  """Reads and validates the file of numerics_debug_config.

  Args:
    path: the file.
    num_layers: the decoder's layers (scanned blocks), to check layer_numbers against.
  """
  where = f"numerics_debug_config={config_loader.display_path(path)}"
  if not os.path.isfile(path):
    problem = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
    raise ConfigError(f"{where} {problem} (a YAML file of sections in TransformerEngine's debug format)")
  with open(path, encoding="utf-8") as f:
    parsed = parse(config_loader.parse_yaml(f.read(), where), where)
  for section in parsed.sections:
    for lo, hi in section.layers.number_ranges:
      if hi > num_layers:
        shown = lo if lo == hi else f"{lo}-{hi}"
        raise ConfigError(
          f"{where}: section '{section.name}' layers.layer_numbers: {shown} is beyond this model's {num_layers} layers "
          f"(1-{num_layers})"
        )
  return parsed
