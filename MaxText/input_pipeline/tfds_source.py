"""dataset_type=tfds: a prepared TFDS dataset in dataset_path (a local directory or gs://). Never downloads.

ArrayRecord datasets are read by random access (exact resume, batches independent of the process count).

TFRecord datasets (such as C4 3.0.1) are streamed, one stream per data shard over its share of the split
(tfds.split_for_jax_process). The stream reads the share's files one after another (in a seeded order per
epoch when shuffling) with tfrecord_reader, and shuffles records within windows of _WINDOW consecutive
records of a file by a permutation seeded by (seed, epoch, shard, file, window). The position after a
record is {"file", "record", "offset", "taken"}: the file's index in the epoch's order, the record index
and byte offset of its window's start, and how many of the window's records were used. Resuming seeks to
that byte and reads one window, whatever the position: a few milliseconds, where re-reading the records
consumed in the epoch took hours at C4 scale.

Why not tf.data: a TFRecordDataset cannot start at a byte offset, and checkpointing a tf.data iterator
saves its shuffle buffer (megabytes), too slow to snapshot after every batch as StreamCursor does.
TFDS wrote the records in a shuffled order already, so shuffling files plus windows is enough mixing.
"""

import numpy as np

from MaxText import max_logging
from MaxText.errors import UserError

_WINDOW = 1024  # records shuffled together; the most that a resume re-reads


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


def _shard_files(builder, split: str, shard_index: int, shard_count: int) -> list[tuple[str, int, int]]:
  """(filename, skip, take) of each file holding records of the shard's share of the split, in the split's order."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  subsplit = tfds.split_for_jax_process(split, process_index=shard_index, process_count=shard_count)
  return [(f.filename, f.skip, f.take) for f in builder.info.splits[subsplit].file_instructions if f.take > 0]


def _start(position, order: list[int], files, shuffle: bool, where: str) -> dict:
  """The position dict to continue from; checks that a checkpoint's position fits this dataset."""
  if position is None:
    return {"file": 0, "record": 0, "offset": None, "taken": 0}
  if isinstance(position, int):
    return _position_of_count(position, order, files, shuffle, where)
  if not isinstance(position, dict) or set(position) != {"file", "record", "offset", "taken"}:
    raise UserError(f"the checkpoint's data position {position!r} is not a TFRecord stream position of {where}")
  file, record = position["file"], position["record"]
  if not 0 <= file <= len(order) or (file < len(order) and not 0 <= record <= files[order[file]][2]):
    raise UserError(
      f"the checkpoint's data position {position} does not fit {where} ({len(order)} files): "
      "was the dataset prepared again since the checkpoint?"
    )
  return dict(position)


def _position_of_count(count: int, order: list[int], files, shuffle: bool, where: str) -> dict:
  """A position saved by MaxText before positions had byte offsets: the number of records read in the epoch."""
  if shuffle:
    max_logging.warn(
      f"the checkpoint counts {count} records read of {where} in an older shuffled order: continuing after as many "
      "records of the current order, so the rest of this epoch is not exactly the records the run would have read"
    )
  for i, file in enumerate(order):
    take = files[file][2]
    if count < take:
      window = count - count % _WINDOW
      return {"file": i, "record": window, "offset": None, "taken": count - window}
    count -= take
  return {"file": len(order), "record": 0, "offset": None, "taken": 0}


def stream_opener(config, builder, split: str, train: bool, decode, shard_index: int, shard_count: int):
  """open_stream(epoch, position) for packing.StreamCursor over one data shard's share of a TFRecord split.

  Args:
    config: the run's Config (enable_data_shuffling, data_shuffle_seed).
    builder: the split's TFDS builder (open_builder).
    split: the split's name.
    train: shuffle (with enable_data_shuffling) when True; eval streams are read in order.
    decode: record (the dict that tfds.as_numpy gives) -> document.
    shard_index: which share of the split, in [0, shard_count).
    shard_count: into how many disjoint shares the split is cut.

  Returns:
    open_stream(epoch, position): an iterator of (decode(record), position after the record); position None
    is the start of the epoch. The same (data_shuffle_seed, epoch, shard) gives the same records in any process.
  """
  shuffle = train and config.enable_data_shuffling
  files = _shard_files(builder, split, shard_index, shard_count)
  features = builder.info.features
  where = f"{builder.name}:{split} shard {shard_index} of {shard_count}"

  def open_stream(epoch: int, position):
    seed = (config.data_shuffle_seed + epoch) % 2**32
    shard = [seed, shard_index, shard_count]
    order = list(np.random.default_rng([*shard, 0]).permutation(len(files))) if shuffle else list(range(len(files)))
    at = _start(position, order, files, shuffle, where)
    if position is not None:
      max_logging.log(
        f"Resuming {where} epoch {epoch} at record {at['record'] + at['taken']} of its file {at['file']} "
        "(in the epoch's order), without re-reading earlier records"
      )
    # Here, not at the top: google_crc32c is needed for TFRecord files only (synthetic data runs without it).
    from MaxText.input_pipeline.tfrecord_reader import TFRecordFile  # pylint: disable=import-outside-toplevel

    for i in range(at["file"], len(order)):
      filename, skip, take = files[order[i]]
      record, offset, taken = (at["record"], at["offset"], at["taken"]) if i == at["file"] else (0, None, 0)
      with TFRecordFile(filename) as reader:
        if offset is None:
          reader.skip(skip + record)  # headers only; at most one file, once per epoch
        else:
          reader.seek(offset)
        while record < take:
          offset = reader.tell()
          window = [reader.read() for _ in range(min(_WINDOW, take - record))]
          if window[-1] is None:
            raise UserError(f"{filename} holds fewer records than its dataset_info.json says ({skip + take})")
          n = len(window)
          ranks = np.random.default_rng([*shard, 1, order[i], record]).permutation(n) if shuffle else range(n)
          for j in range(taken, n):
            if j + 1 < n:
              after = {"file": i, "record": record, "offset": offset, "taken": j + 1}
            elif record + n < take:
              after = {"file": i, "record": record + n, "offset": reader.tell(), "taken": 0}
            else:
              after = {"file": i + 1, "record": 0, "offset": None, "taken": 0}
            yield decode(features.deserialize_example_np(window[ranks[j]])), after
          record, taken = record + n, 0

  return open_stream
