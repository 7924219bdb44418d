"""benchmarks/gpu_benchmark.py (its --cpu-smoke runs the real path on a tiny model) and decode_benchmark's roofline."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
import types

import jax
import pytest

from MaxText.runtime.entry_point import run_and_exit_on_user_error
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, TEST_JAX_CACHE_DIR, run_python, tiny_args

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
  # Valid for the config (the parent's check passes); the variant's process finds no GPU for cuDNN.
  result = run_python([GPU_BENCHMARK, "--cpu-smoke", "attention=cudnn_flash_jax"])
  assert result.returncode == 1
  rows = [line for line in result.stdout.splitlines() if line.startswith("2x64-")]
  assert len(rows) == 2 and all("exit 2: Error: attention=cudnn_flash_jax needs a GPU" in row for row in rows)


def test_unknown_variant_is_one_line():
  result = run_python([GPU_BENCHMARK, "--only", "3x3-scanned-full"])
  assert result.returncode == 2
  assert result.stderr.strip().startswith("Error: --only 3x3-scanned-full is not a variant; variants: 8x4096-unrolled")


@pytest.fixture(name="gpu_benchmark")
def _gpu_benchmark(monkeypatch):
  """The module, with run_variant replaced by a row of figures (nothing compiles); calls lists the variants run."""
  module = _load("gpu_benchmark")
  module.calls = []

  def run_variant(variant, *args):
    module.calls.append(variant.name)
    return dict(ROW)

  monkeypatch.setattr(module, "run_variant", run_variant)
  return module


ROW = {
  "step_seconds": 0.01,
  "host_seconds": 0.001,
  "tokens_per_sec_per_device": 1e4,
  "tflops_per_sec_per_device": 0.01,
  "peak_memory_bytes": None,
  "compiles_while_timed": "",
  "device_kind": "cpu",
  "device_count": 1,
}


@pytest.mark.parametrize(
  "args, message",
  [
    (["--steps", "0"], "argument --steps: '0' is not an integer >= 1"),
    (["--steps", "-2"], "argument --steps: '-2' is not an integer >= 1"),
    (["--warmup", "-1"], "argument --warmup: '-1' is not an integer >= 0"),
    (["--budget", "nan"], "argument --budget: 'nan' is not a number of seconds > 0"),
    (["--budget", "0"], "argument --budget: '0' is not a number of seconds > 0"),
    (["--budget", "-5"], "argument --budget: '-5' is not a number of seconds > 0"),
    (["foo=bar"], "unknown config key 'foo'"),
    (["steps=abc"], "steps=abc is not an integer"),
    (["attention=sometimes"], "attention=sometimes is not valid"),
    (["remat_policy=full"], "remat_policy=full: each variant sets per_device_batch_size, max_target_length, scan_layers"),
    (["per_device_batch_size=1"], "per_device_batch_size=1: each variant sets"),
    (["--xla-flags-ablation", "a3mega", "xla_flags_preset=a3mega"], "--xla-flags-ablation a3mega measures a preset flag"),
  ],
)
def test_a_wrong_argument_is_one_line_before_any_variant_runs(gpu_benchmark, capsys, args, message):
  assert gpu_benchmark.main([GPU_BENCHMARK, "--cpu-smoke", *args]) == 2
  out, err = capsys.readouterr()
  assert len(err.splitlines()) == 1 and err.startswith(f"Error: {message}"), err
  assert not out and not gpu_benchmark.calls  # no table, no variant


def test_default_steps_are_kept_when_not_given(gpu_benchmark, capsys):
  assert gpu_benchmark.main([GPU_BENCHMARK, "--cpu-smoke"]) == 0
  assert capsys.readouterr().out.startswith("CPU smoke (tiny model, not a GPU figure): median of 3 steps after 1 warm-up")
  assert gpu_benchmark.calls == [v.name for v in gpu_benchmark.SMOKE_VARIANTS]


def test_without_a_gpu_it_suggests_cpu_smoke(gpu_benchmark, capsys, monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # what JAX then reports in the benchmark's probe process, on any host
  assert gpu_benchmark.main([GPU_BENCHMARK]) == 2
  out, err = capsys.readouterr()
  assert err.splitlines() == [
    "Error: JAX finds no GPU on this host (its backend is cpu); the benchmark's 1.07B model needs one: --cpu-smoke "
    "runs the tiny model on the CPU"
  ]
  assert not out and not gpu_benchmark.calls  # nor the H100 reference line


@pytest.mark.parametrize(
  "failure", [{"error": "exit 1: out of memory"}, {**ROW, "compiles_while_timed": "1 compile: train_step"}]
)
def test_one_failed_variant_makes_the_exit_status_1(gpu_benchmark, capsys, monkeypatch, failure):
  rows = iter([dict(ROW), failure])
  monkeypatch.setattr(gpu_benchmark, "run_variant", lambda *args: next(rows))
  assert gpu_benchmark.main([GPU_BENCHMARK, "--cpu-smoke"]) == 1
  assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("2x64-")]) == 2


def _children(pid: int) -> list[int]:
  """The live (not zombie) child processes of pid, from /proc."""
  children = []
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
        state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
    except (OSError, IndexError, ValueError):
      continue
    if entry.isdigit() and int(ppid) == pid and state != "Z":
      children.append(int(entry))
  return children


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from /proc")
def test_sigterm_ends_the_running_variant_too():
  command = [sys.executable, GPU_BENCHMARK, "--cpu-smoke", "--steps", "1000000", f"jax_cache_dir={TEST_JAX_CACHE_DIR}"]
  parent = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  children = []
  try:
    deadline = time.monotonic() + 120
    while not children and parent.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
      children = _children(parent.pid)
    assert children, "no variant process started"
    parent.send_signal(signal.SIGTERM)
    _, err = parent.communicate(timeout=30)
    assert parent.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == "Stopped by SIGTERM: the running variant's process was ended"
    deadline = time.monotonic() + 5
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert not any(_alive(c) for c in children)
  finally:
    for pid in [parent.pid, *children]:
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    parent.communicate()


@pytest.mark.parametrize(
  "args, message",
  [
    (["--steps", "0"], "argument --steps: '0' is not an integer >= 1"),
    (["--steps", "-1"], "argument --steps: '-1' is not an integer >= 1"),
    (["--warmup", "-1"], "argument --warmup: '-1' is not an integer >= 0"),
  ],
)
def test_train_step_benchmark_wrong_steps_are_one_line(capsys, args, message):
  train_step_benchmark = _load("train_step_benchmark")
  with pytest.raises(SystemExit) as exit_info:
    run_and_exit_on_user_error(train_step_benchmark.main, ["train_step_benchmark.py", BASE_YML, *tiny_args(), *args])
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == f"Error: {message} (see --help)\n"


def test_decode_roofline_counts_params_and_the_whole_kv_cache():
  from MaxText.inference import decode_roofline  # pylint: disable=import-outside-toplevel

  config = types.SimpleNamespace(
    num_decoder_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16", max_target_length=4096
  )
  cache = decode_roofline.kv_cache_bytes(config, rows=64)
  assert cache == 64 * 4096 * 2 * 16 * 8 * 128 * 2 // jax.device_count()
  # 1 GB of params + the cache at 3350 GB/s: 64 rows per step.
  tokens_per_s = decode_roofline.roofline_tokens_per_s(64, 10**9 + cache, 3350.0)
  assert tokens_per_s == pytest.approx(64 * 3350e9 / (10**9 + cache))
  assert decode_roofline.roofline_tokens_per_s(1, 10**9, None) is None
  int8 = types.SimpleNamespace(**{**vars(config), "quantize_kvcache": True})
  assert decode_roofline.kv_cache_bytes(int8, rows=64) == cache // 2


def test_flag_ablation_runs_each_flag_of_the_preset_alone():
  gpu_benchmark = _load("gpu_benchmark")
  from MaxText.runtime.xla_flag_presets import A3MEGA  # pylint: disable=import-outside-toplevel

  user = "--xla_gpu_enable_triton_gemm=true"  # the user's value wins: that flag is not measured alone
  runs = gpu_benchmark.flag_ablation_runs("a3mega", user)
  assert runs[0] == ("XLA_FLAGS as given", user)
  assert runs[1][0] == "+ all of a3mega" and runs[1][1].startswith(user) and "triton_gemm=false" not in runs[1][1]
  alone = dict(runs[2:])
  assert len(alone) == len(A3MEGA) - 1 and "+ xla_gpu_enable_triton_gemm=false" not in alone
  assert alone["+ xla_disable_hlo_passes=rematerialization"] == f"{user} --xla_disable_hlo_passes=rematerialization"
