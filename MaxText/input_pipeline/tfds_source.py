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

After a resume on another number of data shards (tfds_resplit) a stream's position can also be {"parts": [...]}:
the rest of streams of the saved layout that this shard finishes before it reads its own share
(read_parts; tfds_resplit describes the format and why).
"""

import numpy as np

from MaxText import max_logging
from MaxText.errors import UserError

_WINDOW = 1024  # records shuffled together; the most that a resume re-reads
_POSITION_KEYS = {"file", "record", "offset", "taken"}
_PART_KEYS = {"shard", "of", "epoch", "last", "position", "phase", "every", "used"}


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


def is_count(value, least: int = 0) -> bool:
  """Whether a checkpoint's field is an int (not a bool) >= least."""
  return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _start(position, order: list[int], files, shuffle: bool, where: str) -> dict:
  """The position dict to continue from; checks that a checkpoint's position fits this dataset."""
  if position is None:
    return {"file": 0, "record": 0, "offset": None, "taken": 0}
  if isinstance(position, int):
    return _position_of_count(position, order, files, shuffle, where)
  if (
    not isinstance(position, dict)
    or set(position) != _POSITION_KEYS
    or not all(is_count(position[key]) for key in ("file", "record", "taken"))
    or not (position["offset"] is None or is_count(position["offset"]))
  ):
    raise UserError(f"the checkpoint's data position {position!r} is not a TFRecord stream position of {where}")
  file, record = position["file"], position["record"]
  if file > len(order) or (file < len(order) and record > files[order[file]][2]):
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


class Share:
  """Data shard shard_index of shard_count's share of a TFRecord split: its files, the order in which each epoch
  reads them, and the shuffle of each window. The same (data_shuffle_seed, epoch, shard) gives the same records
  in any process."""

  def __init__(self, config, builder, split: str, train: bool, shard_index: int, shard_count: int):
    self.shuffle = train and config.enable_data_shuffling
    self.files = _shard_files(builder, split, shard_index, shard_count)
    self.where = f"{builder.name}:{split} shard {shard_index} of {shard_count}"
    self._seed, self._shard = config.data_shuffle_seed, [shard_index, shard_count]
    self._features = builder.info.features

  def _key(self, epoch: int) -> list[int]:
    return [(self._seed + epoch) % 2**32, *self._shard]

  def order(self, epoch: int) -> list[int]:
    """The indices into self.files in the order that the epoch reads them."""
    if not self.shuffle:
      return list(range(len(self.files)))
    return list(np.random.default_rng([*self._key(epoch), 0]).permutation(len(self.files)))

  def start(self, epoch: int, position) -> dict:
    """A checkpoint's position (None, a legacy record count or a dict) as a dict, checked against the files."""
    return _start(position, self.order(epoch), self.files, self.shuffle, self.where)

  def window_after(self, order: list[int], file: int, record: int, count: int) -> tuple[int, int]:
    """(file, record) of the window `count` windows after the one that starts at `record` of the order's `file`;
    (len(order), 0) past the epoch's last window."""
    while file < len(order):
      windows = -(-(self.files[order[file]][2] - record) // _WINDOW)  # this window and the file's windows after it
      if count < windows:
        return file, record + count * _WINDOW
      count, file, record = count - windows, file + 1, 0
    return len(order), 0

  def read(self, epoch: int, at: dict, every: int = 1):
    """(example, position after it) of the epoch from position `at` on: the rest of its window, then every
    `every`-th window after it. The position after a record is that of the next record this reader reads."""
    # Here, not at the top: google_crc32c is needed for TFRecord files only (synthetic data runs without it).
    from MaxText.input_pipeline.tfrecord_reader import TFRecordFile  # pylint: disable=import-outside-toplevel

    key, order = self._key(epoch), self.order(epoch)
    file, record, offset, taken = at["file"], at["record"], at["offset"], at["taken"]
    while file < len(order):
      filename, skip, take = self.files[order[file]]
      if record >= take:  # a position at the end of a file
        file, record, offset, taken = file + 1, 0, None, 0
        continue
      with TFRecordFile(filename) as reader:
        if offset is None:
          reader.skip(skip + record)  # headers only; at most once per file and epoch
        else:
          reader.seek(offset)
        in_file = file
        while file == in_file:
          offset = reader.tell()
          window = [reader.read() for _ in range(min(_WINDOW, take - record))]
          if window[-1] is None:
            raise UserError(f"{filename} holds fewer records than its dataset_info.json says ({skip + take})")
          n = len(window)
          ranks = np.random.default_rng([*key, 1, order[file], record]).permutation(n) if self.shuffle else range(n)
          file, next_record = self.window_after(order, file, record, every)
          next_offset = None
          if file == in_file:
            reader.skip(next_record - record - n)  # the windows that other readers of this share read
            next_offset = reader.tell()
          for j in range(taken, n):
            if j + 1 < n:
              after = {"file": in_file, "record": record, "offset": offset, "taken": j + 1}
            else:
              after = {"file": file, "record": next_record, "offset": next_offset, "taken": 0}
            yield self._features.deserialize_example_np(window[ranks[j]]), after
          record, offset, taken = next_record, next_offset, 0


class Shares:
  """Share(shard, count) of a split for any number of data shards, made once each."""

  def __init__(self, config, builder, split: str, train: bool):
    self._args, self._made = (config, builder, split, train), {}

  def __call__(self, shard_index: int, shard_count: int) -> Share:
    if (shard_index, shard_count) not in self._made:
      self._made[shard_index, shard_count] = Share(*self._args, shard_index, shard_count)
    return self._made[shard_index, shard_count]


def settle_part(shares: Shares, part: dict) -> dict | None:
  """The part (tfds_resplit's format) moved to its next record: past the end of an epoch, to its first window
  (`phase`) of the next epoch that has one; None when it has no record left up to its epoch `last`."""
  share = shares(part["shard"], part["of"])
  epoch, position = part["epoch"], part["position"]
  while position["file"] >= len(share.files):
    epoch += 1
    if epoch > part["last"]:
      return None
    file, record = share.window_after(share.order(epoch), 0, 0, part["phase"])
    position = {"file": file, "record": record, "offset": None, "taken": 0}
  return {**part, "epoch": epoch, "position": position}


def stream_part(shares: Shares, shard: int, count: int, epoch: int, position, last: int) -> dict | None:
  """The rest of shard `shard` of `count`'s stream from a checkpoint's position in `epoch` through epoch `last`,
  as a settled part; None when nothing is left."""
  if epoch > last:
    return None
  share = shares(shard, count)
  order = share.order(epoch)
  at = share.start(epoch, position)
  if at["file"] < len(order) and at["record"] >= share.files[order[at["file"]]][2]:  # the end of a file
    at = {"file": at["file"] + 1, "record": 0, "offset": None, "taken": 0}
  part = {"shard": shard, "of": count, "epoch": epoch, "last": last, "position": at, "phase": 0, "every": 1, "used": 0}
  return settle_part(shares, part)


def split_part(shares: Shares, part: dict, count: int) -> list[dict | None]:
  """The part dealt window by window to `count` readers: reader i reads its windows i, i + count, i + 2 count, ...
  (the first one the rest of the window in progress, with the tokens already used); None for a reader left
  without any."""
  share = shares(part["shard"], part["of"])
  order, every = share.order(part["epoch"]), part["every"]
  pieces = []
  for i in range(count):
    piece = {**part, "phase": part["phase"] + i * every, "every": every * count}
    if i > 0:
      file, record = share.window_after(order, part["position"]["file"], part["position"]["record"], i * every)
      piece.update(position={"file": file, "record": record, "offset": None, "taken": 0}, used=0)
    pieces.append(settle_part(shares, piece))
  return pieces


def check_parts(shares: Shares, position) -> list[dict]:
  """The parts of a checkpoint's {"parts": [...]} position; a UserError if one is malformed or does not fit."""
  parts = position.get("parts") if set(position) == {"parts"} else None
  if not isinstance(parts, list):
    raise UserError(f"the checkpoint's data position {position!r:.300} is not a TFRecord stream position")
  for part in parts:
    if not (
      isinstance(part, dict)
      and set(part) == _PART_KEYS
      and all(is_count(part[key]) for key in ("shard", "epoch", "last", "phase", "used"))
      and is_count(part["of"], 1)
      and is_count(part["every"], 1)
      and part["shard"] < part["of"]
      and part["epoch"] <= part["last"]
      and isinstance(part["position"], dict)
    ):
      raise UserError(f"the checkpoint's data position holds a malformed stream part {part!r:.300}")
    share = shares(part["shard"], part["of"])
    if share.start(part["epoch"], part["position"])["file"] >= len(share.files):
      raise UserError(f"the checkpoint's data position holds a stream part past the end of its epoch: {part!r:.300}")
  return parts


def read_parts(shares: Shares, parts: list[dict], decode):
  """(decode(record), {"parts": the parts left}) of the parts' records, one part after another."""
  for index, part in enumerate(parts):
    rest, used = list(parts[index + 1 :]), part["used"]
    while part is not None:
      records = shares(part["shard"], part["of"]).read(part["epoch"], part["position"], part["every"])
      moved = False
      for example, after in records:
        document, moved = decode(example), True
        if used:  # tokens that the saved stream's packer had already used
          document, used = {key: value[used:] for key, value in document.items()}, 0
        part = settle_part(shares, {**part, "position": after, "used": 0})
        yield document, {"parts": [part, *rest] if part is not None else rest}
      if not moved:  # a settled part always has a record; only a hand-made position gets here
        break


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
  shares = Shares(config, builder, split, train)
  share = shares(shard_index, shard_count)

  def open_stream(epoch: int, position):
    if isinstance(position, dict) and "parts" in position:
      parts = check_parts(shares, position)
      max_logging.log(
        f"Resuming {share.where} epoch {epoch}: it first finishes {len(parts)} part(s) of streams saved on "
        f"{' and '.join(sorted({str(p['of']) for p in parts}))} data shards, then reads its own share"
      )
      yield from read_parts(shares, parts, decode)
      return
    at = share.start(epoch, position)
    if position is not None:
      max_logging.log(
        f"Resuming {share.where} epoch {epoch} at record {at['record'] + at['taken']} of its file {at['file']} "
        "(in the epoch's order), without re-reading earlier records"
      )
    for example, after in share.read(epoch, at):
      yield decode(example), after

  return open_stream
