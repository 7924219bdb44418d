"""Config loading, typing, sources and derived values."""

import os

import pytest
import yaml

from MaxText import pyconfig
from MaxText.configuration import config_loader
from MaxText.errors import ConfigError
from MaxText.tests.helpers import BASE_YML, tiny_args, tiny_config


def test_cli_values_are_typed_by_the_base_default():
  c = tiny_config("learning_rate=3e-3", "adam_eps=1e-8", "steps=1_000", "scan_layers=FALSE", "mlp_activations=[gelu]")
  assert c.learning_rate == 0.003 and isinstance(c.learning_rate, float)
  assert c.adam_eps == 1e-8
  assert c.steps == 1000 and isinstance(c.steps, int)
  assert c.scan_layers is False
  assert c.mlp_activations == ("gelu",)


def test_float_key_accepts_an_integer_and_yaml_e_notation_is_a_float(tmp_path):
  cfg = tmp_path / "c.yml"
  cfg.write_text(f"base_config: {BASE_YML}\nlearning_rate: 1e-4\nadam_eps: 3E-9\n")
  c = pyconfig.initialize(["t", str(cfg), "run_name=x", "per_device_batch_size=2"], environ={})
  assert c.learning_rate == 1e-4 and c.adam_eps == 3e-9
  assert c.per_device_batch_size == 2.0 and isinstance(c.per_device_batch_size, float)


def test_sources_record_where_each_value_came_from(tmp_path):
  cfg = tmp_path / "child.yml"
  cfg.write_text(f"base_config: {BASE_YML}\nsteps: 7\n")
  c = pyconfig.initialize(["t", str(cfg), "run_name=x", "learning_rate=0.5"], environ={"M_LOG_PERIOD": "3"})
  assert c.source("learning_rate") == "command line"
  assert c.source("log_period") == "environment" and c.log_period == 3
  assert c.source("steps").endswith("child.yml") and c.steps == 7
  assert c.source("adam_b1").endswith("base.yml")
  assert c.source("emb_dim") == "derived"
  assert "steps: 7  # " in c.to_yaml()


def test_config_is_frozen():
  c = tiny_config()
  with pytest.raises(AttributeError, match="frozen"):
    c.steps = 3
  with pytest.raises(AttributeError, match="no key"):
    _ = c.not_a_key


@pytest.mark.parametrize(
  "scale,expected",
  [
    (1, (2048, 16, 7168, 16)),
    (2, (2048, 32, 14336, 16)),
    (4, (4096, 32, 14336, 16)),
    (8, (4096, 32, 14336, 32)),
    (16, (4096, 64, 28672, 32)),
    (128, (8192, 128, 57344, 64)),
  ],
)
def test_global_parameter_scale_matches_upstream(scale, expected):
  c = pyconfig.initialize(
    ["t", BASE_YML, "run_name=x", f"global_parameter_scale={scale}", "per_device_batch_size=1"], environ={}
  )
  assert (c.emb_dim, c.num_query_heads, c.mlp_dim, c.num_decoder_layers) == expected
  assert c.head_dim == 128


def test_model_preset_overrides_base_and_merges_axis_rules():
  c = pyconfig.initialize(["t", BASE_YML, "run_name=x", "model_name=llama2-7b", "per_device_batch_size=1"], environ={})
  assert (c.emb_dim, c.num_query_heads, c.num_kv_heads, c.mlp_dim, c.num_decoder_layers) == (4096, 32, 32, 11008, 32)
  assert c.source("base_emb_dim") == "model preset llama2-7b"
  rules = dict((name, axes) for name, axes in reversed(c.logical_axis_rules))
  assert rules["norm"] == "fsdp"
  assert [r[0] for r in c.logical_axis_rules].count("norm") == 1


def test_cli_cannot_silently_override_a_preset_key():
  with pytest.raises(ConfigError, match="override_model_config=true"):
    pyconfig.initialize(["t", BASE_YML, "run_name=x", "model_name=llama2-7b", "base_emb_dim=8"], environ={})
  c = pyconfig.initialize(
    [
      "t",
      BASE_YML,
      "run_name=x",
      "model_name=llama2-7b",
      "base_emb_dim=64",
      "override_model_config=true",
      "per_device_batch_size=1",
    ],
    environ={},
  )
  assert c.emb_dim == 64 and c.source("base_emb_dim") == "command line"


def test_derived_paths_and_schedule(tmp_path):
  c = tiny_config("steps=50", tmp_path=tmp_path)
  assert c.run_dir == os.path.join(str(tmp_path), "test")
  assert c.checkpoint_dir == os.path.join(str(tmp_path), "test", "checkpoints")
  assert c.tensorboard_dir == os.path.join(str(tmp_path), "test", "tensorboard")
  assert c.learning_rate_schedule_steps == 50
  assert os.path.isfile(c.tokenizer_path)


def test_gs_output_directory_is_kept_as_is():
  c = tiny_config("base_output_directory=gs://bucket/runs")
  assert c.tensorboard_dir == "gs://bucket/runs/test/tensorboard"


def test_defaults_resolve_for_this_machine():
  c = tiny_config()
  assert c.hardware == "cpu" and c.attention == "dot_product"
  assert c.num_devices == 1 and c.ici_parallelism == (1,) * len(c.mesh_axes)


def test_global_batch_sizes():
  c = tiny_config("per_device_batch_size=3", "gradient_accumulation_steps=4")
  assert (c.micro_batch_size_to_train_on, c.global_batch_size_to_train_on, c.global_batch_size_to_load) == (3, 12, 12)


def test_fractional_per_device_batch_size_loads_one_row_per_device_as_upstream():
  # 4 devices are faked by passing the devices list directly.
  values, sources = config_loader.load_raw_config(["t", BASE_YML, "run_name=x", "per_device_batch_size=0.25"], {})
  pyconfig._derive_static(values, sources, {})  # pylint: disable=protected-access

  class FakeDevice:
    platform = "cpu"
    process_index = 0

  pyconfig._derive_device_values(values, sources, [FakeDevice()] * 8)  # pylint: disable=protected-access
  assert values["micro_batch_size_to_train_on"] == 2
  assert values["micro_batch_size_to_load"] == 8  # 2 rows cannot be split over 8 fsdp shards
  assert values["ici_parallelism"][values["mesh_axes"].index("fsdp")] == 8


def test_environment_and_cli_cannot_both_set_a_key():
  with pytest.raises(ConfigError, match="both on the command line and by M_STEPS"):
    pyconfig.initialize(["t", BASE_YML, "run_name=x", "steps=3"], environ={"M_STEPS": "4"})


def test_logical_axis_rules_merge_keeps_base_order():
  merged = config_loader.merge_logical_axis_rules([["a", "x"], ["b", "y"], ["a", "z"]], [["a", "w"]])
  assert merged == [["b", "y"], ["a", "w"]]


class FakeDevice:
  """What pyconfig reads of a device: its platform, its slice and its process."""

  def __init__(self, slice_index=0, platform="cpu", process_index=0):
    self.slice_index = slice_index
    self.platform = platform
    self.process_index = process_index


def _child(tmp_path, text, name="child.yml"):
  path = tmp_path / name
  path.write_text(f"base_config: {BASE_YML}\n{text}")
  return str(path)


def test_file_values_are_typed_by_base_yml_like_the_cli(tmp_path):
  cfg = _child(tmp_path, "steps: 1e5\nlearning_rate: 3.e-5\nvocab_size: 32_000\nmlp_activations: [gelu]\n")
  c = pyconfig.initialize(["t", cfg, "run_name=x", "per_device_batch_size=1"], environ={})
  assert c.steps == 100_000 and isinstance(c.steps, int)
  assert c.learning_rate == 3e-5 and c.vocab_size == 32_000 and c.mlp_activations == ("gelu",)


def test_an_integer_in_a_child_file_does_not_make_a_float_key_an_integer(tmp_path):
  cfg = _child(tmp_path, "per_device_batch_size: 2\n")
  values, _ = config_loader.load_raw_config(["t", cfg, "run_name=x", "per_device_batch_size=0.5"], {})
  assert values["per_device_batch_size"] == 0.5
  values, _ = config_loader.load_raw_config(["t", cfg, "run_name=x"], {})
  assert values["per_device_batch_size"] == 2.0 and isinstance(values["per_device_batch_size"], float)


def test_a_config_outside_the_base_chain_is_typed_and_completed_by_base_yml(tmp_path):
  alone = tmp_path / "alone.yml"
  alone.write_text("steps: 5.0\nscan_layers: false\n")
  c = pyconfig.initialize(["t", str(alone), "run_name=x", "per_device_batch_size=1"], environ={})
  assert c.steps == 5 and isinstance(c.steps, int) and c.scan_layers is False
  assert c.source("steps").endswith("alone.yml") and c.source("adam_b1").endswith(os.path.join("configs", "base.yml"))
  alone.write_text("stpes: 5\n")
  with pytest.raises(ConfigError, match=r"unknown config key 'stpes' in .*alone.yml; did you mean 'steps'\?"):
    pyconfig.initialize(["t", str(alone), "run_name=x"], environ={})


def _cli_text(value) -> str:
  if isinstance(value, str):
    return value
  return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def test_every_key_set_on_the_command_line_keeps_that_source():
  # Values that pyconfig fills in (auto, autoselected, -1) are derived; every other value the user gives
  # keeps its source even when pyconfig normalises it (tuples, absolute paths, ~ expanded).
  filled = {"hardware": "cpu", "attention": "dot_product", "learning_rate_schedule_steps": 10, "steps": 10, "num_slices": 1}
  args = [f"{key}={_cli_text(filled.get(key, default))}" for key, default in config_loader.base_defaults().items()]
  c = pyconfig.initialize(["t", BASE_YML, *args], environ={})
  wrong = {key: c.source(key) for key in config_loader.base_defaults() if c.source(key) != "command line"}
  assert not wrong
  assert c.mesh_axes == tuple(config_loader.base_defaults()["mesh_axes"]) and os.path.isabs(c.tokenizer_path)
  assert "mlp_activations: [silu, linear]  # command line" in c.to_yaml()


NORMALISED_KEYS = {
  "mlp_activations": "[gelu]",
  "mesh_axes": "[data, stage, fsdp, fsdp_transpose, sequence, tensor, expert, autoregressive]",
  "data_sharding": "[[data, fsdp]]",
  "logical_axis_rules": "[[embed, fsdp]]",
  "base_output_directory": "relative_out",
  "tokenizer_path": "assets/tokenizer.default",
  "jax_cache_dir": "~/some_cache",
}


@pytest.mark.parametrize("key", sorted(NORMALISED_KEYS))
def test_a_normalised_value_keeps_its_source(tmp_path, key):
  text = NORMALISED_KEYS[key]
  from_cli = pyconfig.initialize(["t", BASE_YML, "run_name=x", f"{key}={text}"], environ={})
  assert from_cli.source(key) == "command line"
  assert [line for line in from_cli.to_yaml().splitlines() if line.startswith(f"{key}:")][0].endswith("# command line")
  from_env = pyconfig.initialize(["t", BASE_YML, "run_name=x"], environ={f"M_{key.upper()}": text})
  assert from_env.source(key) == "environment"
  cfg = _child(tmp_path, f"{key}: {text}\n")
  assert pyconfig.initialize(["t", cfg, "run_name=x"], environ={}).source(key).endswith("child.yml")


def test_preset_values_keep_the_preset_as_source():
  c = pyconfig.initialize(["t", BASE_YML, "run_name=x", "model_name=llama2-7b", "per_device_batch_size=1"], environ={})
  assert c.source("mlp_activations") == c.source("logical_axis_rules") == "model preset llama2-7b"


def test_dcn_parallelism_needs_more_than_one_slice():
  with pytest.raises(ConfigError, match="dcn_fsdp_parallelism=2 but there is one slice"):
    pyconfig.initialize(["t", BASE_YML, "run_name=x", "dcn_fsdp_parallelism=2"], environ={})
  two_slices = [FakeDevice(slice_index=i // 4, platform="gpu", process_index=i // 4) for i in range(8)]
  # CPU devices all say slice 0: each process of a multi-process CPU job is a slice.
  two_cpu_processes = [FakeDevice(slice_index=0, process_index=i // 4) for i in range(8)]
  for devices in (two_slices, two_cpu_processes):
    c = pyconfig.initialize(
      ["t", BASE_YML, "run_name=x", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2"], environ={}, devices=devices
    )
    fsdp = c.mesh_axes.index("fsdp")
    assert c.num_slices == 2 and c.dcn_parallelism[fsdp] == 2 and c.ici_parallelism[fsdp] == 4


@pytest.mark.parametrize("name", ["../elsewhere", "a/b", "..", ".", "a\\b", "/abs"])
def test_run_name_cannot_leave_the_output_directory(name):
  with pytest.raises(ConfigError, match="must be a single directory name"):
    pyconfig.initialize(["t", BASE_YML, f"run_name={name}"], environ={})


def test_run_name_from_jobset_name_is_checked_and_sourced():
  with pytest.raises(ConfigError, match=r"run_name=team/run \(from JOBSET_NAME\)"):
    pyconfig.initialize(["t", BASE_YML], environ={"JOBSET_NAME": "team/run"})
  c = pyconfig.initialize(["t", BASE_YML], environ={"JOBSET_NAME": "job-1.a..b"})
  assert c.run_name == "job-1.a..b" and c.source("run_name") == "environment JOBSET_NAME"


def test_keys_that_act_only_with_a_switch_are_warned_about_when_it_is_off(capsys):
  tiny_config("collect_stack_trace=true", "stack_trace_to_cloud=true", "profiler=xplane", "profiler_steps=3")
  assert "WARNING" not in capsys.readouterr().err
  tiny_config("stack_trace_to_cloud=true", "profiler_steps=3", "vertex_tensorboard_region=us-central1")
  err = capsys.readouterr().err
  assert "WARNING: stack_trace_to_cloud=true: acts only with collect_stack_trace=true; ignored in this run" in err
  assert "WARNING: profiler_steps=3: acts only with profiler=xplane|nsys; ignored in this run" in err
  assert "vertex_tensorboard_region=us-central1: acts only with use_vertex_tensorboard=true" in err
  tiny_config("step_watchdog=false", "step_watchdog_min_seconds=5")
  assert "step_watchdog_min_seconds=5: acts only with step_watchdog=auto|true" in capsys.readouterr().err


@pytest.mark.parametrize("hardware", ["gpu", "tpu"])
def test_hardware_that_this_host_lacks_is_a_config_error(hardware):
  wanted = "tpu" if hardware == "tpu" else "gpu"
  with pytest.raises(ConfigError, match=f"hardware={hardware} but JAX finds cpu devices on this host: .*DEVICE={wanted}"):
    tiny_config(f"hardware={hardware}")


def test_a_key_given_twice_on_the_command_line_takes_the_last_value_as_upstream(capsys):
  """Upstream's scripts give model_name and per_device_batch_size twice: the last wins, a change is warned about."""

  def config(*args):
    return pyconfig.initialize(["test", BASE_YML, "run_name=test", *tiny_args(), *args], environ={})

  assert config("steps=3", "steps=3").steps == 3
  assert "given twice" not in capsys.readouterr().err  # the same value twice: nothing to say
  assert config("steps=3", "steps=5").steps == 5
  warnings = [line for line in capsys.readouterr().err.splitlines() if "given twice" in line]
  assert warnings == ["WARNING: 'steps' is given twice on the command line (steps=3 and steps=5): the last wins"]


def test_dataset_keys_choose_the_dataset_type_left_at_its_default(tmp_path, capsys):
  """Upstream's default dataset_type is tfds: dataset_path without dataset_type must not train on the embedded text."""
  assert tiny_config(f"dataset_path={tmp_path}").dataset_type == "tfds"
  assert "Using dataset_type=tfds, because dataset_path is set" in capsys.readouterr().out
  assert tiny_config(f"hf_train_files={tmp_path}/*.jsonl", "hf_path=json").dataset_type == "hf"
  assert tiny_config(f"grain_train_files={tmp_path}/*.arrayrecord").dataset_type == "grain"
  assert tiny_config().dataset_type == "embedded"
  assert tiny_config("dataset_type=embedded", f"dataset_path={tmp_path}").dataset_type == "embedded"  # chosen
  with pytest.raises(ConfigError, match=r"dataset_path \(dataset_type=tfds\) and hf_path \(dataset_type=hf\) are both set"):
    tiny_config(f"dataset_path={tmp_path}", "hf_path=json")
