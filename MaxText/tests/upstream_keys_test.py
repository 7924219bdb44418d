"""Upstream MaxText's configs load here: every key of upstream's base.yml (ed21f6ad) is known, accepted at upstream's
default, and another value of a key whose feature does not apply here is refused with a reason."""

import json
import os
import shutil

import pytest
import yaml

from MaxText import pyconfig
from MaxText.configuration import config_loader, config_schema
from MaxText.errors import ConfigError
from MaxText.tests.helpers import BASE_YML, run_train, tiny_config

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream_base_keys.yml"), encoding="utf-8") as f:
  UPSTREAM = yaml.safe_load(f)

# Keys that upstream's configs set together: each is loaded with its partners at upstream's defaults.
TOGETHER = {"mesh_axes": ("data_sharding",), "data_sharding": ("mesh_axes",)}
# Upstream defaults that this test's host cannot take, with the reason (each is one error line for a user too).
NOT_HERE = {
  "hardware": "tpu: this host has no TPU (hardware=tpu on a host without one is one error line)",
  "tokenizer_path": "assets/tokenizer.llama2 is not shipped here (one line says where to get it)",
}


def _cli(value) -> str:
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, list):
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
  return str(value)


def test_every_upstream_key_is_a_key_here():
  assert sorted(set(UPSTREAM) - set(config_loader.base_defaults())) == []


@pytest.mark.parametrize("key", sorted(set(UPSTREAM) - set(NOT_HERE)))
def test_upstream_default_loads(key, tmp_path):
  """base.yml with this key (and its partners) at upstream's default loads without an error."""
  args = [f"{k}={_cli(UPSTREAM[k])}" for k in (key, *TOGETHER.get(key, ()))]
  if key == "dataset_type":
    args.append(f"dataset_path={tmp_path}")  # tfds reads a dataset_path
  if key != "base_output_directory":
    args.append(f"base_output_directory={tmp_path}")
  config = pyconfig.initialize(["test", BASE_YML, "run_name=test", *args], environ={})
  assert key in config


def _other(default):
  if isinstance(default, bool):
    return not default
  if isinstance(default, int):
    return default + 2
  return "x"


@pytest.mark.parametrize("key", [k for k, entry in config_schema.KEYS.items() if entry.refused])
def test_another_value_of_a_key_that_does_not_apply_is_refused_with_its_reason(key):
  default = config_loader.base_defaults()[key]
  other = _other(default)
  with pytest.raises(ConfigError) as error:
    tiny_config(f"{key}={_cli(other)}")
  assert str(error.value) == f"{key}={_cli(other)}: {config_schema.KEYS[key].refused}"


def test_hf_access_token_is_not_written_to_the_resolved_config(tmp_path):
  config = tiny_config("hf_access_token=hf_secret123", tmp_path=tmp_path)
  assert config.hf_access_token == "hf_secret123"
  assert "hf_secret123" not in config.to_yaml() and "hf_access_token: '<set, not shown>'" in config.to_yaml()


def test_upstream_empty_base_output_directory_is_the_current_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  config = pyconfig.initialize(["test", BASE_YML, "run_name=here", "base_output_directory="], environ={})
  assert config.run_dir == str(tmp_path / "here")


def test_num_slices_is_detected_and_another_count_is_refused():
  assert tiny_config("num_slices=1").num_slices == tiny_config().num_slices == 1
  with pytest.raises(ConfigError, match=r"num_slices=2, but the devices form 1 slice\(s\); leave it at -1"):
    tiny_config("num_slices=2")


@pytest.mark.parametrize("asset", ["tokenizer.llama2", "tokenizer.gemma", "tokenizer.mistral", "tokenizer_llama3.tiktoken"])
def test_upstream_tokenizer_assets_say_where_to_get_them(asset):
  where = rf"it is upstream MaxText's asset, which this project does not ship: save it as .*/MaxText/assets/{asset}\. Get "
  with pytest.raises(ConfigError, match=where + ".*huggingface.co"):
    tiny_config(f"tokenizer_path=assets/{asset}")


@pytest.mark.parametrize(
  "path, hint",
  [
    (
      "assets/tokenizer",
      r"upstream MaxText's asset.*save it as .*/MaxText/assets/tokenizer\. .*tokenizer_path=assets/tokenizer\.default",
    ),
    ("google-t5/t5-large", r"looks like a Hugging Face hub id, and MaxText never downloads: fetch it once"),
    ("my/tokenizer", r"hub id"),
    ("data/sub/tokenizer", r"does not exist \(tried the cwd, .* and the config's directory\)$"),  # not upstream's asset
  ],
)
def test_missing_tokenizers_say_what_they_are(path, hint):
  with pytest.raises(ConfigError, match=hint):
    tiny_config(f"tokenizer_path={path}")


def test_decode_with_synthetic_data_gives_the_same_tokenizer_hint(tmp_path):
  from MaxText.tests.helpers import run_python  # pylint: disable=import-outside-toplevel

  result = run_python(
    ["MaxText/decode.py", BASE_YML, "run_name=d", "dataset_type=synthetic", "tokenizer_path=assets/tokenizer.gemma"]
  )
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert "it is upstream MaxText's asset, which this project does not ship: save it as /" in result.stderr


def test_a_package_that_ships_upstreams_tokenizer_is_used(tmp_path, monkeypatch, capsys):
  """mistral-common ships Mistral's tokenizer as data/tokenizer.model.v1: where it is installed, it is used."""
  data = tmp_path / "mistral_common" / "data"
  data.mkdir(parents=True)
  (tmp_path / "mistral_common" / "__init__.py").write_text("")
  shutil.copy(os.path.join(config_loader.PACKAGE_DIR, "assets", "tokenizer.default"), data / "tokenizer.model.v1")
  monkeypatch.syspath_prepend(str(tmp_path))
  config = tiny_config("tokenizer_path=assets/tokenizer.mistral")
  assert config.tokenizer_path == str(data / "tokenizer.model.v1")
  assert "is upstream's asset, not shipped here: using" in capsys.readouterr().out


def test_gcs_metrics_writes_the_steps_under_the_run_directory_every_log_period(tmp_path):
  """Upstream's gcs_metrics: <run_dir>/metrics/metrics_step_<first>_to_step_<last>.txt, JSON lines, every log_period."""
  result, metrics = run_train(tmp_path, "gcs", "steps=5", "log_period=2", "gcs_metrics=true", "enable_checkpointing=false")
  assert result.returncode == 0, result.stderr[-2000:]
  directory = tmp_path / "gcs" / "metrics"
  names = sorted(os.listdir(directory))
  assert names == [
    "metrics_step_000000_to_step_000001.txt",
    "metrics_step_000002_to_step_000003.txt",
    "metrics_step_000004_to_step_000004.txt",
  ]
  lines = [json.loads(line) for name in names for line in (directory / name).read_text().splitlines()]
  assert [m["step"] for m in lines] == [0.0, 1.0, 2.0, 3.0, 4.0]
  assert [m["learning/loss"] for m in lines] == [m["learning/loss"] for m in metrics]  # as the metrics_file's


def test_max_checkify_names_an_out_of_range_token_id():
  from MaxText.aot import aot_compile  # pylint: disable=import-outside-toplevel
  from MaxText.errors import UserError  # pylint: disable=import-outside-toplevel
  from MaxText.runtime import mesh, sharding  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import token_batch  # pylint: disable=import-outside-toplevel
  from MaxText.training import training_setup  # pylint: disable=import-outside-toplevel

  config = tiny_config("max_checkify=true")
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  step = aot_compile.compile_train_step(setup, config, device_mesh)
  state = setup.init_state(config, device_mesh)
  batch = token_batch(rows=config.global_batch_size_to_load)
  with sharding.logical_context(device_mesh, config):
    state, _ = step(state, batch)  # in range: no error
    batch["inputs"] = batch["inputs"].at[0, 3].set(config.vocab_size)
    with pytest.raises(
      UserError, match=r"max_checkify: step 1: a token id of the batch's inputs is outside \[0, vocab_size=4096\)"
    ):
      step(state, batch)


@pytest.mark.slow
def test_max_checkify_names_the_op_that_made_a_nan(tmp_path):
  diverge = ("learning_rate=1e36", "warmup_steps_fraction=0", "gradient_clipping_threshold=0", "enable_checkpointing=false")
  result, _ = run_train(tmp_path, "nan", "steps=4", "max_checkify=true", *diverge)
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
  assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert errors[0].startswith("Error: max_checkify: step 1: nan generated by primitive: ")
  assert "/MaxText/layers/" in errors[0]  # where in the model


@pytest.mark.parametrize(
  "arg, replacement",
  [
    ("enable_profiler=false", "upstream replaced it with profiler: profiler=xplane"),
    ("vocab_relative_path=t", "tokenizer_path="),
  ],
)
def test_keys_upstream_retired_say_what_replaced_them(arg, replacement):
  with pytest.raises(ConfigError) as error:
    tiny_config(arg)
  assert replacement in str(error.value) and "did you mean" not in str(error.value)
