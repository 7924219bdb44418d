"""benchmarks/decode_benchmark.py's command line: wrong flags and keys are one line, the config is read first."""

import importlib.util
import os

import pytest

from MaxText.runtime.entry_point import run_and_exit_on_user_error
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, run_python, tiny_args

DECODE_BENCHMARK = os.path.join(REPO_ROOT, "benchmarks", "decode_benchmark.py")
# The tiny model, less the keys that the benchmark sets itself.
MODEL = [arg for arg in tiny_args() if not arg.startswith(("max_target_length=", "per_device_batch_size="))]


def _decode_benchmark():
  spec = importlib.util.spec_from_file_location("decode_benchmark", DECODE_BENCHMARK)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize(
  "args, message",
  [
    (["--batches", "abc"], "argument --batches: 'abc' is not a comma-separated list of positive integers, e.g. 1,64"),
    (["--batches", "1,,2"], "argument --batches: '1,,2' is not a comma-separated list of positive integers"),
    (["--batches", "0"], "argument --batches: '0' is not a comma-separated list of positive integers"),
    (["--tokens", "0"], "argument --tokens: '0' is not an integer >= 1"),
    (["--tokens", "-3"], "argument --tokens: '-3' is not an integer >= 1"),
    (["--prompt_length", "0"], "argument --prompt_length: '0' is not an integer >= 1"),
    (["--hbm_gbps", "-5"], "argument --hbm_gbps: '-5' is not a number > 0"),
    (["--hbm_gbps", "0"], "argument --hbm_gbps: '0' is not a number > 0"),
    (["max_target_length=64"], "max_target_length is set by the benchmark (it is max(--prompt_length, 8) + --tokens + 1)"),
    (["per_device_batch_size=2"], "per_device_batch_size is set by the benchmark (--batches gives each run's rows"),
    (["load_parameters_path=/ckpt"], "load_parameters_path is set by the benchmark (the params are random"),
    (["ici_fsdp_parallelism=1000"], "ici_*_parallelism multiply to 1000"),  # a config mistake: before the table too
  ],
)
def test_a_wrong_flag_or_key_is_one_line_before_the_table(capsys, args, message):
  decode_benchmark = _decode_benchmark()
  argv = ["decode_benchmark.py", BASE_YML, *MODEL, "--tokens", "2", "--batches", "1", "--skip_recompute", *args]
  with pytest.raises(SystemExit) as exit_info:
    run_and_exit_on_user_error(decode_benchmark.main, argv)
  out, err = capsys.readouterr()
  assert exit_info.value.code == 2
  assert len(err.splitlines()) == 1 and err.startswith(f"Error: {message}"), err
  assert not out


def test_config_comes_first_and_the_params_are_random_once():
  argv = [DECODE_BENCHMARK, BASE_YML, *MODEL, "xla_flags_preset=a3mega", "--tokens", "2", "--batches", "1,2"]
  # No JAX_PLATFORMS, as a user runs it: pyconfig keeps JAX off libtpu on a host without TPUs.
  result = run_python([*argv, "--skip_recompute"], env_extra={"JAX_PLATFORMS": ""})
  assert result.returncode == 0, result.stderr[-3000:]
  assert "JAX's backend had already started" not in result.stderr  # the preset took effect
  assert "libtpu" not in result.stderr and "no checkpoint" not in result.stderr
  lines = result.stdout.splitlines()
  assert lines.count("Params: random (the timing does not depend on them)") == 1
  assert [line.split()[0] for line in lines if line.strip().split()[0] in ("1", "2")] == ["1", "2"]
