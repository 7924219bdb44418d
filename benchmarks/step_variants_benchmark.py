"""Compares the step time of variants of one config, timed in turns in one process (e.g. the cost of statistics):

    python3 benchmarks/step_variants_benchmark.py MaxText/configs/base.yml [key=value ...] \
      --variant numerics_debug_config=stats_freq1.yml --variant "numerics_debug_config=stats_freq100.yml" [--rounds 60]

The base config and each variant (the base plus the variant's space-separated key=value) are compiled with
train.py's train step, each on its own state and the same batch. Then every round runs one step of each, in a
rotating order, so a shared machine's load falls on all of them alike; the report gives each variant's median
step time and the median over rounds of its ratio to the base's step in the same round.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  # pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  # pylint: disable=wrong-import-position

from MaxText import pyconfig  # noqa: E402  # pylint: disable=wrong-import-position
from MaxText.aot import aot_compile
from MaxText.input_pipeline.input_pipeline_interface import create_data_iterator  # noqa: E402  # pylint: disable=wrong-import-position
from MaxText.runtime import mesh, sharding
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # noqa: E402  # pylint: disable=wrong-import-position
from MaxText.training import training_setup


def _compiled(config):
  """(compiled step, fresh state, mesh) of one variant."""
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  step = aot_compile.compile_train_step(setup, config, device_mesh)
  state = setup.init_state(config, device_mesh)
  return step, state, device_mesh


def compare(configs: dict, rounds: int, warmup: int) -> dict:
  """{variant: (median seconds, median ratio to the first variant)} over `rounds` interleaved steps after `warmup`."""
  runs = {name: _compiled(config) for name, config in configs.items()}
  first = next(iter(configs.values()))
  iterator = create_data_iterator(first, runs[next(iter(runs))][2])
  batch = next(iterator)
  iterator.close()
  names = list(runs)
  states = {name: runs[name][1] for name in names}
  times = {name: [] for name in names}
  for r in range(warmup + rounds):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      step, _, device_mesh = runs[name]
      with sharding.logical_context(device_mesh, configs[name]):
        start = time.perf_counter()
        states[name], metrics = step(states[name], batch)
        jax.block_until_ready(metrics)
      if r >= warmup:
        times[name].append(time.perf_counter() - start)
  base = np.array(times[names[0]])
  return {name: (float(np.median(t)), float(np.median(np.array(t) / base))) for name, t in times.items()}


def main(argv) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variant", action="append", default=[], help="key=value ... added to the base config")
  parser.add_argument("--rounds", type=int, default=60)
  parser.add_argument("--warmup", type=int, default=3)
  args, config_argv = parser.parse_known_args(argv[1:])
  base = [argv[0], *config_argv]
  configs = {"base": pyconfig.initialize(base, run_name="benchmark", enable_tensorboard=False)}
  for variant in args.variant:
    configs[variant] = pyconfig.initialize(base + variant.split(), run_name="benchmark", enable_tensorboard=False)
  results = compare(configs, args.rounds, args.warmup)
  print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, {args.rounds} rounds (one step of each variant per round):")
  for name, (seconds, ratio) in results.items():
    print(f"  {name}: median step {seconds:.4f} s, {100 * (ratio - 1):+.1f}% (median of the per-round ratios to base)")


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
