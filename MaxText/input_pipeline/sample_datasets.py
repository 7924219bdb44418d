"""Writes small local datasets of every supported kind from the embedded corpus, to try the pipelines offline.

    python3 -m MaxText.input_pipeline.sample_datasets /tmp/maxtext_data

writes a TFDS dataset (TFRecord and ArrayRecord), ArrayRecord files of tf.train.Example records,
Parquet and JSON-lines files, and prints the train.py flags that read each. Tests and benchmarks use it.
"""

import functools
import json
import os
import sys

from MaxText.input_pipeline import embedded_corpus, tf_example

TFDS_NAME = "maxtext_sample_text"


def split_texts(split: str, limit: int | None = None) -> list[str]:
  docs = embedded_corpus.split_documents("train" if split == "train" else "eval")
  return docs[:limit] if limit else docs


@functools.cache
def _tfds_builder_class():
  """A TFDS builder of the embedded corpus (defined once per process: TFDS registers builder classes)."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  class MaxtextSampleText(tfds.core.GeneratorBasedBuilder):
    """The embedded corpus as a TFDS dataset with train and validation splits of `text`."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, limit=None, **kwargs):
      self._limit = limit
      super().__init__(**kwargs)

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {"train": self._generate_examples("train"), "validation": self._generate_examples("validation")}

    def _generate_examples(self, split):
      for i, text in enumerate(split_texts(split, self._limit)):
        yield i, {"text": text}

  return MaxtextSampleText


def write_tfds(data_dir: str, file_format: str, limit: int | None = None) -> str:
  """Prepares the TFDS dataset under data_dir ("tfrecord" or "array_record"); returns the version directory."""
  builder = _tfds_builder_class()(data_dir=data_dir, file_format=file_format, limit=limit)
  builder.download_and_prepare()
  return builder.data_dir


def write_array_records(path_prefix: str, texts, num_shards: int = 2, raw: bool = False) -> list[str]:
  """ArrayRecord shards of tf.train.Example {"text": bytes} records (or raw UTF-8 with raw=True)."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=import-outside-toplevel

  paths = [f"{path_prefix}.array_record-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)]
  os.makedirs(os.path.dirname(os.path.abspath(path_prefix)), exist_ok=True)
  writers = [ArrayRecordWriter(p, "group_size:1") for p in paths]
  for i, text in enumerate(texts):
    writers[i % num_shards].write(text.encode("utf-8") if raw else tf_example.serialize({"text": text}))
  for writer in writers:
    writer.close()
  return paths


def write_parquet(path: str, texts) -> str:
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  pq.write_table(pa.table({"text": list(texts)}), path)
  return path


def write_jsonl(path: str, texts) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for text in texts:
      f.write(json.dumps({"text": text}) + "\n")
  return path


def write_all(root: str, limit: int | None = None) -> dict:
  """Every kind of sample dataset under root; returns {kind: train.py flags that read it}."""
  train, evaluation = split_texts("train", limit), split_texts("eval", limit)
  tfrecord_dir = os.path.join(root, "tfds_tfrecord")
  array_record_dir = os.path.join(root, "tfds_array_record")
  write_tfds(tfrecord_dir, "tfrecord", limit)
  version_dir = write_tfds(array_record_dir, "array_record", limit)
  write_array_records(os.path.join(root, "grain", "train"), train)
  grain_train_glob = os.path.join(root, "grain", "train.array_record-*")
  grain_eval = write_array_records(os.path.join(root, "grain", "eval"), evaluation, num_shards=1)
  parquet_train = write_parquet(os.path.join(root, "hf", "train.parquet"), train)
  parquet_eval = write_parquet(os.path.join(root, "hf", "eval.parquet"), evaluation)
  write_jsonl(os.path.join(root, "text.jsonl"), train)
  return {
    "tfds (TFRecord)": f"dataset_type=tfds dataset_path={tfrecord_dir} dataset_name={TFDS_NAME}",
    "tfds (ArrayRecord)": f"dataset_type=tfds dataset_path={array_record_dir} dataset_name={TFDS_NAME}",
    "grain (TFDS files)": f"dataset_type=grain grain_train_files={version_dir}/{TFDS_NAME}-train.array_record*",
    "grain": f"dataset_type=grain grain_train_files={grain_train_glob} grain_eval_files={grain_eval[0]}",
    "hf (Parquet)": f"dataset_type=hf hf_path=parquet hf_train_files={parquet_train} hf_eval_files={parquet_eval}",
  }


def main(argv) -> None:
  if len(argv) != 2:
    sys.exit(f"usage: python3 -m MaxText.input_pipeline.sample_datasets <output directory>\n\n{__doc__}")
  for kind, flags in write_all(argv[1]).items():
    print(f"{kind}:\n  python3 MaxText/train.py MaxText/configs/base.yml run_name=<name> {flags}")


if __name__ == "__main__":
  main(sys.argv)
