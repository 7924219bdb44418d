"""xla_flags_preset: the preset's flags reach XLA_FLAGS before JAX's backend starts, the user's own flags win."""

import os
import re

import pytest

from MaxText import pyconfig
from MaxText.configuration import common_types
from MaxText.runtime import xla_flag_presets
from MaxText.tests.helpers import BASE_YML, TRAIN_PY, run_python, tiny_args

A3MEGA = xla_flag_presets.PRESETS["a3mega"]


def test_presets_match_the_config_choices():
  assert set(xla_flag_presets.PRESETS) == set(common_types.XLA_FLAGS_PRESETS) - {""}


def test_a_flag_the_user_set_wins_and_nothing_is_repeated():
  user = "--xla_gpu_enable_triton_gemm=true  --xla_force_host_platform_device_count=2"
  merged, added = xla_flag_presets.merged_flags(user, A3MEGA)
  assert merged.startswith(user + " ")  # the user's text as it was
  assert "--xla_gpu_enable_triton_gemm=false" not in merged and "--xla_gpu_enable_triton_gemm=false" not in added
  assert len(added) == len(A3MEGA) - 1
  names = [xla_flag_presets.flag_name(flag) for flag in merged.split()]
  assert len(names) == len(set(names))
  assert xla_flag_presets.merged_flags(merged, A3MEGA) == (merged, [])  # a second initialize adds nothing


def test_pyconfig_applies_the_preset_only_when_asked():
  argv = ["test", BASE_YML, "run_name=t", *tiny_args()]
  environ = {"XLA_FLAGS": "--xla_gpu_all_reduce_combine_threshold_bytes=1024"}
  pyconfig.initialize([*argv, "xla_flags_preset=a3mega"], environ=environ)
  flags = environ["XLA_FLAGS"].split()
  assert flags[0] == "--xla_gpu_all_reduce_combine_threshold_bytes=1024"
  assert "--xla_gpu_all_reduce_combine_threshold_bytes=536870912" not in flags
  assert set(flags[1:]) == set(A3MEGA) - {"--xla_gpu_all_reduce_combine_threshold_bytes=536870912"}

  untouched = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
  pyconfig.initialize(argv, environ=untouched)
  assert untouched == {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
  empty = {}
  pyconfig.initialize(argv, environ=empty)
  assert "XLA_FLAGS" not in empty


def test_unknown_preset_is_one_config_error_line(tmp_path):
  result = run_python([TRAIN_PY, BASE_YML, "run_name=x", f"base_output_directory={tmp_path}", "xla_flags_preset=h100"])
  assert result.returncode == 2
  assert result.stderr.strip() == 'Error: xla_flags_preset=h100 is not valid; choose one of: "" (none), a3mega'


def test_a_cpu_process_starts_with_the_preset_and_xla_reads_it(tmp_path):
  """XLA parses every xla_gpu_* flag on every platform (an unknown one aborts the process), so the preset must hold
  only flags that this jaxlib knows. --xla_dump_hlo_pass_re=.* (the preset's) with the user's --xla_dump_to dumps
  the HLO after each compiler pass: those files show that XLA read the preset's flags."""
  dump = tmp_path / "dump"
  code = (
    "import jax, jax.numpy as jnp, os, sys\n"
    "from MaxText import pyconfig\n"
    "pyconfig.initialize(sys.argv[1:])\n"
    "print(jax.jit(lambda x: x * 2)(jnp.ones(4)).sum())\n"
    "print('XLA_FLAGS=' + os.environ['XLA_FLAGS'])\n"
  )
  argv = ["-c", code, "test", BASE_YML, "run_name=t", "xla_flags_preset=a3mega", *tiny_args()]
  result = run_python(argv, env_extra={"XLA_FLAGS": f"--xla_dump_to={dump}", "JAX_PLATFORMS": "cpu"}, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "8.0" in result.stdout.splitlines()
  logged = [line for line in result.stdout.splitlines() if line.startswith("xla_flags_preset=a3mega: added to XLA_FLAGS:")]
  assert len(logged) == 1 and logged[0].endswith(" ".join(A3MEGA))
  final = next(line for line in result.stdout.splitlines() if line.startswith("XLA_FLAGS="))
  assert final == f"XLA_FLAGS=--xla_dump_to={dump} " + " ".join(A3MEGA)
  per_pass = [name for name in os.listdir(dump) if re.search(r"\.\d{4}\..*after_", name)]
  assert per_pass, sorted(os.listdir(dump))[:20]


@pytest.mark.parametrize(
  "flags, message",
  [
    (
      "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_graph_level=0",
      "replaced it with --xla_gpu_enable_command_buffer",
    ),
    ("--xla_gpu_enable_triton_softmax_fusion=false", "XLA removed it with that fusion: leave it out"),
    ("--xla_tpu_enable_data_parallel_all_reduce_opt=true", "a TPU compiler flag: put it in LIBTPU_INIT_ARGS"),
  ],
)
def test_flags_xla_would_abort_on_are_one_line_before_the_backend_starts(flags, message):
  """Each of these aborts XLA at backend start (a C++ fatal error; checked with jax 0.10.2 on CPU)."""
  result = run_python(["MaxText/train.py", "MaxText/configs/base.yml", "run_name=x"], env_extra={"XLA_FLAGS": flags})
  assert result.returncode == 2 and "Traceback" not in result.stderr and "Unknown flag" not in result.stderr
  assert message in result.stderr.strip().splitlines()[-1]
