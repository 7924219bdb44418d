"""Reads the raw config: YAML files, `base_config:` inheritance, model presets, CLI and env overrides.

Pure Python (no JAX), so that a user mistake costs a fraction of a second. Every value remembers where
it came from; `pyconfig` turns the result into the validated, derived `Config`.
"""

import copy
import difflib
import functools
import math
import os
import re

import yaml

from MaxText import max_logging
from MaxText.errors import ConfigError

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # MaxText/
CONFIGS_DIR = os.path.join(PACKAGE_DIR, "configs")
BASE_YML = os.path.join(CONFIGS_DIR, "base.yml")  # its defaults type every key, whatever the config file
ENV_PREFIX = "M_"

# Sources a value can come from, in increasing precedence (derived values are added by pyconfig).
SOURCE_MODEL = "model preset"
SOURCE_CLI = "command line"
SOURCE_ENV = "environment"
SOURCE_KWARGS = "python kwargs"


class _Loader(yaml.SafeLoader):
  """SafeLoader that also reads `1e-8` and `3e-3` as floats (YAML 1.1 requires a dot) and refuses a key given
  twice in one mapping (PyYAML keeps the last silently, so an edit further up a file would have no effect)."""

  def construct_mapping(self, node, deep=False):
    first_line = {}
    for key_node, _ in node.value:
      if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
        if key_node.value in first_line:
          raise yaml.constructor.ConstructorError(
            None,
            None,
            f"'{key_node.value}' is set twice (first on line {first_line[key_node.value]}); keep one",
            key_node.start_mark,
          )
        first_line[key_node.value] = key_node.start_mark.line + 1
    return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
  "tag:yaml.org,2002:float",
  re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
  list("-+0123456789"),
)
# Only true/false are booleans, in files as on the command line: YAML 1.1 also reads yes/no/on/off, which
# would turn `run_name: no` into False.
for _resolvers in _Loader.yaml_implicit_resolvers.values():
  _resolvers[:] = [(tag, regexp) for tag, regexp in _resolvers if tag != "tag:yaml.org,2002:bool"]
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


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


def display_path(path: str) -> str:
  """A file's name as messages and sources show it: relative to the cwd when it is below it."""
  rel = os.path.relpath(path)
  return path if rel.startswith("..") else rel


def base_defaults() -> dict:
  """The keys of MaxText/configs/base.yml and their defaults: every key's type is its default's type.

  base.yml is read once per process (the loader, the validation and --help ask); each call gets its own copy.
  """
  return copy.deepcopy(_read_base_defaults())


@functools.cache
def _read_base_defaults() -> dict:
  defaults = _read_yaml_mapping(BASE_YML)
  defaults.pop("base_config", None)
  return defaults


def set_by_user(sources: dict, key: str) -> bool:
  """Whether a key's value came from anywhere but base.yml's default (a config file, a preset, the command line)."""
  return sources[key] != display_path(BASE_YML)


def _config_chain(path: str, seen: tuple = ()) -> list[tuple[str, dict]]:
  """(absolute path, mapping) of a config file and its `base_config:` parents, the root first."""
  if not os.path.isfile(path):
    raise ConfigError(f"config file '{path}' does not exist (e.g. MaxText/configs/base.yml)")
  path = os.path.abspath(path)
  if path in seen:
    raise ConfigError(f"base_config: '{path}' includes itself")
  data = _read_yaml_mapping(path)
  parent = data.pop("base_config", None)
  if not parent:
    return [(path, data)]
  parent_path = os.path.join(os.path.dirname(path), str(parent))
  if not os.path.isfile(parent_path):
    parent_path = os.path.join(CONFIGS_DIR, str(parent))
  if not os.path.isfile(parent_path):
    raise ConfigError(f"base_config: '{parent}' (in {path}) is neither next to that file nor in {CONFIGS_DIR}")
  return _config_chain(parent_path, seen + (path,)) + [(path, data)]


# Upstream MaxText 2026 nests some keys under a mapping (`lora: {enable_lora: true, ...}` in YAML, lora.lora_rank=16
# on its command line; `rl: {num_generations: 8, ...}`); here they are flat keys, and either spelling gives them.
NESTED_MAPPINGS = ("lora", "rl")
# Keys whose value is a mapping of other keys (their default in base.yml is {}): upstream's teacher_overrides. On the
# command line `teacher_overrides.<key>=value` sets one entry; every layer's mapping is merged into the one below it.
MAPPING_KEYS = ("teacher_overrides",)


def flatten_nested(data: dict, where: str) -> dict:
  """`data` with the keys of a NESTED_MAPPINGS mapping (`lora: {...}`) lifted to the top level."""
  flat = {}
  for key, value in data.items():
    if key not in NESTED_MAPPINGS:
      flat[key] = value
    elif not isinstance(value, dict):
      raise ConfigError(f"'{key}' in {where} must be a mapping of {key} keys, e.g. {key}: {{enable_{key}: true}}")
    else:
      flat.update(value)
  return flat


def load_config_file(path: str, defaults: dict | None = None) -> tuple[dict, dict]:
  """Loads a YAML config over the defaults of base.yml, with its `base_config:` parents. Returns (values, sources).

  Every file of the chain is checked like the command line: a key that base.yml does not have is an error,
  and each value is converted to the type of its base.yml default (the error names the file).

  Args:
    path: the config file named on the command line.
    defaults: base_defaults(), when the caller has already read them.
  """
  defaults = base_defaults() if defaults is None else defaults
  values = dict(defaults)
  sources = dict.fromkeys(defaults, display_path(BASE_YML))
  for file_path, data in _config_chain(path):
    if os.path.samefile(file_path, BASE_YML):
      continue  # its values are the defaults already
    name = display_path(file_path)
    for key, value in flatten_nested(data, name).items():
      if key not in defaults:
        raise ConfigError(f"unknown config key '{key}' in {name}{closest_key_hint(key, defaults)}")
      values[key], sources[key] = coerce_value(key, value, defaults[key], where=name), name
  return values, sources


# Keys that older upstream MaxText configs and scripts carry, retired upstream before its base.yml that this project
# follows: what replaced them (a close spelling would point elsewhere: enable_profiler is not enable_jax_profiler).
RETIRED_UPSTREAM_KEYS = {
  "enable_profiler": "upstream replaced it with profiler: profiler=xplane to profile (or nsys on GPUs), or leave it out",
  "vocab_relative_path": "upstream replaced it with tokenizer_path: tokenizer_path=<the tokenizer file>",
}


def closest_key_hint(key: str, candidates) -> str:
  if key in RETIRED_UPSTREAM_KEYS:
    return f"; {RETIRED_UPSTREAM_KEYS[key]}"
  match = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
  return f"; did you mean '{match[0]}'?" if match else ""


def show_value(value) -> str:
  """A value as the user wrote it: strings as they are, anything else in YAML flow style."""
  if isinstance(value, str):
    return value
  return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def _example(default) -> str:
  """A short example of a list value, for hints: the default, or its first elements when it is long."""
  for n in range(len(default), 0, -1):
    text = show_value(default[:n])
    if len(text) <= 60:
      return text if n == len(default) else f"{text[:-1]}, ...]"
  return f"[{show_value(default[0])}, ...]"


def _check_list_items(subject: str, value: list, default: list) -> None:
  """A list must nest like its default: a list of names, or a list of lists of names."""
  if default and all(isinstance(d, str) for d in default):
    if not all(isinstance(v, str) for v in value):
      raise ConfigError(f"{subject} must be a flat list of names, e.g. {_example(default)}")
  elif default and all(isinstance(d, list) and all(isinstance(n, str) for n in d) for d in default):
    if not all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in value):
      raise ConfigError(f"{subject} must be a list of lists of names, e.g. {_example(default)}")


# String keys whose choices include true and false (step_watchdog: auto | true | false): a YAML boolean
# (`step_watchdog: true` in a file, True from Python) is that word, as it is on the command line.
WORD_KEYS_WITH_BOOLEANS = {"step_watchdog"}


def coerce_value(key: str, value, default, where: str | None = None):
  """Converts a value to the type of the key's default in base.yml, or raises ConfigError naming it.

  The same rules hold for every layer: a string (CLI, environment, or a quoted YAML value) is read as YAML;
  an integer key takes an integral number (`1e5` is 100000); a number key takes an integer; a list must
  nest like its default.

  Args:
    key: the config key.
    value: a CLI/env string, or a value read from a YAML file or given from Python.
    default: the key's default in base.yml (its type is the key's type; None means any YAML value).
    where: the file the value comes from (for the message), or None for the command line and environment.
  """
  subject = f"{key}={show_value(value)}" if where is None else f"{key}: {show_value(value)} in {where}"
  expected = type(default)
  if expected is str:
    if value is None:  # `key:` with nothing after it in YAML
      return ""
    if key in WORD_KEYS_WITH_BOOLEANS and (isinstance(value, bool) or str(value).lower() in ("true", "false")):
      return str(value).lower()
    if not isinstance(value, str):
      raise ConfigError(f'{subject} is not a string; quote it, e.g. "{show_value(value)}"')
    return value
  parsed = value
  if isinstance(value, str):
    parsed = parse_yaml(value, f"value of '{key}'") if value.strip() else None
  if default is None or expected not in (bool, int, float, list, dict):
    if isinstance(parsed, float) and not math.isfinite(parsed):  # a key of null default (typed by its Key's kind)
      raise ConfigError(f"{subject} must be a finite number (e.g. 0.5 or 3e-4)")
    return parsed
  if expected is bool:
    if not isinstance(parsed, bool):
      raise ConfigError(f"{subject} is not a boolean: use true or false")
    return parsed
  if expected is int:
    if isinstance(parsed, float) and parsed.is_integer():
      parsed = int(parsed)
    if not isinstance(parsed, int) or isinstance(parsed, bool):
      raise ConfigError(f"{subject} is not an integer")
    return parsed
  if expected is float:
    if isinstance(parsed, str) and parsed.strip().lower().lstrip("+-.") in ("inf", "infinity", "nan"):
      raise ConfigError(f"{subject} must be a finite number (e.g. 0.5 or 3e-4)")
    if not isinstance(parsed, (int, float)) or isinstance(parsed, bool):
      raise ConfigError(f"{subject} is not a number (e.g. 0.5 or 3e-4)")
    if not math.isfinite(parsed):
      raise ConfigError(f"{subject} must be a finite number (e.g. 0.5 or 3e-4)")
    return float(parsed)
  if expected is dict:
    if parsed is None:
      return {}
    if not isinstance(parsed, dict) or not all(isinstance(k, str) for k in parsed):
      raise ConfigError(f"{subject} is not a mapping of keys: write {key}.<key>=value, or {key}: {{<key>: value}} in YAML")
    return parsed
  if not isinstance(parsed, list):
    example = f'{key}="{_example(default)}"' if where is None else f"{key}: {_example(default)}"
    raise ConfigError(f"{subject} is not a list: write it in YAML syntax, e.g. {example}")
  _check_list_items(subject, parsed, default)
  return parsed


def parse_cli(args: list[str]) -> dict[str, str]:
  """Parses `key=value` arguments (after the config path).

  A key given twice takes its last value, as upstream MaxText's scripts expect; two different values are warned
  about (the same value twice is not).
  """
  overrides = {}
  for arg in args:
    if "=" not in arg:
      raise ConfigError(f"argument '{arg}' is not of the form key=value")
    key, value = arg.split("=", 1)
    key = key.strip()
    if key.startswith("--"):
      raise ConfigError(f"argument '{arg}': write overrides as {key[2:]}=value, without leading dashes")
    if "." in key and key.split(".", 1)[0] in NESTED_MAPPINGS:  # upstream's lora.lora_rank=16
      key = key.split(".", 1)[1]
    if "." in key and key.split(".", 1)[0] in MAPPING_KEYS and not key.split(".", 1)[1]:
      raise ConfigError(f"argument '{arg}' names no key: write {key}<key>=value")
    if key in overrides and overrides[key] != value:
      max_logging.warn(f"'{key}' is given twice on the command line ({key}={overrides.pop(key)} and {arg}): the last wins")
    overrides.pop(key, None)  # the last one's place, for the order in which the values are applied
    overrides[key] = value
  return overrides


def _mapping_entry(key: str) -> tuple[str, str] | None:
  """(mapping key, entry) of `teacher_overrides.<entry>`; None for any other key."""
  mapping, dot, entry = key.partition(".")
  return (mapping, entry) if dot and mapping in MAPPING_KEYS and entry else None


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


def load_model_preset(model_name: str, config_dir: str) -> tuple[dict, str]:
  """The mapping of configs/models/<model_name>.yml (next to the config file, else MaxText's) and its path."""
  for d in (os.path.join(config_dir, "models"), os.path.join(CONFIGS_DIR, "models")):
    path = os.path.join(d, f"{model_name}.yml")
    if os.path.isfile(path):
      return _read_yaml_mapping(path), display_path(path)
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
  defaults = base_defaults()
  values, sources = load_config_file(config_path, defaults)
  cli = parse_cli(argv[2:])
  env = env_overrides(environ, defaults)
  both = sorted(set(cli) & set(env))
  if both:
    raise ConfigError(f"key '{both[0]}' is set both on the command line and by {ENV_PREFIX}{both[0].upper()}; keep one")
  overrides = {k: (v, SOURCE_ENV) for k, v in env.items()}
  overrides.update({k: (v, SOURCE_CLI) for k, v in cli.items()})
  overrides.update({k: (v, SOURCE_KWARGS) for k, v in (kwargs or {}).items()})
  for key in overrides:
    if key not in defaults and _mapping_entry(key) is None:
      raise ConfigError(f"unknown config key '{key}'{closest_key_hint(key, defaults)}")
  typed = {}
  for key, (value, src) in overrides.items():
    entry = _mapping_entry(key)
    if entry is not None:  # teacher_overrides.<key>=value
      key, value = entry[0], {entry[1]: value}
    value = coerce_value(key, value, defaults[key])
    if key in MAPPING_KEYS:  # merged into the mapping below it (a file's, or an earlier override's)
      value = {**typed.get(key, (values[key],))[0], **value}
    typed[key] = (value, src)

  model_name = typed["model_name"][0] if "model_name" in typed else values["model_name"]
  if model_name != "default":
    preset, preset_path = load_model_preset(model_name, os.path.dirname(os.path.abspath(config_path)))
    allow_override = typed.get("override_model_config", (values["override_model_config"],))[0]
    clashes = sorted(set(preset) & set(typed))
    if clashes and not allow_override:
      raise ConfigError(
        f"model_name={model_name} sets {', '.join(clashes)}, which you also override; "
        "pass override_model_config=true to let your value win"
      )
    for key, value in preset.items():
      if key not in defaults:
        raise ConfigError(f"model preset '{model_name}' sets unknown key '{key}'{closest_key_hint(key, defaults)}")
      value = coerce_value(key, value, defaults[key], where=preset_path)
      if key == "logical_axis_rules":
        value = merge_logical_axis_rules(values[key], value)
      values[key], sources[key] = value, f"{SOURCE_MODEL} {model_name}"

  for key, (value, src) in typed.items():
    values[key], sources[key] = value, src
  values["config_path"] = config_path
  sources["config_path"] = SOURCE_CLI
  return values, sources
