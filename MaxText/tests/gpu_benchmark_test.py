"""benchmarks/gpu_benchmark.py (its --cpu-smoke runs the real path on a tiny model) and decode_benchmark's roofline."""

import importlib.util
import os
import types

import jax
import pytest

from MaxText.tests.helpers import REPO_ROOT, TEST_JAX_CACHE_DIR, run_python

GPU_BENCHMARK = os.path.join(REPO_ROOT, "benchmarks", "gpu_benchmark.py")


def _load(name: str):
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, "benchmarks", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow  # two compiles of a tiny model: about a minute with a cold compilation cache, 15 s warm
def test_cpu_smoke_prints_a_row_per_variant():
  result = run_python([GPU_BENCHMARK, "--cpu-smoke", f"jax_cache_dir={TEST_JAX_CACHE_DIR}"])
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0].startswith("CPU smoke (tiny model, not a GPU figure): median of 3 steps after 1 warm-up")
  for name in ("2x64-scanned-minimal_flash", "2x64-unrolled-save_dot_with_context_except_mlp"):
    row = next(line for line in lines if line.startswith(name)).split()
    step_s, host_ms, tokens_per_s = float(row[1]), float(row[2]), float(row[4])
    assert 0 < host_ms / 1e3 < step_s and tokens_per_s > 0
    assert row[-3:] == ["n/a", "n/a", "no"]  # MFU and peak memory unknown on CPU; nothing compiled while timed
  assert lines[-1].startswith("Device: 1 x cpu")


def test_a_failing_variant_is_a_row_and_the_exit_status():
  result = run_python([GPU_BENCHMARK, "--cpu-smoke", "remat_policy=sometimes"])
  assert result.returncode == 1
  rows = [line for line in result.stdout.splitlines() if line.startswith("2x64-")]
  assert len(rows) == 2 and all("exit 2: Error: remat_policy=sometimes is not valid" in row for row in rows)


def test_unknown_variant_is_one_line():
  result = run_python([GPU_BENCHMARK, "--only", "3x3-scanned-full"])
  assert result.returncode == 2
  assert result.stderr.strip().startswith("Error: --only 3x3-scanned-full is not a variant; variants: 8x4096-unrolled")


def test_decode_roofline_counts_params_and_the_whole_kv_cache():
  decode_benchmark = _load("decode_benchmark")
  config = types.SimpleNamespace(
    num_decoder_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16", max_target_length=4096
  )
  cache = decode_benchmark.kv_cache_bytes(config, rows=64)
  assert cache == 64 * 4096 * 2 * 16 * 8 * 128 * 2 // jax.device_count()
  # 1 GB of params + the cache at 3350 GB/s: 64 rows per step.
  tokens_per_s = decode_benchmark.roofline_tokens_per_s(64, 10**9 + cache, 3350.0)
  assert tokens_per_s == pytest.approx(64 * 3350e9 / (10**9 + cache))
  assert decode_benchmark.roofline_tokens_per_s(1, 10**9, None) is None
  int8 = types.SimpleNamespace(**{**vars(config), "quantize_kvcache": True})
  assert decode_benchmark.kv_cache_bytes(int8, rows=64) == cache // 2


def test_flag_ablation_runs_each_flag_of_the_preset_alone():
  gpu_benchmark = _load("gpu_benchmark")
  from MaxText.xla_flag_presets import A3MEGA  # pylint: disable=import-outside-toplevel

  user = "--xla_gpu_enable_triton_gemm=true"  # the user's value wins: that flag is not measured alone
  runs = gpu_benchmark.flag_ablation_runs("a3mega", user)
  assert runs[0] == ("XLA_FLAGS as given", user)
  assert runs[1][0] == "+ all of a3mega" and runs[1][1].startswith(user) and "triton_gemm=false" not in runs[1][1]
  alone = dict(runs[2:])
  assert len(alone) == len(A3MEGA) - 1 and "+ xla_gpu_enable_triton_gemm=false" not in alone
  assert alone["+ xla_disable_hlo_passes=rematerialization"] == f"{user} --xla_disable_hlo_passes=rematerialization"
