"""Every user mistake in the config or CLI: one line on stderr naming the key, exit status 2, no traceback.

One case runs the real entry point in a process of its own; the others run train.py's `main` in this process under
the entry point's error handling (helpers.run_entry_point) and check the same line and status. The checks happen
before JAX is imported; the cases in NEEDS_DEVICES fail after the device lookup, still before any computation.
"""

import pytest

from MaxText import train
from MaxText.errors import ConfigError
from MaxText.tests.helpers import REPO_ROOT as REPO
from MaxText.tests.helpers import TEST_JAX_CACHE_DIR, TRAIN_PY, run_entry_point, run_python, tiny_args, tiny_config

CASES = [
  # (CLI args after the config, extra env, text the error line must contain)
  (["stepz=5"], {}, "unknown config key 'stepz'; did you mean 'steps'"),
  (["steps=abc"], {}, "steps=abc is not an integer"),
  (["dataset_type=hf", "hf_path=json"], {}, "dataset_type=hf hf_path=json needs hf_train_files"),
  (["scan_layers=maybe"], {}, "scan_layers=maybe is not a boolean"),
  (["learning_rate=fast"], {}, "learning_rate=fast is not a number"),
  (["mlp_activations=silu"], {}, "mlp_activations=silu is not a list"),
  (["global_parameter_scale=3"], {}, "global_parameter_scale=3 must be a power of 2"),
  (["base_num_kv_heads=3"], {}, "base_num_query_heads=16 must be a multiple of base_num_kv_heads=3"),
  (
    ["model_name=gpt9"],
    {},
    "model_name=gpt9 is not a known model; valid: default, deepseek3-671b, deepseek3-test, gemma-2b",
  ),
  (["decoder_block=transformerxl"], {}, "decoder_block=transformerxl is not valid; choose one of: default, llama2"),
  (["attention=magic"], {}, "attention=magic is not valid"),
  (["dtype=float8"], {}, "dtype=float8 is not valid; choose one of: float32, bfloat16, float16"),
  (["weight_dtype=int4"], {}, "weight_dtype=int4 is not valid"),
  (["remat_policy=sometimes"], {}, "remat_policy=sometimes is not valid"),
  (["mlp_activations=[silu,swiglu]"], {}, "mlp_activations has unknown activation 'swiglu'"),
  (["per_device_batch_size=0"], {}, "per_device_batch_size=0.0 must be > 0"),
  (["learning_rate=-1"], {}, "learning_rate=-1.0 must be >= 0"),
  (["warmup_steps_fraction=1.5"], {}, "warmup_steps_fraction=1.5 must be in [0, 1]"),
  (["adam_b2=1.0"], {}, "adam_b2=1.0 must be in [0, 1)"),
  (["max_target_length=0"], {}, "max_target_length=0 must be a positive integer"),
  (
    ["ici_tensor_parallelism=-1"],
    {},
    "only one ici_*_parallelism may be -1, got ici_fsdp_parallelism, ici_tensor_parallelism",
  ),
  (["ici_tensor_parallelism=0"], {}, "ici_tensor_parallelism=0 must be a positive integer, or -1"),
  (["dataset_type=c5"], {}, "dataset_type=c5 is not valid; choose one of: embedded, synthetic"),
  (["enable_emergency_checkpoint=true"], {}, "enable_emergency_checkpoint=true needs local_checkpoint_directory"),
  (
    ["enable_emergency_checkpoint=true", "enable_checkpointing=false"],
    {},
    "enable_emergency_checkpoint=true needs enable_checkpointing=true",
  ),
  (
    ["enable_emergency_checkpoint=true", "local_checkpoint_directory=/tmp/local"],
    {},
    "enable_emergency_checkpoint=true needs local_checkpoint_period > 0 (it is 0)",
  ),
  (["hardware=quantum"], {}, "hardware=quantum is not valid"),
  (["data_sharding=[[data,nonaxis]]"], {}, "data_sharding names 'nonaxis', which is not in mesh_axes"),
  (["logical_axis_rules=[[embed,bogus]]"], {}, "logical_axis_rules maps 'embed' to 'bogus'"),
  (["mesh_axes=[[data]]"], {}, "mesh_axes=[[data]] must be a flat list of names, e.g. [data, stage,"),
  (["data_sharding=[data,fsdp]"], {}, "data_sharding=[data,fsdp] must be a list of lists of names"),
  (["run_name=../elsewhere"], {}, "run_name=../elsewhere must be a single directory name"),
  (["tokenizer_path=/no/such/tokenizer"], {}, "tokenizer_path=/no/such/tokenizer does not exist"),
  (["steps"], {}, "argument 'steps' is not of the form key=value"),
  (["--steps=3"], {}, "write overrides as steps=value, without leading dashes"),
  ([], {"M_STEPZ": "3"}, "environment variable M_STEPZ names no config key 'stepz'; did you mean 'steps'"),
  (["steps=4"], {"M_STEPS": "3"}, "key 'steps' is set both on the command line and by M_STEPS"),
  (["steps=-5"], {}, "steps=-5 must be positive"),
  (["head_dim=7"], {}, "head_dim=7 must be even"),
  (["step_watchdog=maybe"], {}, "step_watchdog=maybe is not valid; choose one of: auto, true, false"),
  (["step_watchdog_factor=0.5"], {}, "step_watchdog_factor=0.5 must be >= 1"),
  (["profiler=tensorboard"], {}, 'profiler=tensorboard is not valid; choose one of: "" (none), xplane, nsys'),
  (
    ["profiler=xplane", "steps=3", "skip_first_n_steps_for_profiler=3"],
    {},
    "profiler=xplane with skip_first_n_steps_for_profiler=3 skips every one of the 3 steps",
  ),
  (["use_vertex_tensorboard=true"], {}, "use_vertex_tensorboard=true needs vertex_tensorboard_region, e.g. us-central1"),
  (
    ["use_vertex_tensorboard=true", "vertex_tensorboard_region=us-central1", "enable_tensorboard=false"],
    {},
    "use_vertex_tensorboard=true uploads the TensorBoard directory, which enable_tensorboard=false leaves empty",
  ),
  (
    ["metrics_file=/proc/no/metrics.jsonl", "base_emb_dim=32", "base_num_decoder_layers=1"],
    {},
    "metrics_file=/proc/no/metrics.jsonl cannot be written",
  ),
]

NEEDS_DEVICES = [
  (["ici_tensor_parallelism=3"], {}, "ici_fsdp_parallelism=-1 cannot be filled: devices per slice 1 is not divisible by"),
  (
    ["ici_fsdp_parallelism=2"],
    {},
    "ici_*_parallelism multiply to 2 (ici_fsdp_parallelism=2) but there are 1 devices per slice",
  ),
  (["per_device_batch_size=0.5"], {}, "per_device_batch_size=0.5 x 1 devices = 0.5 rows"),
  (["attention=flash"], {}, "attention=flash needs a TPU"),
  (["attention=cudnn_flash_jax"], {}, "attention=cudnn_flash_jax needs a GPU (cuDNN); this machine has cpu devices"),
  (["dcn_fsdp_parallelism=2"], {}, "dcn_fsdp_parallelism=2 but there is one slice"),
  (
    ["model_name=llama2-70b"],
    {},
    "the train state (params and optimizer state) needs 770.87 GiB per device but a cpu device has",
  ),
]


# Mistakes in a YAML file: (file under tmp_path, its text, the error line with {file} for its path). The
# files are checked like the command line, and the line names the file.
FILE_CASES = [
  ("my.yml", "base_config: base.yml\nstpes: 100\n", "unknown config key 'stpes' in {file}; did you mean 'steps'?"),
  ("my.yml", "base_config: base.yml\nsteps: ten\n", "steps: ten in {file} is not an integer"),
  ("my.yml", "base_config: base.yml\nsteps: 1.5\n", "steps: 1.5 in {file} is not an integer"),
  ("my.yml", "base_config: base.yml\nscan_layers: maybe\n", "scan_layers: maybe in {file} is not a boolean"),
  ("my.yml", "base_config: base.yml\nmesh_axes: [[data]]\n", "mesh_axes: [[data]] in {file} must be a flat list"),
  ("my.yml", "base_config: base.yml\nrun_name: 2024\n", 'run_name: 2024 in {file} is not a string; quote it, e.g. "2024"'),
  ("my.yml", "learning_rate: fast\n", "learning_rate: fast in {file} is not a number"),  # no base_config
  ("models/mine.yml", "base_emb_dim: wide\n", "base_emb_dim: wide in {file} is not an integer"),
  (
    "my.yml",
    "base_config: base.yml\nsteps: 3\nlearning_rate: 1e-3\nsteps: 4\n",
    "config file '{file}' is not valid YAML at line 4, column 1: 'steps' is set twice (first on line 2); keep one",
  ),
]


def _assert_one_line_error(result, expected: str):
  assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
  assert "Traceback" not in result.stderr + result.stdout
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, lines
  assert lines[0].startswith("Error: ")
  assert expected in lines[0], lines[0]


def _error_of(argv: list[str], tmp_path, monkeypatch, env=None) -> str:
  """The one line that train.py prints for argv (status 2, no traceback): its main run in this process under the
  entry point's error handling (helpers.run_entry_point, which runs it from the checkout as the command does)."""
  for name, value in (env or {}).items():
    monkeypatch.setenv(name, value)
  # A run directory made before the error goes under tmp_path, and the test cache stays the process's.
  in_tests = [f"base_output_directory={tmp_path}", f"jax_cache_dir={TEST_JAX_CACHE_DIR}"]
  in_tests = in_tests if len(argv) > 2 and "=" not in argv[1] else []
  result = run_entry_point(train.main, [*argv, *in_tests])
  _assert_one_line_error(result, "")
  return result.stderr.strip()


def test_a_mistake_is_one_line_on_stderr_with_exit_status_2():
  """The entry point itself, in a process of its own: the line, the status, no traceback."""
  result = run_python([TRAIN_PY, "MaxText/configs/base.yml", "run_name=bad", "stepz=5"])
  _assert_one_line_error(result, "unknown config key 'stepz'; did you mean 'steps'")


@pytest.mark.parametrize("args,env,expected", CASES + NEEDS_DEVICES)
def test_bad_cli_value_gives_one_clear_line(args, env, expected, tmp_path, monkeypatch):
  run_name = [] if any(a.startswith("run_name") for a in args) else ["run_name=bad"]
  assert expected in _error_of([TRAIN_PY, f"{REPO}/MaxText/configs/base.yml", *run_name, *args], tmp_path, monkeypatch, env)


def test_a_mistake_split_over_devices_gives_one_line():
  """A shape that does not split over 4 devices: a process of its own, for its device count."""
  result = run_python(
    [TRAIN_PY, "MaxText/configs/base.yml", "run_name=bad", "base_num_kv_heads=2", "ici_fsdp_parallelism=1"]
    + ["ici_tensor_parallelism=4"],
    env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
  )
  _assert_one_line_error(
    result,
    "parameter ['decoder']['layers']['self_attention']['key']['kernel'] of shape (2048, 16, 2, 128): dimension 2 (2) "
    "cannot be split 4 ways over mesh axes ['tensor', 'autoregressive']",
  )


@pytest.mark.parametrize("name,text,expected", FILE_CASES)
def test_mistake_in_a_config_file_names_the_file(tmp_path, monkeypatch, name, text, expected):
  path = tmp_path / name
  path.parent.mkdir(exist_ok=True)
  path.write_text(text)
  if name.startswith("models/"):  # a preset, found next to the config file
    (tmp_path / "c.yml").write_text("base_config: base.yml\n")
    argv = [TRAIN_PY, str(tmp_path / "c.yml"), "run_name=x", "model_name=mine"]
  else:
    argv = [TRAIN_PY, str(path)] + ([] if "run_name" in text else ["run_name=x"])
  assert expected.format(file=path) in _error_of(argv, tmp_path, monkeypatch)


def test_missing_run_name(tmp_path, monkeypatch):
  assert "run_name is empty" in _error_of([TRAIN_PY, f"{REPO}/MaxText/configs/base.yml"], tmp_path, monkeypatch)


def test_missing_config_file(tmp_path, monkeypatch):
  assert "config file 'nope.yml' does not exist" in _error_of([TRAIN_PY, "nope.yml", "run_name=x"], tmp_path, monkeypatch)


def test_first_argument_must_be_the_config(tmp_path, monkeypatch):
  assert "the first argument must be a config file" in _error_of([TRAIN_PY, "run_name=x"], tmp_path, monkeypatch)


def test_broken_yaml(tmp_path, monkeypatch):
  bad = tmp_path / "bad.yml"
  bad.write_text("steps: [1, 2\n")
  assert "is not valid YAML" in _error_of([TRAIN_PY, str(bad), "run_name=x"], tmp_path, monkeypatch)


def test_unknown_key_in_a_model_preset(tmp_path, monkeypatch):
  models = tmp_path / "models"
  models.mkdir()
  (models / "mine.yml").write_text("base_emb_dims: 64\n")
  cfg = tmp_path / "c.yml"
  cfg.write_text("base_config: base.yml\n")
  error = _error_of([TRAIN_PY, str(cfg), "run_name=x", "model_name=mine"], tmp_path, monkeypatch)
  assert "model preset 'mine' sets unknown key 'base_emb_dims'; did you mean 'base_emb_dim'" in error


def test_tokenizer_larger_than_vocab_is_caught_before_training(tmp_path, monkeypatch, capsys):
  argv = [TRAIN_PY, f"{REPO}/MaxText/configs/base.yml", "run_name=x"]
  error = _error_of([*argv, *tiny_args(f"base_output_directory={tmp_path}", "vocab_size=100")], tmp_path, monkeypatch)
  assert "has 4096 tokens but vocab_size=100; set vocab_size>=4096" in error
  assert "One train step needs" not in capsys.readouterr().out  # before the step's compile and memory check


@pytest.mark.parametrize(
  "arg, expected",
  [
    ("learning_rate=inf", "learning_rate=inf must be a finite number"),
    ("learning_rate=.inf", "learning_rate=.inf must be a finite number"),
    ("adam_eps=nan", "adam_eps=nan must be a finite number"),
    ("data_shuffle_seed=-1", "data_shuffle_seed=-1 must be in [0, 2**32 - 1]"),
    ("per_device_batch_size=1e-9", "= 1e-09 rows; it must make a whole number of rows, at least 1"),
  ],
)
def test_values_that_used_to_fail_later_are_one_line(arg, expected):
  with pytest.raises(ConfigError) as error:
    tiny_config(arg)
  assert expected in str(error.value)
