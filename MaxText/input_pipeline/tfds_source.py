"""dataset_type=tfds: a prepared TFDS dataset in dataset_path (a local directory or gs://). Never downloads.

ArrayRecord datasets are read by random access (exact resume, batches independent of the process count);
TFRecord datasets (such as C4 3.0.1) stream through tf.data, each process reading its own share of the
split; their position is the number of records read, and a restore re-reads (skips) that many.
"""

from MaxText import max_logging
from MaxText.errors import UserError

_SHUFFLE_BUFFER = 1024


def _builder(config, name: str):
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel  # TensorFlow: seconds to import

  if not name:
    raise UserError("dataset_name is empty; give the TFDS name, e.g. dataset_name=c4/en:3.0.1")
  try:
    builder = tfds.builder(name, data_dir=config.dataset_path or None)
  except Exception as e:  # pylint: disable=broad-except  # tfds raises many kinds for a bad name or version
    raise UserError(f"dataset_name={name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
  if not builder.is_prepared():
    raise UserError(
      f"dataset_name={name} is not prepared under dataset_path={config.dataset_path} (looked in {builder.data_dir}); "
      "MaxText never downloads: copy it there (download_dataset.sh) or build it with tfds first"
    )
  return builder


def _split_name(builder, split: str, key: str) -> str:
  if split not in builder.info.splits:
    raise UserError(f"{key}={split} is not a split of {builder.name}; it has: {', '.join(builder.info.splits)}")
  return split


def is_array_record(builder) -> bool:
  return "array_record" in str(builder.info.file_format).lower()


def open_builder(config, train: bool):
  """(builder, split) for the train or eval data."""
  name = config.dataset_name if train or not config.eval_dataset_name else config.eval_dataset_name
  builder = _builder(config, name)
  split = _split_name(builder, config.train_split if train else config.eval_split, "train_split" if train else "eval_split")
  return builder, split


def random_access_records(builder, split: str):
  return builder.as_data_source(split=split)


def stream_opener(config, builder, split: str, train: bool, decode, process_index: int, process_count: int):
  """open_stream(epoch, position) for packing.StreamCursor over this process's share of a TFRecord split."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  shuffle = train and config.enable_data_shuffling
  process_split = tfds.split_for_jax_process(split, process_index=process_index, process_count=process_count)

  def open_stream(epoch: int, position):
    seed = config.data_shuffle_seed + epoch
    read_config = tfds.ReadConfig(shuffle_seed=seed)
    ds = builder.as_dataset(split=process_split, shuffle_files=shuffle, read_config=read_config)
    if shuffle:
      ds = ds.shuffle(_SHUFFLE_BUFFER, seed=seed, reshuffle_each_iteration=False)
    skipped = int(position or 0)
    if skipped:
      max_logging.log(f"Resuming {builder.name}:{split} epoch {epoch} by re-reading {skipped} records")
      ds = ds.skip(skipped)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    for i, record in enumerate(tfds.as_numpy(ds), start=skipped + 1):
      yield decode(record), i

  return open_stream
