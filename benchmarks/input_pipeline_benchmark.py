"""Input-pipeline throughput per host, for every dataset_type, on sample data built from the embedded corpus.

    python3 benchmarks/input_pipeline_benchmark.py [--batches 200] [key=value ...]

Builds the sample datasets (MaxText.input_pipeline.sample_datasets) in a temporary directory, then for
each dataset type times `--batches` global batches of the real iterator (tokenisation, packing and the
transfer to global jax.Arrays included, after one warm-up batch) and prints tokens/s. The default
shapes are the README quickstart's (8 rows of 256 tokens); override them with key=value.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from MaxText import mesh, pyconfig  # noqa: E402
from MaxText.input_pipeline import input_pipeline_interface, sample_datasets  # noqa: E402

QUICKSTART = ["vocab_size=4096", "max_target_length=256", "per_device_batch_size=8"]


def tokens_per_second(config, batches: int) -> float:
  device_mesh = mesh.create_device_mesh(config)
  iterator = input_pipeline_interface.create_data_iterator(config, device_mesh)
  jax.block_until_ready(next(iterator))
  start = time.perf_counter()
  for _ in range(batches):
    jax.block_until_ready(next(iterator))
  seconds = time.perf_counter() - start
  iterator.close()
  return batches * config.global_batch_size_to_load * config.max_target_length / seconds / jax.process_count()


def main(argv) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batches", type=int, default=200)
  args, overrides = parser.parse_known_args(argv[1:])
  base = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "MaxText", "configs", "base.yml")
  with tempfile.TemporaryDirectory() as root:
    kinds = {"embedded": [], **{k: v.split() for k, v in sample_datasets.write_all(root).items()}}
    kinds["grain, 2 worker processes"] = kinds["grain"] + ["grain_worker_count=2"]
    for kind, flags in kinds.items():
      config = pyconfig.initialize(["bench", base, "run_name=bench", *QUICKSTART, *flags, *overrides])
      print(f"{kind:<28} {tokens_per_second(config, args.batches):>12,.0f} tokens/s per host", flush=True)


if __name__ == "__main__":
  main(sys.argv)
