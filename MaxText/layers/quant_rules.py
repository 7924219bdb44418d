"""quant_cfg_path: upstream MaxText's per-layer weight quantization file, for quantization=intmp.

A JSON object from a regular expression to the settings of the dense layers whose module path it matches in full
(re.fullmatch), as upstream's configs/quantization/mp_scale.json:

    {
      ".*/query": {"bits": 4, "scale": 0.8},
      ".*/mlp/wo": {"bits": 8, "tile_size": 128},
      "__default__": {"bits": 8}
    }

- bits: 2 to 8 (default 8), the kernel's integer width (weight-only: the activations and the backward GEMMs stay in high
  precision, as upstream's intmp).
- scale: clips the kernel's range to scale x its absmax before quantizing (upstream's AbsMaxCalibration(scale));
  in (0, 1], default 1.
- tile_size: one scale per tile_size entries of the kernel's innermost contracting dimension (sub-channel
  quantization); -1 (default): one scale per output channel.

The module path is the flax one, as upstream writes it: decoder/layers/self_attention/query for scanned layers,
decoder/layers_3/mlp/wo for unrolled ones (list_layers.py prints them with dots and the layer index). The first
pattern that matches wins; a layer that none matches takes `__default__`, else 8 bits untiled (upstream's default).
To treat single layers of a scanned stack differently, or keep some in high precision, use numerics_debug_config's
layer selectors, which apply under intmp too.

Pure Python (no JAX): pyconfig parses the file once into the derived key `quant_rules`.
"""

import dataclasses
import json
import re

from MaxText.errors import ConfigError

DEFAULT_KEY = "__default__"
_FIELDS = ("bits", "scale", "tile_size")
BITS = (2, 3, 4, 5, 6, 7, 8)


@dataclasses.dataclass(frozen=True, order=True)
class WeightQuant:
  """How one dense layer's kernel is quantized."""

  bits: int = 8
  scale: float = 1.0
  tile_size: int = -1

  def describe(self) -> str:
    """e.g. "int4, clip 0.8, tiles of 128" (list_layers.py)."""
    parts = [f"int{self.bits}"]
    if self.scale != 1.0:
      parts.append(f"clip {self.scale:g}")
    if self.tile_size > 0:
      parts.append(f"tiles of {self.tile_size}")
    return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class QuantRules:
  """The parsed file: (pattern, settings) in the file's order, and the default."""

  rules: tuple[tuple[str, WeightQuant], ...] = ()
  default: WeightQuant = WeightQuant()

  def find(self, module_path: str) -> WeightQuant:
    """The settings of the dense layer at `module_path` (slash-separated)."""
    for pattern, quant in self.rules:
      if re.fullmatch(pattern, module_path):
        return quant
    return self.default

  def to_plain(self) -> dict:
    """The file's canonical content (every field written out), for the resolved config and the compiled step's
    signature."""
    plain = {pattern: dataclasses.asdict(quant) for pattern, quant in self.rules}
    plain[DEFAULT_KEY] = dataclasses.asdict(self.default)
    return plain


def wgrad_parts(local_shard_count: int, num_slices: int) -> int:
  """quantization_local_shard_count as int8's wgrad uses it: the parts of the batch with their own scales (-1: one
  per slice, as upstream; 0: wgrad in high precision)."""
  return num_slices if local_shard_count == -1 else local_shard_count


def _settings(path: str, pattern: str, entry) -> WeightQuant:
  where = f"quant_cfg_path={path}: {pattern!r}"
  if not isinstance(entry, dict):
    raise ConfigError(f'{where} must map to an object such as {{"bits": 4, "scale": 0.8}}, not {entry!r}')
  unknown = sorted(set(entry) - set(_FIELDS))
  if unknown:
    raise ConfigError(f"{where} has unknown field(s) {', '.join(unknown)}; the fields are {', '.join(_FIELDS)}")
  quant = WeightQuant(**entry)
  if type(quant.bits) is not int or quant.bits not in BITS:  # pylint: disable=unidiomatic-typecheck  # not True, 4.0
    raise ConfigError(f"{where}: bits={quant.bits!r}; choose one of {', '.join(map(str, BITS))}")
  if isinstance(quant.scale, bool) or not isinstance(quant.scale, (int, float)) or not 0 < quant.scale <= 1:
    raise ConfigError(f"{where}: scale={quant.scale!r}; it clips the range to scale x absmax: a number in (0, 1]")
  if type(quant.tile_size) is not int or not (quant.tile_size == -1 or quant.tile_size > 0):  # pylint: disable=unidiomatic-typecheck
    raise ConfigError(f"{where}: tile_size={quant.tile_size!r}; -1 (one scale per channel) or a positive integer")
  return dataclasses.replace(quant, scale=float(quant.scale))


def parse(text: str, path: str) -> QuantRules:
  """The rules of a quant_cfg_path file's text; a mistake is one ConfigError naming the file and the entry."""
  try:
    content = json.loads(text)
  except json.JSONDecodeError as e:
    raise ConfigError(f"quant_cfg_path={path} is not valid JSON: {e}") from None
  if not isinstance(content, dict) or not content:
    raise ConfigError(
      f"quant_cfg_path={path} must be a JSON object from module-path patterns to settings, such as "
      '{".*/query": {"bits": 4, "scale": 0.8}}'
    )
  rules, default = [], WeightQuant()
  for pattern, entry in content.items():
    quant = _settings(path, pattern, entry)
    if pattern == DEFAULT_KEY:
      default = quant
      continue
    try:
      re.compile(pattern)
    except re.error as e:
      raise ConfigError(f"quant_cfg_path={path}: {pattern!r} is not a regular expression ({e})") from None
    rules.append((pattern, quant))
  return QuantRules(tuple(rules), default)


def load(path: str) -> QuantRules:
  """Reads and parses a local quant_cfg_path file."""
  with open(path, encoding="utf-8") as f:
    return parse(f.read(), path)
