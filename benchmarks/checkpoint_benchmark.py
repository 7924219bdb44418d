"""Measures checkpoint saves of any config's train state: size on disk, loop blocking time, total save time.

    python3 benchmarks/checkpoint_benchmark.py MaxText/configs/base.yml [key=value ...] [--saves 3]

Saves the state after two train steps (and the data iterator's position) with the same code as train.py,
into a temporary directory, and prints the median over --saves saves.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from MaxText import pyconfig  # noqa: E402
from MaxText.checkpoints import checkpointing
from MaxText.input_pipeline.input_pipeline_interface import create_data_iterator  # noqa: E402
from MaxText.runtime import mesh, sharding
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # noqa: E402
from MaxText.training import jit_steps, training_setup


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def main(argv) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--saves", type=int, default=3)
  args, config_argv = parser.parse_known_args(argv[1:])
  with tempfile.TemporaryDirectory() as out:
    config = pyconfig.initialize([argv[0], *config_argv], run_name="ckpt_benchmark", base_output_directory=out)
    device_mesh = mesh.create_device_mesh(config)
    setup = training_setup.build(config, device_mesh)
    state = setup.init_state(config, device_mesh)
    data_iterator = create_data_iterator(config, device_mesh)
    step_fn = jit_steps.jit_train_step(setup.model, config, setup.features, device_mesh, setup.state_shardings)
    with sharding.logical_context(device_mesh, config):
      for _ in range(2):  # a trained state: optimizer moments that are not all zeros (which compress away)
        state, _ = step_fn(state, next(data_iterator))
    manager = checkpointing.create_checkpoint_manager(config)
    blocked, total = [], []
    for step in range(args.saves):
      start = time.time()
      blocked.append(checkpointing.save_checkpoint(manager, step, state, data_iterator))
      manager.wait_until_finished()
      total.append(time.time() - start)
    size = _dir_bytes(os.path.join(config.checkpoint_dir, "0"))
    manager.close()
    data_iterator.close()
  print(
    f"{'async' if config.async_checkpointing else 'sync'} checkpoint saves: size {size / 2**20:.1f} MiB, "
    f"loop blocked {np.median(blocked):.3f} s, total save {np.median(total):.3f} s (median of {args.saves})"
  )


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
