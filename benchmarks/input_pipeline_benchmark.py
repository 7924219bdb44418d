"""Input-pipeline throughput per host, for every dataset_type, on sample data built from the embedded corpus.

    python3 benchmarks/input_pipeline_benchmark.py [--batches 200] [key=value ...]
    python3 benchmarks/input_pipeline_benchmark.py --resume [--resume_records 1000000]

Builds the sample datasets (MaxText.input_pipeline.sample_datasets) in a temporary directory, then for
each dataset type times `--batches` global batches of the real iterator (tokenisation, packing and the
transfer to global jax.Arrays included, after one warm-up batch) and prints tokens/s. The default
shapes are the README quickstart's (8 rows of 256 tokens); override them with key=value.

--resume instead times how long a shuffled TFRecord TFDS stream takes to give its first record after a
restore at records ~0, ~half and ~all of an epoch of `--resume_records` records of about C4's size
(2.2 KB; 16 files), by tf.data skipping the records consumed (MaxText before issue 9) and by
tfds_source's byte-offset position. The dataset is prepared once under --resume_cache (about 2.3 GB for
1M records) and reused; the timings are with its files in the page cache.
"""

import argparse
import contextlib
import functools
import io
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from MaxText import pyconfig  # noqa: E402
from MaxText.input_pipeline import input_pipeline_interface, sample_datasets  # noqa: E402
from MaxText.runtime import mesh

QUICKSTART = ["vocab_size=4096", "max_target_length=256", "per_device_batch_size=8"]
RESUME_FILES = 16


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


@functools.cache
def _resume_builder_class():
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  class MaxtextResumeBenchmark(tfds.core.GeneratorBasedBuilder):
    """`num_records` records of about C4's mean size (2.2 KB): three consecutive embedded-corpus documents each."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, num_records=0, **kwargs):
      self._num_records = num_records
      super().__init__(**kwargs)

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      docs = sample_datasets.split_texts("train")
      for i in range(self._num_records):
        yield i, {"text": f"{i} " + "\n".join(docs[(3 * i + k) % len(docs)] for k in range(3))}

  return MaxtextResumeBenchmark


def _resume_dataset(cache_dir: str, num_records: int):
  """The benchmark's TFRecord TFDS builder of num_records records, prepared under cache_dir once."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  data_dir = os.path.join(cache_dir, str(num_records))
  builder = _resume_builder_class()(data_dir=data_dir, file_format="tfrecord", num_records=num_records)
  if not builder.is_prepared():
    print(f"Preparing {num_records:,} records in {RESUME_FILES} TFRecord files under {data_dir} (once)", flush=True)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=RESUME_FILES))
  return tfds.builder_from_directory(builder.data_dir)


def _tf_data_skip_opener(config, builder, split, decode):
  """MaxText's TFRecord stream before issue 9: a tf.data pipeline whose resume skips the records consumed."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  def open_stream(epoch, position):
    seed = config.data_shuffle_seed + epoch
    ds = builder.as_dataset(split=split, shuffle_files=True, read_config=tfds.ReadConfig(shuffle_seed=seed))
    ds = ds.shuffle(1024, seed=seed, reshuffle_each_iteration=False).skip(int(position or 0)).prefetch(tf.data.AUTOTUNE)
    for i, record in enumerate(tfds.as_numpy(ds), start=int(position or 0) + 1):
      yield decode(record), i

  return open_stream


def _seconds_to_first_record(open_stream, position) -> float:
  start = time.perf_counter()
  next(open_stream(0, position))
  return time.perf_counter() - start


def resume_times(cache_dir: str, num_records: int) -> None:
  """Prints the seconds to the first record after a restore at ~0, ~half and ~all records of the epoch."""
  import types  # pylint: disable=import-outside-toplevel

  from MaxText.input_pipeline import tfds_source  # pylint: disable=import-outside-toplevel

  builder = _resume_dataset(cache_dir, num_records)
  config = types.SimpleNamespace(enable_data_shuffling=True, data_shuffle_seed=0)
  decode = lambda record: record
  old = _tf_data_skip_opener(config, builder, "train", decode)
  new = tfds_source.stream_opener(config, builder, "train", True, decode, 0, 1)
  print(f"{'resume after record':>20} {'tf.data skip':>14} {'byte offset':>14}  (seconds to the first record)", flush=True)
  for consumed in (1, num_records // 2, num_records - 1):
    # The position that a checkpoint holds after `consumed` records: the one given with record `consumed`
    # when the stream is opened at the record count before it (the format of old checkpoints).
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # resume logs
      _, saved = next(new(0, consumed - 1))
      _seconds_to_first_record(new, saved)  # once, so that both methods find its window in the page cache
      seconds = (_seconds_to_first_record(old, consumed), _seconds_to_first_record(new, saved))
    print(f"{consumed:>20,} {seconds[0]:>14.3f} {seconds[1]:>14.4f}", flush=True)


def main(argv) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batches", type=int, default=200)
  parser.add_argument("--resume", action="store_true", help="time TFRecord resumes instead of throughput")
  parser.add_argument("--resume_records", type=int, default=1_000_000)
  parser.add_argument("--resume_cache", default=os.path.join(tempfile.gettempdir(), "maxtext_resume_benchmark"))
  args, overrides = parser.parse_known_args(argv[1:])
  if args.resume:
    resume_times(args.resume_cache, args.resume_records)
    return
  base = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "MaxText", "configs", "base.yml")
  with tempfile.TemporaryDirectory() as root:
    kinds = {"embedded": [], **{k: v.split() for k, v in sample_datasets.write_all(root).items()}}
    kinds["grain, 2 worker processes"] = kinds["grain"] + ["grain_worker_count=2"]
    for kind, flags in kinds.items():
      config = pyconfig.initialize(["bench", base, "run_name=bench", *QUICKSTART, *flags, *overrides])
      print(f"{kind:<28} {tokens_per_second(config, args.batches):>12,.0f} tokens/s per host", flush=True)


if __name__ == "__main__":
  main(sys.argv)
