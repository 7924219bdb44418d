"""Shared pieces of the tests: a tiny model config, and running the real entry points in a subprocess."""

import json
import os
import subprocess
import sys
import tempfile

from MaxText import pyconfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE_YML = os.path.join(REPO_ROOT, "MaxText", "configs", "base.yml")
TRAIN_PY = os.path.join(REPO_ROOT, "MaxText", "train.py")

# One compilation cache for all test processes: the same tiny programs compile once per machine.
TEST_JAX_CACHE_DIR = os.path.join(tempfile.gettempdir(), "maxtext_test_jax_cache")

# A model small enough that a train step takes milliseconds on a CPU.
TINY_MODEL = [
  "base_emb_dim=32",
  "base_num_query_heads=4",
  "base_num_kv_heads=2",
  "head_dim=8",
  "base_mlp_dim=64",
  "base_num_decoder_layers=2",
  "vocab_size=4096",
  "max_target_length=32",
  "per_device_batch_size=2",
  "dtype=float32",
  f"jax_cache_dir={TEST_JAX_CACHE_DIR}",
  "enable_tensorboard=false",
]


def tiny_args(*args) -> list[str]:
  """TINY_MODEL with `key=value` args replacing its entries of the same key."""
  merged = dict(a.split("=", 1) for a in TINY_MODEL)
  merged.update(a.split("=", 1) for a in args)
  return [f"{k}={v}" for k, v in merged.items()]


def tiny_config(*args, tmp_path=None, **kwargs):
  """pyconfig.initialize for the tiny model; extra key=value args and typed kwargs override it."""
  out = [f"base_output_directory={tmp_path}"] if tmp_path else []
  return pyconfig.initialize(["test", BASE_YML, "run_name=test", *tiny_args(*out, *args)], environ={}, **kwargs)


def run_python(args, env_extra=None, timeout=600) -> subprocess.CompletedProcess:
  """Runs `python3 <args>` from the repo root with a clean M_* environment."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  env.update(env_extra or {})
  command = [sys.executable, *args]
  return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def read_metrics(path) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def run_train(tmp_path, run_name, *args, env=None, metrics_name=None):
  """Runs `python3 MaxText/train.py` on the tiny model under tmp_path; returns (process, metrics lines)."""
  metrics = tmp_path / f"{metrics_name or run_name}.jsonl"
  argv = [TRAIN_PY, "MaxText/configs/base.yml", f"run_name={run_name}"]
  argv += tiny_args(f"base_output_directory={tmp_path}", f"metrics_file={metrics}", "learning_rate=1e-2", *args)
  result = run_python(argv, env_extra=env)
  return result, (read_metrics(metrics) if metrics.exists() else [])


def cpu_env(devices: int, **extra) -> dict:
  """The environment of a test process with `devices` forced CPU devices (and a clean M_* environment)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu", **extra)
  return env


def start_cpu_processes(
  command, processes: int = 2, devices_per_process: int = 4, rank_env: dict | None = None
) -> list[subprocess.Popen]:
  """Starts `command` as a jax.distributed job of `processes` CPU processes on 127.0.0.1 (output: stdout).

  rank_env: {rank: {variable: value}}, extra environment of some processes.
  """
  import portpicker  # pylint: disable=import-outside-toplevel

  port = portpicker.pick_unused_port()
  cluster = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "NNODES": str(processes)}
  return [
    subprocess.Popen(
      command,
      cwd=REPO_ROOT,
      env=cpu_env(devices_per_process, **cluster, NODE_RANK=str(rank), **(rank_env or {}).get(rank, {})),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for rank in range(processes)
  ]


def finish_processes(procs, timeout: int = 600) -> tuple[list[int], list[str]]:
  """Waits for the processes (killing any left at the timeout); returns their exit codes and outputs."""
  try:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  return [p.returncode for p in procs], outputs


def token_batch(rows: int = 2, length: int = 32, seed: int = 0, segmentation=None) -> dict:
  """A train batch (every key of packing.BATCH_KEYS) of random tokens; `segmentation` (rows, length) marks padding 0."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  tokens = jax.random.randint(jax.random.PRNGKey(seed), (rows, length + 1), 0, 4096)
  positions = jnp.broadcast_to(jnp.arange(length), (rows, length))
  segmentation = jnp.ones((rows, length), jnp.int32) if segmentation is None else segmentation
  return {
    "inputs": tokens[:, :-1],
    "inputs_position": positions,
    "inputs_segmentation": segmentation,
    "targets": tokens[:, 1:],
    "targets_position": positions,
    "targets_segmentation": segmentation,
  }
