"""Reads the raw config: YAML files, `base_config:` inheritance, model presets, CLI and env overrides.

Pure Python (no JAX), so that a user mistake costs a fraction of a second. Every value remembers where
it came from; `pyconfig` turns the result into the validated, derived `Config`.
"""

import difflib
import os
import re

import yaml

from MaxText.errors import ConfigError

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
CONFIGS_DIR = os.path.join(PACKAGE_DIR, "configs")
ENV_PREFIX = "M_"

# Sources a value can come from, in increasing precedence (derived values are added by pyconfig).
SOURCE_MODEL = "model preset"
SOURCE_CLI = "command line"
SOURCE_ENV = "environment"
SOURCE_KWARGS = "python kwargs"


class _Loader(yaml.SafeLoader):
  """SafeLoader that also reads `1e-8` and `3e-3` as floats (YAML 1.1 requires a dot)."""


_Loader.add_implicit_resolver(
  "tag:yaml.org,2002:float",
  re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
  list("-+0123456789"),
)


def parse_yaml(text: str, where: str):
  try:
    return yaml.load(text, Loader=_Loader)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise ConfigError(f"{where} is not valid YAML{at}: {problem}") from None


def _read_yaml_mapping(path: str) -> dict:
  if not os.path.isfile(path):
    raise ConfigError(f"config file '{path}' does not exist (e.g. MaxText/configs/base.yml)")
  with open(path, encoding="utf-8") as f:
    data = parse_yaml(f.read(), f"config file '{path}'")
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"config file '{path}' must be a YAML mapping of key: value, got a {type(data).__name__}")
  return data


def load_config_file(path: str, _seen: tuple = ()) -> tuple[dict, dict]:
  """Loads a YAML config and, recursively, its `base_config:` parents. Returns (values, sources)."""
  if not os.path.isfile(path):
    raise ConfigError(f"config file '{path}' does not exist (e.g. MaxText/configs/base.yml)")
  path = os.path.abspath(path)
  if path in _seen:
    raise ConfigError(f"base_config: '{path}' includes itself")
  data = _read_yaml_mapping(path)
  values, sources = {}, {}
  parent = data.pop("base_config", None)
  if parent:
    parent_path = os.path.join(os.path.dirname(path), parent)
    if not os.path.isfile(parent_path):
      parent_path = os.path.join(CONFIGS_DIR, parent)
    if not os.path.isfile(parent_path):
      raise ConfigError(f"base_config: '{parent}' (in {path}) is neither next to that file nor in {CONFIGS_DIR}")
    values, sources = load_config_file(parent_path, _seen + (path,))
  name = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
  for k, v in data.items():
    values[k] = v
    sources[k] = name
  return values, sources


def closest_key_hint(key: str, candidates) -> str:
  match = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
  return f"; did you mean '{match[0]}'?" if match else ""


def _type_name(t: type) -> str:
  return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string", list: "a list"}[t]


def coerce_value(key: str, value, default):
  """Converts an override (a CLI/env string or a Python value) to the type of the key's default."""
  expected = type(default)
  if default is None or expected not in (bool, int, float, str, list):
    return parse_yaml(value, f"value of '{key}'") if isinstance(value, str) else value
  if not isinstance(value, str):
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
      return float(value)
    if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
      return value
    raise ConfigError(f"{key}={value!r} has the wrong type: expected {_type_name(expected)}")
  if expected is str:
    return value
  if expected is bool:
    lowered = value.strip().lower()
    if lowered not in ("true", "false"):
      raise ConfigError(f"{key}={value} is not a boolean: use true or false")
    return lowered == "true"
  parsed = parse_yaml(value, f"value of '{key}'") if value.strip() else None
  if expected is int:
    if isinstance(parsed, float) and parsed.is_integer():
      parsed = int(parsed)
    if not isinstance(parsed, int) or isinstance(parsed, bool):
      raise ConfigError(f"{key}={value} is not an integer")
    return parsed
  if expected is float:
    if not isinstance(parsed, (int, float)) or isinstance(parsed, bool):
      raise ConfigError(f"{key}={value} is not a number (e.g. 0.5 or 3e-4)")
    return float(parsed)
  if not isinstance(parsed, list):  # list
    raise ConfigError(f'{key}={value} is not a list: write it in YAML syntax, e.g. {key}="{default}"')
  return parsed


def parse_cli(args: list[str]) -> dict[str, str]:
  """Parses `key=value` arguments (after the config path)."""
  overrides = {}
  for arg in args:
    if "=" not in arg:
      raise ConfigError(f"argument '{arg}' is not of the form key=value")
    key, value = arg.split("=", 1)
    key = key.strip()
    if key.startswith("--"):
      raise ConfigError(f"argument '{arg}': write overrides as {key[2:]}=value, without leading dashes")
    if key in overrides:
      raise ConfigError(f"key '{key}' is given twice on the command line ({key}={overrides[key]} and {arg})")
    overrides[key] = value
  return overrides


def env_overrides(environ, known_keys) -> dict[str, str]:
  """Collects M_<KEY> environment overrides; an M_ variable that names no key is a mistake."""
  overrides = {}
  for name, value in environ.items():
    if not name.startswith(ENV_PREFIX):
      continue
    key = name[len(ENV_PREFIX) :].lower()
    if key not in known_keys or name != name.upper():
      hint = closest_key_hint(key, known_keys)
      raise ConfigError(f"environment variable {name} names no config key '{key}'{hint} (M_<KEY>, upper case)")
    overrides[key] = value
  return overrides


def list_model_presets(config_dir: str) -> list[str]:
  names = set()
  for d in (os.path.join(config_dir, "models"), os.path.join(CONFIGS_DIR, "models")):
    if os.path.isdir(d):
      names.update(f[: -len(".yml")] for f in os.listdir(d) if f.endswith(".yml"))
  return sorted(names)


def load_model_preset(model_name: str, config_dir: str) -> dict:
  for d in (os.path.join(config_dir, "models"), os.path.join(CONFIGS_DIR, "models")):
    path = os.path.join(d, f"{model_name}.yml")
    if os.path.isfile(path):
      return _read_yaml_mapping(path)
  valid = ", ".join(["default"] + list_model_presets(config_dir))
  raise ConfigError(f"model_name={model_name} is not a known model; valid: {valid}")


def merge_logical_axis_rules(old_rules, new_rules):
  """Rules of a preset replace the base rules of the same logical names; the other base rules stay first."""
  new_names = {rule[0] for rule in new_rules}
  return [rule for rule in old_rules if rule[0] not in new_names] + list(new_rules)


def load_raw_config(argv: list[str], environ, kwargs: dict | None = None) -> tuple[dict, dict]:
  """Builds the raw key -> value mapping (before validation and derivation) and each key's source.

  Args:
    argv: [program, config_path, key=value, ...] as on the command line.
    environ: the environment (for M_<KEY> overrides).
    kwargs: Python overrides (used by tests and notebooks); they win over CLI strings.
  """
  if len(argv) < 2 or "=" in argv[1] or not argv[1].endswith((".yml", ".yaml")):
    got = f" got '{argv[1]}'" if len(argv) > 1 else " got nothing"
    raise ConfigError(f"the first argument must be a config file, e.g. MaxText/configs/base.yml;{got}")
  config_path = argv[1]
  values, sources = load_config_file(config_path)
  cli = parse_cli(argv[2:])
  env = env_overrides(environ, values)
  both = sorted(set(cli) & set(env))
  if both:
    raise ConfigError(f"key '{both[0]}' is set both on the command line and by {ENV_PREFIX}{both[0].upper()}; keep one")
  overrides = {k: (v, SOURCE_ENV) for k, v in env.items()}
  overrides.update({k: (v, SOURCE_CLI) for k, v in cli.items()})
  overrides.update({k: (v, SOURCE_KWARGS) for k, v in (kwargs or {}).items()})
  for key in overrides:
    if key not in values:
      raise ConfigError(f"unknown config key '{key}'{closest_key_hint(key, values)}")
  typed = {k: (coerce_value(k, v, values[k]), src) for k, (v, src) in overrides.items()}

  model_name = typed["model_name"][0] if "model_name" in typed else values.get("model_name", "default")
  if model_name != "default":
    preset = load_model_preset(model_name, os.path.dirname(os.path.abspath(config_path)))
    allow_override = typed.get("override_model_config", (values.get("override_model_config", False),))[0]
    clashes = sorted(set(preset) & set(typed))
    if clashes and not allow_override:
      raise ConfigError(
        f"model_name={model_name} sets {', '.join(clashes)}, which you also override; "
        "pass override_model_config=true to let your value win"
      )
    for key, value in preset.items():
      if key not in values:
        raise ConfigError(f"model preset '{model_name}' sets unknown key '{key}'{closest_key_hint(key, values)}")
      value = coerce_value(key, value, values[key])
      if key == "logical_axis_rules":
        value = merge_logical_axis_rules(values[key], value)
      values[key], sources[key] = value, f"{SOURCE_MODEL} {model_name}"

  for key, (value, src) in typed.items():
    values[key], sources[key] = value, src
  values["config_path"] = config_path
  sources["config_path"] = SOURCE_CLI
  return values, sources
