"""The embedded corpus pipeline: determinism, packing invariants, process sharding and exact resume."""

import json

import grain
import numpy as np
import pytest

from MaxText.input_pipeline import embedded_corpus
from MaxText.input_pipeline.batching import RowStreamBatcher
from MaxText.input_pipeline.documents import shift_to_inputs_and_targets
from MaxText.input_pipeline.input_pipeline_interface import create_data_iterator, document_decoder
from MaxText.input_pipeline.packing import PackedStream, RandomAccessCursor
from MaxText.runtime import mesh
from MaxText.tests.helpers import tiny_config

ROWS, LENGTH = 4, 32


def _examples(config):
  docs = grain.MapDataset.source(embedded_corpus.split_documents("train")).shuffle(seed=0).repeat(None)
  return docs.map(document_decoder(config, True))


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def test_corpus_is_real_text_and_splits_are_disjoint():
  train, held_out = embedded_corpus.split_documents("train"), embedded_corpus.split_documents("eval")
  assert sum(map(len, train)) > 1_000_000
  assert len(held_out) >= 40 and not set(train) & set(held_out)
  assert embedded_corpus.documents() == embedded_corpus.documents()


def test_packed_rows_are_shifted_next_token_pairs():
  config = tiny_config()
  batch = next(RowStreamBatcher(_examples(config), ROWS, range(ROWS), LENGTH))
  assert {k: v.shape for k, v in batch.items()} == {k: (ROWS, LENGTH) for k in batch}
  seg, pos = batch["inputs_segmentation"], batch["inputs_position"]
  assert (seg >= 1).all()  # an endless stream has no padding
  same = seg[:, 1:] == seg[:, :-1]
  # Inside a segment the next input is this target, and positions count up by one.
  np.testing.assert_array_equal(batch["inputs"][:, 1:][same], batch["targets"][:, :-1][same])
  np.testing.assert_array_equal(pos[:, 1:][same], pos[:, :-1][same] + 1)
  assert (pos[:, 1:][~same] == 0).all()
  np.testing.assert_array_equal(batch["targets_segmentation"], seg)


def test_rows_do_not_depend_on_how_processes_split_the_batch():
  config = tiny_config()
  whole = _take(RowStreamBatcher(_examples(config), ROWS, range(ROWS), LENGTH), 3)
  first = _take(RowStreamBatcher(_examples(config), ROWS, range(0, 2), LENGTH), 3)
  second = _take(RowStreamBatcher(_examples(config), ROWS, range(2, 4), LENGTH), 3)
  for w, a, b in zip(whole, first, second):
    for key in w:
      np.testing.assert_array_equal(w[key], np.concatenate([a[key], b[key]]))


def test_restored_state_resumes_exactly():
  config = tiny_config()
  reference = RowStreamBatcher(_examples(config), ROWS, range(ROWS), LENGTH)
  _take(reference, 5)
  state = json.loads(json.dumps(reference.get_state()))  # as stored in a checkpoint
  expected = _take(reference, 4)
  restored = RowStreamBatcher(_examples(config), ROWS, range(ROWS), LENGTH)
  restored.set_state(state)
  for e, r in zip(expected, _take(restored, 4)):
    for key in e:
      np.testing.assert_array_equal(e[key], r[key])


def test_global_iterator_state_does_not_count_prefetched_batches():
  config = tiny_config("per_device_batch_size=4")
  device_mesh = mesh.create_device_mesh(config)
  iterator = create_data_iterator(config, device_mesh)
  consumed = _take(iterator, 2)
  state = iterator.get_state()
  fresh = create_data_iterator(config, device_mesh)
  fresh.set_state(state)
  nxt_a, nxt_b = next(iterator), next(fresh)
  for key in nxt_a:
    np.testing.assert_array_equal(np.asarray(nxt_a[key]), np.asarray(nxt_b[key]))
  assert not np.array_equal(np.asarray(consumed[1]["inputs"]), np.asarray(nxt_a["inputs"]))


def test_synthetic_iterator_is_deterministic_and_resumable():
  config = tiny_config("dataset_type=synthetic", "per_device_batch_size=2")
  device_mesh = mesh.create_device_mesh(config)
  a = create_data_iterator(config, device_mesh)
  _take(a, 2)
  b = create_data_iterator(config, device_mesh)
  b.set_state(a.get_state())
  np.testing.assert_array_equal(np.asarray(next(a)["inputs"]), np.asarray(next(b)["inputs"]))


def test_finite_stream_pads_its_last_row_then_stops():
  docs = [np.arange(1, 11), np.arange(20, 22), np.arange(30, 31)]  # 9, 1 and 0 next-token pairs
  stream = PackedStream(RandomAccessCursor(grain.MapDataset.source(docs).map(shift_to_inputs_and_targets)), 8)
  first, second = stream.next_row(), stream.next_row()
  np.testing.assert_array_equal(first["inputs"], np.arange(1, 9))
  np.testing.assert_array_equal(second["inputs"], [9, 20, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(second["targets"], [10, 21, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(second["inputs_segmentation"], [1, 2, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(second["inputs_position"], [0, 0, 0, 0, 0, 0, 0, 0])
  with pytest.raises(StopIteration):
    stream.next_row()


def test_without_packing_each_row_is_one_cut_document():
  docs = [np.arange(1, 13), np.arange(20, 23)]  # 11 and 2 next-token pairs
  stream = PackedStream(RandomAccessCursor(grain.MapDataset.source(docs).map(shift_to_inputs_and_targets)), 8, packing=False)
  first, second = stream.next_row(), stream.next_row()
  np.testing.assert_array_equal(first["inputs"], np.arange(1, 9))  # cut to the row
  np.testing.assert_array_equal(second["inputs"], [20, 21, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(second["inputs_segmentation"], [1, 1, 0, 0, 0, 0, 0, 0])


def test_rows_that_run_out_become_padding_until_all_have():
  docs = [np.arange(1, 20), np.arange(30, 33)]  # row 0 gets 18 pairs, row 1 gets 2
  batcher = RowStreamBatcher(grain.MapDataset.source(docs).map(shift_to_inputs_and_targets), 2, range(2), 8)
  batches = list(batcher)
  assert len(batches) == 3
  assert batches[0]["inputs_segmentation"][1].sum() == 2 and not batches[1]["inputs_segmentation"][1].any()
  assert batches[2]["inputs_segmentation"][0].sum() == 2
