"""The one validated, frozen config that every module reads.

    config = pyconfig.initialize(["train.py", "MaxText/configs/base.yml", "run_name=x", "steps=10"])
    config.emb_dim, config.global_batch_size_to_train_on, config.source("steps")

Order: YAML (with base_config parents) < model preset < M_<KEY> environment < command line < kwargs.
`--help` among the arguments prints every key instead (config_schema) and exits.
Static checks run before JAX is imported; then the devices are looked up (initialising jax.distributed
when a cluster environment asks for it) to fill -1 parallelism values and the global batch sizes.
"""

import math
import os
import sys

import yaml

from MaxText import max_logging
from MaxText.configuration import (
  attention_selection,
  common_types,
  config_loader,
  config_schema,
  config_validation,
  mesh_parallelism,
  pipeline_schedule,
  rl_config,
)
from MaxText.diagnostics import numerics_config
from MaxText.errors import ConfigError
from MaxText.input_pipeline import tokenizer_assets
from MaxText.layers import quant_rules
from MaxText.runtime import xla_flag_presets

SOURCE_DERIVED = "derived"


class Config:
  """Read-only mapping of config keys, accessed as attributes (`config.steps`)."""

  def __init__(self, values: dict, sources: dict):
    object.__setattr__(self, "_values", dict(values))
    object.__setattr__(self, "_sources", dict(sources))

  def __getattr__(self, key):
    if key.startswith("__"):  # pickle and copy probe dunder methods before the values exist
      raise AttributeError(key)
    try:
      return self._values[key]
    except KeyError:
      raise AttributeError(f"config has no key '{key}'") from None

  def __setattr__(self, key, value):
    raise AttributeError(f"config is frozen; set '{key}' on the command line or in the YAML instead")

  def __contains__(self, key):
    return key in self._values

  def get_keys(self) -> dict:
    return dict(self._values)

  def source(self, key: str) -> str:
    """Where a value came from: a YAML file, a model preset, the command line, the environment or derived."""
    return self._sources.get(key, SOURCE_DERIVED)

  def replace(self, **values) -> "Config":
    """A copy with some values replaced as they are (nothing is derived again): for variants of one program."""
    return Config({**self._values, **values}, {**self._sources, **dict.fromkeys(values, SOURCE_DERIVED)})

  def to_yaml(self) -> str:
    """The resolved config, each line annotated with the source of its value."""
    lines = []
    for key in sorted(self._values):
      value = _plain(self._values[key])
      if key in _SECRET_KEYS and value:
        value = "<set, not shown>"  # the resolved config goes to logs and the run directory
      text = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000).strip()
      text = text[1:-1] if text.startswith("{") else text
      lines.append(f"{text}  # {self.source(key)}")
    return "\n".join(lines) + "\n"


_SECRET_KEYS = ("hf_access_token",)


def _plain(value):
  """Tuples to lists and parsed objects (numerics_debug) to their YAML, so that the resolved config reads back as
  the YAML it came from."""
  if hasattr(value, "to_plain"):
    return value.to_plain()
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def _set(values, sources, key, value):
  values[key] = value
  sources[key] = SOURCE_DERIVED


def _normalise(values, key, value):
  """Replaces a value by its normal form (a tuple, an absolute path); it keeps the source of what the user gave."""
  values[key] = value


def _is_remote(path: str) -> bool:
  return "://" in path


def scaled_dims(values, sources):
  """Splits log2(global_parameter_scale) over heads/mlp, emb and layers, as upstream MaxText does."""
  log_scale = int(math.log2(values["global_parameter_scale"]))
  base, rem = divmod(log_scale, 3)
  head_scale = base + int(rem > 0)
  emb_scale = base + int(rem > 1)
  _set(values, sources, "emb_dim", 2**emb_scale * values["base_emb_dim"])
  _set(values, sources, "num_query_heads", 2**head_scale * values["base_num_query_heads"])
  _set(values, sources, "num_kv_heads", 2**head_scale * values["base_num_kv_heads"])
  _set(values, sources, "mlp_dim", 2**head_scale * values["base_mlp_dim"])
  _set(values, sources, "moe_mlp_dim", 2**head_scale * values["base_moe_mlp_dim"])
  _set(values, sources, "num_decoder_layers", 2**base * values["base_num_decoder_layers"])


def resolve_asset_path(path: str, config_path: str) -> str | None:
  """Finds a file (or directory) given relative to the cwd, the MaxText package or the config's directory."""
  if not path or _is_remote(path):
    return path
  candidates = [path]
  if not os.path.isabs(path):
    candidates += [
      os.path.join(config_loader.PACKAGE_DIR, path),
      os.path.join(os.path.dirname(config_loader.PACKAGE_DIR), path),  # MaxText/..., as upstream's scripts write it
      os.path.join(os.path.dirname(os.path.abspath(config_path)), path),
    ]
  for candidate in candidates:
    if os.path.exists(candidate):
      return os.path.abspath(candidate)
  return None


def _local_file(values, key: str, kind: str) -> str:
  """The absolute path of the local file that `key` names (found as resolve_asset_path finds it), now its value."""
  found = resolve_asset_path(values[key], values["config_path"])
  if found is None or _is_remote(found):
    raise ConfigError(
      f"{key}={values[key]} does not exist (a local {kind} file; tried the cwd, {config_loader.PACKAGE_DIR} and the "
      "config's directory)"
    )
  _normalise(values, key, found)
  return found


def _numerics_debug(values, sources):
  """Parses numerics_debug_config once into the derived numerics_debug, the typed NumericsDebugConfig that the run
  carries (empty when off); the resolved config and the compiled step's signature hold its canonical content
  (to_plain). A mistake in the file is a ConfigError naming the section and field."""
  path, parsed = values["numerics_debug_config"], numerics_config.NumericsDebugConfig()
  if path:
    found = _local_file(values, "numerics_debug_config", "YAML")
    blocks = common_types.num_blocks(values["decoder_block"], values["num_decoder_layers"])
    parsed = numerics_config.load(found, blocks)
    ignored = parsed.ignored_by(values["quantization"])
    if ignored:
      max_logging.warn(f"numerics_debug_config={path}: {ignored}; ignored in this run")
  _set(values, sources, "numerics_debug", parsed)


def _quant_rules(values, sources):
  """Parses quant_cfg_path once into the derived quant_rules (quant_rules.QuantRules) that quantization=intmp reads."""
  path, parsed = values["quant_cfg_path"], None
  if values["quantization"] == "intmp":
    if not path:
      raise ConfigError(
        "quantization=intmp reads each layer's bits from quant_cfg_path: give a JSON file such as "
        f"{config_loader.PACKAGE_DIR}/configs/quantization/mp_scale.json (or quantization=int8w|int4w for one setting)"
      )
    parsed = quant_rules.load(_local_file(values, "quant_cfg_path", "JSON"))
  _set(values, sources, "quant_rules", parsed)


def _warn_unused_companions(values, sources):
  """Keys set (not left at base.yml's default) while the switch they act with (config_schema) is off are warned about."""
  for switch, keys in config_schema.switches().items():
    given = [f"{key}={config_loader.show_value(values[key])}" for key in keys if config_loader.set_by_user(sources, key)]
    if given and not switch.is_on(values[switch.key]):
      verb = "acts" if len(given) == 1 else "act"
      max_logging.warn(f"{', '.join(given)}: {verb} only with {switch}; ignored in this run")


# The keys that only one dataset_type reads: setting one with dataset_type left at its default chooses that type.
_DATASET_KEYS = {
  "dataset_path": "tfds",
  "grain_train_files": "grain",
  "grain_eval_files": "grain",
  "hf_path": "hf",
  "hf_train_files": "hf",
  "hf_eval_files": "hf",
  "hf_data_dir": "hf",
}


def _dataset_type_from_its_keys(values, sources):
  """Upstream's default dataset_type is tfds, ours the embedded corpus: a config that names a dataset_path (as
  upstream's scripts do) without dataset_type must not train on the built-in text. With dataset_type left at its
  default, the keys of one other type choose it (one line says so); keys of two types at once are an error."""
  if config_loader.set_by_user(sources, "dataset_type"):
    return
  chosen = {}
  for key, dataset_type in _DATASET_KEYS.items():
    if values[key]:
      chosen.setdefault(dataset_type, key)
  if len(chosen) > 1:
    named = " and ".join(f"{key} (dataset_type={t})" for t, key in chosen.items())
    raise ConfigError(f"{named} are both set: set dataset_type to the one to read, and leave the other's keys empty")
  if chosen:
    [(dataset_type, key)] = chosen.items()
    _set(values, sources, "dataset_type", dataset_type)
    max_logging.log(f"Using dataset_type={dataset_type}, because {key} is set (dataset_type was left at its default)")


def _dpo_data(values, sources):
  """use_dpo turns the default packing off: a pair's two rows must stay one row (input_pipeline/dpo.py)."""
  if not values["use_dpo"]:
    return
  if values["use_sft"]:
    raise ConfigError(
      "use_sft=true and use_dpo=true are both set: SFT trains on chat samples, DPO on preference pairs; set one"
    )
  if values["packing"] and config_loader.set_by_user(sources, "packing"):
    raise ConfigError("use_dpo=true needs packing=false (each row holds one preference pair): leave packing unset")
  _set(values, sources, "packing", False)


def _default_axes_within_mesh_axes(values, sources):
  """A mesh_axes without some of base.yml's axes (upstream's has no `expert`): data_sharding and logical_axis_rules,
  where left at their defaults, name only the axes it has. Rules that the user wrote are checked as written."""
  axes = set(values["mesh_axes"]) if isinstance(values["mesh_axes"], list) else None
  if axes is None or not config_loader.set_by_user(sources, "mesh_axes"):
    return
  if not config_loader.set_by_user(sources, "data_sharding"):
    values["data_sharding"] = [[a for a in group if a in axes] for group in values["data_sharding"]]
  if not config_loader.set_by_user(sources, "logical_axis_rules"):
    rules = []
    for name, mapped in values["logical_axis_rules"]:
      if isinstance(mapped, list):
        mapped = [a for a in mapped if a in axes] or None
      elif mapped not in axes:
        mapped = None  # replicated
      rules.append([name, mapped])
    values["logical_axis_rules"] = rules


def _derive_static(values, sources, environ):
  if not values["run_name"] and environ.get("JOBSET_NAME"):
    values["run_name"], sources["run_name"] = environ["JOBSET_NAME"], f"{config_loader.SOURCE_ENV} JOBSET_NAME"
    config_validation.check_run_name(values["run_name"], origin="JOBSET_NAME")
  scaled_dims(values, sources)
  _dataset_type_from_its_keys(values, sources)
  _dpo_data(values, sources)
  rl_config.derive_static(values, sources, _set)
  _numerics_debug(values, sources)
  _quant_rules(values, sources)
  _warn_unused_companions(values, sources)
  out = str(values["base_output_directory"]) or "."  # upstream's default "": the current directory
  if not _is_remote(out):
    _normalise(values, "base_output_directory", os.path.abspath(os.path.expanduser(out)))
  run_dir = os.path.join(values["base_output_directory"], values["run_name"]) if values["run_name"] else ""
  for key, sub in (
    ("run_dir", ""),
    ("tensorboard_dir", "tensorboard"),
    ("checkpoint_dir", "checkpoints"),
    ("metrics_dir", "metrics"),
  ):
    _set(values, sources, key, os.path.join(run_dir, sub) if run_dir and sub else run_dir)
  if values["learning_rate_schedule_steps"] == -1:
    _set(values, sources, "learning_rate_schedule_steps", values["steps"])
  if values["steps"] == -1:
    _set(values, sources, "steps", values["learning_rate_schedule_steps"])
  for key in ("load_parameters_path", "load_full_state_path"):  # Orbax reads absolute paths only
    if values[key] and not _is_remote(values[key]):
      _normalise(values, key, os.path.abspath(os.path.expanduser(values[key])))
  if values["jax_cache_dir"] and not _is_remote(values["jax_cache_dir"]):
    _normalise(values, "jax_cache_dir", os.path.expanduser(values["jax_cache_dir"]))
  if values["dataset_type"] != "synthetic" and (values["tokenize_train_data"] or values["tokenize_eval_data"]):
    found = resolve_asset_path(values["tokenizer_path"], values["config_path"])
    if found is None and (found := tokenizer_assets.from_package(values["tokenizer_path"])):
      max_logging.log(f"tokenizer_path={values['tokenizer_path']} is upstream's asset, not shipped here: using {found}")
    if found is None:
      raise ConfigError(tokenizer_assets.missing(values["tokenizer_path"], config_loader.PACKAGE_DIR))
    _normalise(values, "tokenizer_path", found)
  _normalise(values, "mesh_axes", tuple(values["mesh_axes"]))
  _normalise(values, "data_sharding", tuple(tuple(axes) for axes in values["data_sharding"]))
  rules = tuple((name, tuple(a) if isinstance(a, (list, tuple)) else a) for name, a in values["logical_axis_rules"])
  _normalise(values, "logical_axis_rules", rules)
  _normalise(values, "mlp_activations", tuple(values["mlp_activations"]))


def _check_hardware(hardware: str, devices) -> None:
  """hardware=gpu|gpu_multiprocess|tpu on a host whose JAX has no such devices is a mistake, not a CPU run."""
  wanted = {"gpu_multiprocess": "gpu"}.get(hardware, hardware)
  platform = devices[0].platform.lower()
  found = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
  if wanted in ("gpu", "tpu") and found != wanted:
    raise ConfigError(
      f"hardware={hardware} but JAX finds {found} devices on this host: install jax for it (bash setup.sh "
      f"DEVICE={wanted}) on a {wanted} host, or leave hardware=auto"
    )


def _derive_device_values(values, sources, devices):
  """Values that depend on the devices: hardware, attention kernel, mesh shape and global batch sizes."""
  platform = devices[0].platform.lower()
  detected = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
  if values["hardware"] == "auto":
    _set(values, sources, "hardware", detected if detected in ("cpu", "gpu", "tpu") else "cpu")
  kernel = attention_selection.select(values, detected)
  if kernel != values["attention"]:  # autoselected, resolved
    _set(values, sources, "attention", kernel)

  from MaxText.runtime.mesh import count_slices  # pylint: disable=import-outside-toplevel  # (imports jax)

  num_slices = count_slices(devices)
  if values["num_slices"] not in (-1, num_slices):  # upstream's key: accepted where it matches
    raise ConfigError(f"num_slices={values['num_slices']}, but the devices form {num_slices} slice(s); leave it at -1")
  num_devices = len(devices)
  if values["num_slices"] != num_slices:
    _set(values, sources, "num_slices", num_slices)
  _set(values, sources, "num_devices", num_devices)
  if num_slices == 1:
    mesh_parallelism.check_no_dcn(values)
  dcn = mesh_parallelism.fill(values, "dcn", num_slices, "slices") if num_slices > 1 else [1] * len(values["mesh_axes"])
  ici = mesh_parallelism.fill(values, "ici", num_devices // num_slices, "devices per slice")
  _set(values, sources, "ici_parallelism", tuple(ici))
  _set(values, sources, "dcn_parallelism", tuple(dcn))

  pdbs = values["per_device_batch_size"]
  rows = num_devices * pdbs
  if abs(rows - round(rows)) > 1e-6 or round(rows) < 1:
    raise ConfigError(
      f"per_device_batch_size={pdbs} x {num_devices} devices = {rows:g} rows; it must make a whole number of rows, "
      "at least 1"
    )
  micro_train = int(round(rows))
  mesh_shape = dict(zip(values["mesh_axes"], (i * d for i, d in zip(ici, dcn))))
  attention_selection.check_length_sharding(values, mesh_shape)
  batch_shards = math.prod(mesh_shape[a] for a in values["data_sharding"][0])
  # With fewer rows than batch shards (fractional per_device_batch_size), load one row per device and
  # train on the first rows only, as upstream MaxText does.
  micro_load = micro_train if micro_train % batch_shards == 0 or pdbs >= 1 else num_devices
  if micro_load % batch_shards:
    raise ConfigError(
      f"per_device_batch_size={pdbs} gives {micro_load} rows per microbatch, which cannot be split evenly over the "
      f"{batch_shards} batch shards of data_sharding {list(values['data_sharding'][0])}"
    )
  _check_wgrad_shards(values, num_slices, micro_load)
  eval_pdbs = values["eval_per_device_batch_size"] or pdbs
  eval_rows = num_devices * eval_pdbs
  eval_load = int(round(eval_rows)) if eval_rows >= batch_shards else num_devices
  if abs(eval_rows - round(eval_rows)) > 1e-6 or eval_load % batch_shards:
    raise ConfigError(
      f"eval_per_device_batch_size={eval_pdbs} x {num_devices} devices = {eval_rows:g} rows: it must be a whole number "
      f"that the {batch_shards} batch shards split evenly"
    )
  _set(values, sources, "global_batch_size_to_load_eval", eval_load)
  ga = values["gradient_accumulation_steps"]
  _set(values, sources, "micro_batch_size_to_train_on", micro_train)
  _set(values, sources, "micro_batch_size_to_load", micro_load)
  _set(values, sources, "global_batch_size_to_train_on", micro_train * ga)
  _set(values, sources, "global_batch_size_to_load", micro_load * ga)
  rl_config.check_batch(values, batch_shards)
  schedule = pipeline_schedule.resolve(values)
  if schedule is not None:
    pipeline_schedule.microbatch_shards(values, schedule, mesh_shape)
    _set(values, sources, "num_pipeline_repeats", schedule.repeats)
    _set(values, sources, "num_pipeline_microbatches", schedule.microbatches)


def _check_wgrad_shards(values, num_slices: int, rows: int):
  """int8's wgrad splits the rows into quantization_local_shard_count parts (-1: num_slices) with their own scales,
  so they must divide the microbatch."""
  shards = quant_rules.wgrad_parts(values["quantization_local_shard_count"], num_slices)
  if values["quantization"] == "int8" and shards > 1 and rows % shards:
    raise ConfigError(
      f"quantization_local_shard_count={shards} splits int8's wgrad over the {rows} rows of a microbatch: it must divide "
      "them (or 1: one scale per channel; 0: wgrad in high precision)"
    )


def _compile_topology_devices(values) -> list:
  """The devices of the AOT target that compile_topology (x compile_topology_num_slices) names."""
  from MaxText.runtime import aot_targets  # pylint: disable=import-outside-toplevel

  if not values["compile_topology"]:
    raise ConfigError(
      "compile_topology is empty: name the target hardware, e.g. compile_topology=v5e-256 (or cpu-8 for this host)"
    )
  num_slices = values["compile_topology_num_slices"]  # -1 or positive (config_schema)
  target = aot_targets.lookup(values["compile_topology"])
  return aot_targets.devices(target, max(num_slices, 1))


HELP_FLAGS = ("-h", "--help")


def exit_with_help_if_asked(argv: list[str]) -> None:
  """`--help` (or `-h`) anywhere after the program: prints every config key (config_schema) and exits 0, before JAX."""
  if any(arg in HELP_FLAGS for arg in argv[1:]):
    try:
      config_schema.print_help(sys.stdout)
      sys.stdout.flush()
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted
      sys.stdout = None
    sys.exit(0)


_REQUIRED_HINTS = {"run_name": "name the run, e.g. run_name=demo (outputs go to base_output_directory/run_name)"}


def load_static(argv: list[str], environ, reads_data: bool = True, **kwargs) -> tuple[dict, dict]:
  """(values, sources) of a command line, validated and with what needs no devices derived; JAX is not imported.

  The first half of initialize, for tools that check a config before they start a process that uses it.
  """
  values, sources = config_loader.load_raw_config(argv, environ, kwargs)
  _default_axes_within_mesh_axes(values, sources)
  config_validation.validate_static(values, reads_data)
  _derive_static(values, sources, environ)
  return values, sources


def initialize(
  argv: list[str],
  environ=None,
  required_keys: tuple[str, ...] = (),
  devices=None,
  for_compile_topology=False,
  reads_data=True,
  **kwargs,
) -> Config:
  """Loads, validates and derives the config.

  Args:
    argv: [program, config.yml, key=value, ...], as on the command line.
    environ: environment for M_<KEY> overrides and cluster detection (default os.environ).
    required_keys: keys that must not be empty for this entry point (e.g. run_name for training).
    devices: the devices the config is for (e.g. those of an AOT topology); default jax.devices().
    for_compile_topology: the config is for the devices of compile_topology (train_compile.py), not the local ones.
    reads_data: whether the entry point reads the training data: decode.py and other tools that do not are not held
      to the data keys (a run's config, e.g. configs/sft.yml with hf_train_files left to the command line, decodes).
    **kwargs: typed overrides that win over the command line (for tests).
  """
  exit_with_help_if_asked(argv)
  environ = os.environ if environ is None else environ
  values, sources = load_static(argv, environ, reads_data, **kwargs)
  for key in required_keys:
    if not values[key]:
      raise ConfigError(f"{key} is empty: {_REQUIRED_HINTS.get(key, 'set it on the command line')}")

  # JAX only after the cheap checks.
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.runtime import cluster, jax_runtime  # pylint: disable=import-outside-toplevel

  if not jax_runtime.backends_started():  # what XLA would abort on when it reads XLA_FLAGS
    xla_flag_presets.check_user_flags(environ)
  xla_flag_presets.apply(values["xla_flags_preset"], environ)  # before a backend starts and reads XLA_FLAGS
  if for_compile_topology:
    devices = _compile_topology_devices(values)
  if devices is None:  # given devices (an AOT topology, a test) need no cluster
    jax_runtime.skip_absent_tpu(values["hardware"], environ)
    cluster.initialize(
      values["jax_distributed_init"],
      values["hardware"],
      values["distributed_init_timeout"],
      environ,
      heartbeat_timeout_s=values["distributed_heartbeat_timeout"],
    )
    devices = jax.devices()
    _check_hardware(values["hardware"], devices)
  _derive_device_values(values, sources, devices)
  return Config(values, sources)
