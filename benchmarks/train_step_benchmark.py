"""Times the train step of any config (after compilation, median of N steps).

    python3 benchmarks/train_step_benchmark.py MaxText/configs/base.yml [key=value ...] [--steps 20] [--warmup 3]

Uses the same config, model, sharding and jitted train_step as train.py, on one fixed batch of the
configured dataset (so the input pipeline is not measured), and prints tokens/s, step time,
TFLOP/s/device and MFU (when the device's peak is known).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  # pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  # pylint: disable=wrong-import-position

from MaxText import flops, mesh, pyconfig, train_state, train_step  # noqa: E402  # pylint: disable=wrong-import-position
from MaxText.errors import run_and_exit_on_user_error  # noqa: E402  # pylint: disable=wrong-import-position
from MaxText.input_pipeline.input_pipeline_interface import create_data_iterator  # noqa: E402  # pylint: disable=wrong-import-position


def benchmark(config, steps: int, warmup: int) -> dict:
  """Median seconds of `steps` train steps after `warmup`, with the step compiled (and its memory checked) first."""
  device_mesh = mesh.create_device_mesh(config)
  setup = train_state.build(config, device_mesh)
  step_fn = train_step.compile_train_step(setup.model, config, device_mesh, setup.abstract_state)
  state = train_state.init_train_state(setup.model, setup.tx, config, device_mesh, setup.state_shardings)
  iterator = create_data_iterator(config, device_mesh)
  batch = next(iterator)
  iterator.close()
  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    state, metrics = step_fn(state, batch)
    jax.block_until_ready(metrics)
    if i >= warmup:
      times.append(time.perf_counter() - start)
  seconds = float(np.median(times))
  step_flops = flops.training_tflops_per_device(config)
  tokens = flops.tokens_per_device_per_step(config)
  result = {
    "step_seconds": seconds,
    "tokens_per_sec_per_device": tokens / seconds,
    "tflops_per_sec_per_device": step_flops.total_tflops / seconds,
  }
  mfu = flops.mfu(result["tflops_per_sec_per_device"], jax.devices()[0].device_kind)
  if mfu is not None:
    result["mfu"] = mfu
  return result


def main(argv) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  args, config_argv = parser.parse_known_args(argv[1:])
  config = pyconfig.initialize([argv[0], *config_argv], run_name="benchmark", enable_tensorboard=False)
  r = benchmark(config, args.steps, args.warmup)
  mfu = f", MFU: {100 * r['mfu']:.2f}%" if "mfu" in r else ", MFU: n/a (unknown device peak)"
  print(
    f"{jax.device_count()} x {jax.devices()[0].device_kind}: median of {args.steps} steps: "
    f"step time {r['step_seconds']:.4f} s, Tokens/s/device: {r['tokens_per_sec_per_device']:.1f}, "
    f"TFLOP/s/device: {r['tflops_per_sec_per_device']:.4f}{mfu}"
  )


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
