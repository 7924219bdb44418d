"""TFRecord TFDS streams (tfds_source.stream_opener): shards, exact and cheap resume, also on another number of data
shards (tfds_resplit), shuffling, damaged files."""

import functools
import itertools
import json
import os
import shutil
import types

import numpy as np
import pytest

from MaxText.errors import UserError
from MaxText.input_pipeline import batching, packing, tfds_resplit, tfds_source, tfrecord_reader

NUM_RECORDS = 203  # not a multiple of the files, shards or windows: every share and window has an odd end
NUM_FILES = 4
WINDOW = 8  # tfds_source._WINDOW in these tests, so that a file holds several windows and a partial one
PADDING = 4000  # bytes per record, so that reading the records before a position is visible in the bytes read
RECORDS = [f"record {i:04d}" for i in range(NUM_RECORDS)]


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
  assert sorted(every) == RECORDS
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


# Resuming on another number of data shards (tfds_resplit).

RESPLITS = [(4, 2), (2, 4), (3, 2), (4, 1), (2, 3)]
EPOCHS = 3


def _resplit(builder, shuffle):
  config = types.SimpleNamespace(enable_data_shuffling=shuffle, data_shuffle_seed=0)
  return functools.partial(tfds_resplit.resplit, tfds_source.Shares(config, builder, "train", True))


def _stops(builder, shard, shuffle):
  """[(cursor state, records read before it)] where the tests stop a shard's stream: nothing read, mid-window, at a
  window's start, at a file's start, one record before the end of epoch 0, at its end (as the cursor saves it before
  and after it moves on to epoch 1), and inside epoch 1."""
  walk = _walk(_opener(builder, shard, shuffle), 2)
  positions = [state["position"] for state, _ in walk]
  per_epoch = sum(1 for state, _ in walk if state["epoch"] == 0)
  records = [record for _, record in walk]
  found = [
    0,
    next(i for i, p in enumerate(positions) if p and p["taken"] == WINDOW // 2),
    next(i for i, p in enumerate(positions) if p and p["record"] > 0 and p["taken"] == 0),
    next((i for i, p in enumerate(positions) if p and p["file"] == 1 and p["record"] == 0 and p["taken"] == 0), None),
    per_epoch - 1,
    per_epoch,
    per_epoch + 3,
  ]
  stops = [(walk[i][0], records[:i]) for i in found if i is not None]
  end = {"file": max(p["file"] for p in positions if p) + 1, "record": 0, "offset": None, "taken": 0}
  return [*stops, ({"epoch": 0, "position": end}, records[:per_epoch])]


def _walk_from(open_stream, cursor_state, epochs=EPOCHS):
  """[(cursor epoch, record, cursor state before it)] of a StreamCursor restored at cursor_state, to the end."""
  cursor, out = packing.StreamCursor(open_stream, epochs), []
  cursor.set_state(json.loads(json.dumps(cursor_state)))
  while cursor.current() is not None:
    out.append((cursor.get_state()["epoch"], cursor.current(), json.loads(json.dumps(cursor.get_state()))))
    cursor.advance()
  return out


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("old,new", RESPLITS)
def test_a_position_resumes_exactly_on_another_number_of_data_shards(builder, shuffle, old, new):
  stops = [_stops(builder, (k, old), shuffle) for k in range(old)]
  for scenario in range(max(map(len, stops))):
    chosen = [stops[k][(3 * k + scenario) % len(stops[k])] for k in range(old)]  # some in epoch 0, some in 1
    saved = {str(k): {"cursor": state, "offset": 0} for k, (state, _) in enumerate(chosen)}
    state = json.loads(json.dumps({"kind": "stream", "num_shards": old, "shards": saved}))
    before = [record for _, records in chosen for record in records]
    states = _resplit(builder, shuffle)(state, new, range(new), EPOCHS)
    last = max(s["cursor"]["epoch"] - (s["cursor"]["position"] is None) for s in saved.values())
    walks = [_walk_from(_opener(builder, (j, new), shuffle), states[j]["cursor"]) for j in range(new)]
    during = [record for walk in walks for epoch, record, _ in walk if epoch <= last]
    assert sorted(before + during) == sorted(RECORDS * (last + 1)), chosen
    for j, walk in enumerate(walks):  # then the normal layout of `new` data shards
      after = [record for epoch, record, _ in walk if epoch > last]
      assert after == [record for e in range(last + 1, EPOCHS) for record in _epoch(_opener(builder, (j, new), shuffle), e)]
      transition = [i for i, (epoch, _, _) in enumerate(walk) if epoch <= last]
      for i in transition[1 : len(transition) // 2 + 1 : max(len(transition) // 3, 1)]:  # stopped again: exact
        rest = _walk_from(_opener(builder, (j, new), shuffle), walk[i][2])
        assert [record for _, record, _ in rest] == [record for _, record, _ in walk[i:]]


def _tokens_decode(record):
  """Record i -> a document of 1 + 7i % 13 tokens 100i, 100i + 1, ...: every token of the split is different."""
  i = int(record["text"].decode()[7:11])
  tokens = np.arange(1 + i * 7 % 13, dtype=np.int32) + 100 * i
  return {"inputs": tokens, "targets": tokens}


def _packed_batcher(builder, shuffle, num_shards, resplit=True):
  """All data shards of one epoch, 2 rows of 8 tokens per shard: most documents are cut across rows."""
  config = types.SimpleNamespace(enable_data_shuffling=shuffle, data_shuffle_seed=0)
  open_shard = lambda k: tfds_source.stream_opener(config, builder, "train", True, _tokens_decode, k, num_shards)
  return batching.ShardStreamBatcher(
    open_shard, range(num_shards), num_shards, 2, 1, 8, resplit=_resplit(builder, shuffle) if resplit else None
  )


def _read(batcher, steps=None):
  """The tokens of the next `steps` batches (all batches when None), and the state after them (through JSON)."""
  tokens = []
  for _, batch in zip(range(steps) if steps is not None else itertools.count(), batcher):
    tokens.extend(batch["inputs"][batch["inputs_segmentation"] != 0].tolist())
  return tokens, json.loads(json.dumps(batcher.get_state()))


ALL_TOKENS = sorted(t for i in range(NUM_RECORDS) for t in range(100 * i, 100 * i + 1 + i * 7 % 13))


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("old,new", RESPLITS)
def test_packed_documents_resume_exactly_on_another_number_of_data_shards(builder, shuffle, old, new):
  """Documents split across rows keep their tokens; a run stopped during the re-split resumes exactly, also on
  the first number of data shards."""
  cut_documents = stopped_during_resplit = 0
  for steps in (1, 5, 17, 40):
    before, state = _read(_packed_batcher(builder, shuffle, old), steps)
    cut_documents += sum(s["offset"] > 0 for s in state["shards"].values())
    resumed = _packed_batcher(builder, shuffle, new)
    resumed.set_state(state)
    during, again = _read(resumed, 3)
    stopped_during_resplit += any("parts" in (s["cursor"]["position"] or {}) for s in again["shards"].values())
    for shards in (new, old):  # stopped again during the re-split: resumed on the same data shards, and re-split back
      restored = _packed_batcher(builder, shuffle, shards)
      restored.set_state(again)
      rest, _ = _read(restored)
      assert sorted(before + during + rest) == ALL_TOKENS, (steps, shards)
  assert cut_documents > 0 and stopped_during_resplit > 0  # some saved shard had packed part of a document


def test_the_resume_says_what_it_re_splits(builder, capsys):
  _, state = _read(_packed_batcher(builder, True, 4), 3)
  _packed_batcher(builder, True, 2).set_state(state)
  out = capsys.readouterr().out
  assert (
    "Re-splitting the data position of 4 data shards onto 2: this run's shard j finishes the saved shards j, j+2, ... "
    "one after another to the end of epoch 0, then each reads its own share of the split from epoch 1"
  ) in out


def test_an_old_record_count_position_is_re_split_too(builder):
  """Positions saved before byte offsets (a record count) re-split like the others."""
  shares = [_epoch(_opener(builder, (k, 2), shuffle=False)) for k in range(2)]
  saved = {str(k): {"cursor": {"epoch": 0, "position": count}, "offset": 0} for k, count in enumerate((10, 60))}
  states = _resplit(builder, False)({"kind": "stream", "num_shards": 2, "shards": saved}, 3, range(3), 1)
  walks = [_walk_from(_opener(builder, (j, 3), shuffle=False), states[j]["cursor"], epochs=1) for j in range(3)]
  after = [record for walk in walks for _, record, _ in walk]
  assert sorted(shares[0][:10] + shares[1][:60] + after) == RECORDS


def _bad_state(builder, change):
  _, state = _read(_packed_batcher(builder, True, 2), 3)
  change(state)
  return state


@pytest.mark.parametrize(
  "change,expected",
  [
    (lambda s: s["shards"].pop("1"), "holds positions for"),
    (lambda s: s["shards"]["0"].pop("offset"), "of data shard 0 is malformed"),
    (lambda s: s["shards"]["1"]["cursor"]["position"].update(file=99), "does not fit .* was the dataset prepared again"),
    (lambda s: s["shards"]["1"]["cursor"]["position"].update(file="1"), "is not a TFRecord stream position"),
  ],
)
def test_a_malformed_position_to_re_split_is_one_clear_error(builder, change, expected):
  with pytest.raises(UserError, match=expected) as error:
    _packed_batcher(builder, True, 4).set_state(_bad_state(builder, change))
  assert "\n" not in str(error.value)


@pytest.mark.parametrize(
  "change,expected",
  [
    (lambda p: p[0].update(every=0), "malformed stream part"),
    (lambda p: p[0].update(shard=5), "malformed stream part"),
    (lambda p: p[0].pop("used"), "malformed stream part"),
    (lambda p: p[0]["position"].update(file=99), "does not fit"),
    (lambda p: p.append("part"), "malformed stream part"),
  ],
)
def test_a_malformed_re_split_position_is_one_clear_error(builder, change, expected):
  _, state = _read(_packed_batcher(builder, True, 4), 3)
  resumed = _packed_batcher(builder, True, 2)
  resumed.set_state(state)
  _, saved = _read(resumed, 1)
  change(saved["shards"]["0"]["cursor"]["position"]["parts"])
  restored = _packed_batcher(builder, True, 2)
  restored.set_state(saved)  # a position is checked when its stream opens
  with pytest.raises(UserError, match=expected) as error:
    next(restored)
  assert "\n" not in str(error.value)


def test_a_stream_that_cannot_seek_resumes_only_on_the_same_data_shards(builder):
  _, state = _read(_packed_batcher(builder, True, 4), 3)
  with pytest.raises(UserError, match="is for 4 data shards, this run splits each batch into 2") as error:
    _packed_batcher(builder, True, 2, resplit=False).set_state(state)
  message = str(error.value)
  assert "dataset_type=hf" in message and "resume on a mesh whose data_sharding axes multiply to 4" in message
