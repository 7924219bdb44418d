"""Times the train step of any config (after compilation, median of N steps).

    python3 benchmarks/train_step_benchmark.py MaxText/configs/base.yml [key=value ...] [--steps 20] [--warmup 3]

Uses the same config, model, sharding and jitted train_step as train.py, on one fixed batch of the
configured dataset (so the input pipeline is not measured), and prints tokens/s, step time,
TFLOP/s/device and MFU (when the device's peak is known), the host time per step (until the step is
dispatched), the device's peak memory (where JAX reports it) and any compile during the timed steps.
`--json` prints the result as one JSON line instead (benchmarks/gpu_benchmark.py reads it).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  # pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  # pylint: disable=wrong-import-position

from MaxText import pyconfig  # noqa: E402  # pylint: disable=wrong-import-position
from MaxText.aot import aot_compile, compile_events
from MaxText.input_pipeline.input_pipeline_interface import create_data_iterator  # noqa: E402  # pylint: disable=wrong-import-position
from MaxText.runtime import cli_args, jax_runtime, mesh
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # noqa: E402  # pylint: disable=wrong-import-position
from MaxText.training import flops, training_setup


def _peak_memory_bytes() -> int | None:
  """The first local device's peak memory in use so far (None where JAX reports none, e.g. CPU)."""
  stats = jax.local_devices()[0].memory_stats()
  return stats.get("peak_bytes_in_use") if stats else None


def benchmark(config, steps: int, warmup: int) -> dict:
  """Median seconds of `steps` train steps after `warmup`, with the step compiled (and its memory checked) first.

  Each timed step is dispatched and then waited for: host_seconds is the median time until the call returned
  (Python, argument handling, dispatch), which the device's work hides only if it is shorter than a step.
  """
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  step_fn = aot_compile.compile_train_step(setup, config, device_mesh)
  state = setup.init_state(config, device_mesh)
  iterator = create_data_iterator(config, device_mesh)
  batch = next(iterator)
  iterator.close()
  if steps < 1 or warmup < 0:
    raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
  times, host_times = [], []
  with compile_events.recording() as compiles:
    for _ in range(warmup):
      state, metrics = step_fn(state, batch)
      jax.block_until_ready(metrics)
    compiled_before_timing = len(compiles)
    for _ in range(steps):
      start = time.perf_counter()
      state, metrics = step_fn(state, batch)
      dispatched = time.perf_counter()
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
      host_times.append(dispatched - start)
  seconds = float(np.median(times))
  step_flops = flops.training_tflops_per_device(config)
  tokens = flops.tokens_per_device_per_step(config)
  result = {
    "step_seconds": seconds,
    "host_seconds": float(np.median(host_times)),
    "tokens_per_sec_per_device": tokens / seconds,
    "tflops_per_sec_per_device": step_flops.total_tflops / seconds,
    "peak_memory_bytes": _peak_memory_bytes(),
    "compiles_while_timed": compiles.describe(compiled_before_timing) if len(compiles) > compiled_before_timing else "",
  }
  mfu = flops.mfu(result["tflops_per_sec_per_device"], jax.devices()[0].device_kind)
  if mfu is not None:
    result["mfu"] = mfu
  return result


def main(argv) -> None:
  parser = cli_args.OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=cli_args.int_at_least(1), default=20, help="timed steps (default 20)")
  parser.add_argument("--warmup", type=cli_args.int_at_least(0), default=3, help="untimed steps first (default 3)")
  parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
  args, config_argv = parser.parse_known_args(argv[1:])  # flags are checked before the config and JAX's backend
  config = pyconfig.initialize([argv[0], *config_argv], run_name="benchmark", enable_tensorboard=False)
  jax_runtime.enable_compilation_cache(config.jax_cache_dir)  # as train.py: a rerun skips the compiles
  r = benchmark(config, args.steps, args.warmup)
  if args.json:
    print(json.dumps({**r, "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count()}))
    return
  mfu = f", MFU: {100 * r['mfu']:.2f}%" if "mfu" in r else ", MFU: n/a (unknown device peak)"
  print(
    f"{jax.device_count()} x {jax.devices()[0].device_kind}: median of {args.steps} steps: "
    f"step time {r['step_seconds']:.4f} s, Tokens/s/device: {r['tokens_per_sec_per_device']:.1f}, "
    f"TFLOP/s/device: {r['tflops_per_sec_per_device']:.4f}{mfu}, host time/step: {r['host_seconds']:.4f} s"
  )
  if r["compiles_while_timed"]:
    print(f"warning: the timed steps compiled: {r['compiles_while_timed']}")


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
