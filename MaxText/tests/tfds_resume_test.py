"""TFRecord TFDS streams (tfds_source.stream_opener): shards, exact and cheap resume, shuffling, damaged files."""

import functools
import json
import os
import shutil
import types

import pytest

from MaxText.errors import UserError
from MaxText.input_pipeline import packing, tfds_source, tfrecord_reader

NUM_RECORDS = 203  # not a multiple of the files, shards or windows: every share and window has an odd end
NUM_FILES = 4
WINDOW = 8  # tfds_source._WINDOW in these tests, so that a file holds several windows and a partial one
PADDING = 4000  # bytes per record, so that reading the records before a position is visible in the bytes read


@functools.cache
def _builder_class():
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  class MaxtextResumeTestRecords(tfds.core.GeneratorBasedBuilder):
    """Records "record 0000 xxx...", "record 0001 xxx...", ... in one train split."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      for i in range(NUM_RECORDS):
        yield i, {"text": f"record {i:04d} " + "x" * PADDING}

  return MaxtextResumeTestRecords


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  prepared = _builder_class()(data_dir=str(tmp_path_factory.mktemp("tfds")), file_format="tfrecord")
  prepared.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=NUM_FILES))
  assert len(prepared.info.splits["train"].file_instructions) == NUM_FILES
  return tfds.builder_from_directory(prepared.data_dir)


@pytest.fixture(autouse=True)
def small_windows(monkeypatch):
  monkeypatch.setattr(tfds_source, "_WINDOW", WINDOW)


def _opener(builder, shard=(0, 1), shuffle=True, seed=0, train=True):
  config = types.SimpleNamespace(enable_data_shuffling=shuffle, data_shuffle_seed=seed)
  decode = lambda record: record["text"].decode()[:11]  # "record 0042"
  return tfds_source.stream_opener(config, builder, "train", train, decode, *shard)


def _epoch(open_stream, epoch=0):
  return [record for record, _ in open_stream(epoch, None)]


def _walk(open_stream, epochs):
  """[(cursor state before the record, record)] of an uninterrupted StreamCursor over `epochs` epochs."""
  cursor, out = packing.StreamCursor(open_stream, epochs), []
  while cursor.current() is not None:
    out.append((json.loads(json.dumps(cursor.get_state())), cursor.current()))
    cursor.advance()
  return out


def _rest(open_stream, epochs, state):
  """The records a StreamCursor restored at `state` gives until the end."""
  cursor, out = packing.StreamCursor(open_stream, epochs), []
  cursor.set_state(state)
  while cursor.current() is not None:
    out.append(cursor.current())
    cursor.advance()
  return out


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("shard_count", [1, 2, 3])
def test_shards_are_disjoint_and_cover_the_split(builder, shuffle, shard_count):
  shares = [_epoch(_opener(builder, (k, shard_count), shuffle)) for k in range(shard_count)]
  every = [record for share in shares for record in share]
  assert sorted(every) == [f"record {i:04d}" for i in range(NUM_RECORDS)]
  assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_unshuffled_records_are_those_of_tfds_in_order(builder):
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  config = types.SimpleNamespace(enable_data_shuffling=False, data_shuffle_seed=0)
  ours = [record for record, _ in tfds_source.stream_opener(config, builder, "train", False, lambda r: r, 1, 2)(0, None)]
  in_order = tfds.ReadConfig(interleave_cycle_length=1)
  split = tfds.split_for_jax_process("train", process_index=1, process_count=2)
  theirs = list(tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False, read_config=in_order)))
  assert ours == theirs


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_anywhere_continues_exactly(builder, shuffle):
  open_stream = _opener(builder, (1, 3), shuffle)
  walk = _walk(open_stream, 2)
  positions = [state["position"] for state, _ in walk]
  per_epoch = sum(1 for state, _ in walk if state["epoch"] == 0)
  mid_window = next(i for i, p in enumerate(positions) if p and p["taken"] == WINDOW // 2)
  window_start = next(i for i, p in enumerate(positions) if p and p["record"] > 0 and p["taken"] == 0)
  file_start = next(i for i, p in enumerate(positions) if p and p["file"] == 1)
  later_file = next(i for i, p in enumerate(positions) if p and p["file"] == 1 and p["record"] > WINDOW)
  last = per_epoch - 1
  for i in [0, 1, mid_window, window_start, file_start, later_file, last, per_epoch, per_epoch + 5, len(walk) - 1]:
    assert _rest(open_stream, 2, walk[i][0]) == [record for _, record in walk[i:]], f"resumed at {walk[i][0]}"
  end_of_epoch = {"epoch": 0, "position": {"file": len(set(p["file"] for p in positions if p)), "record": 0}}
  end_of_epoch["position"].update(offset=None, taken=0)
  assert _rest(open_stream, 2, end_of_epoch) == [record for _, record in walk[per_epoch:]]


def test_resume_reads_one_window_not_the_records_before(builder, monkeypatch):
  open_stream = _opener(builder, (0, 1), shuffle=True)
  walk = _walk(open_stream, 1)
  reads = []
  original_read, original_skip = tfrecord_reader.TFRecordFile.read, tfrecord_reader.TFRecordFile.skip
  monkeypatch.setattr(tfrecord_reader.TFRecordFile, "read", lambda self: reads.append(1) or original_read(self))
  monkeypatch.setattr(tfrecord_reader.TFRecordFile, "skip", lambda self, n: reads.extend([1] * n) or original_skip(self, n))

  def cost_of_first_record(state):
    """(records, bytes) read by this process to resume at `state` and get one record."""
    reads.clear()
    with open("/proc/self/io", encoding="ascii") as f:
      before = int(f.readline().split()[1])  # rchar: bytes read by any code (TensorFlow's included)
    cursor = packing.StreamCursor(open_stream, 1)
    cursor.set_state(state)
    assert cursor.current() is not None
    with open("/proc/self/io", encoding="ascii") as f:
      return len(reads), int(f.readline().split()[1]) - before

  cost_of_first_record(walk[0][0])  # warm-up: lazily loaded code and files
  for i in [len(walk) - 1, len(walk) // 2, 1]:
    records, read_bytes = cost_of_first_record(walk[i][0])
    assert records <= WINDOW, f"resuming at record {i} of {len(walk)} read {records} records"
    assert read_bytes < (WINDOW + 4) * PADDING, f"resuming at record {i} of {len(walk)} read {read_bytes} bytes"


def test_shuffled_order_depends_on_seed_and_epoch_only(builder):
  first = _epoch(_opener(builder, (0, 2), seed=3), 1)
  assert first == _epoch(_opener(builder, (0, 2), seed=3), 1)  # another process holding the same shard
  assert first != _epoch(_opener(builder, (0, 2), seed=3), 2)
  assert first != _epoch(_opener(builder, (0, 2), seed=4), 1)
  assert sorted(first) == sorted(_epoch(_opener(builder, (0, 2), seed=4), 1))
  unshuffled = _opener(builder, (0, 2), seed=3, train=False)
  assert _epoch(unshuffled, 0) == _epoch(unshuffled, 1) != first
  assert sorted(_epoch(unshuffled, 0)) == sorted(first)


def _damaged_copy(builder, tmp_path, damage):
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  copy = tmp_path / "copy"
  shutil.copytree(builder.data_dir, copy)
  name = sorted(n for n in os.listdir(copy) if ".tfrecord-" in n)[1]
  damage(copy / name)
  return tfds.builder_from_directory(str(copy)), name


def _flip_a_byte(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01
  path.write_bytes(bytes(data))


def _truncate(path):
  path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate])
def test_a_damaged_file_is_one_clear_error(builder, tmp_path, damage):
  damaged, name = _damaged_copy(builder, tmp_path, damage)
  with pytest.raises(UserError) as error:
    _epoch(_opener(damaged, shuffle=False))
  message = str(error.value)
  assert name in message and "is damaged" in message and "\n" not in message


def test_a_position_of_another_dataset_is_a_clear_error(builder):
  open_stream = _opener(builder)
  with pytest.raises(UserError, match="does not fit .* was the dataset prepared again"):
    next(open_stream(0, {"file": 99, "record": 0, "offset": None, "taken": 0}))
  with pytest.raises(UserError, match="is not a TFRecord stream position"):
    next(open_stream(0, {"records": 5}))
