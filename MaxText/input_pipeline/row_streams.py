"""Packs tokenized documents into fixed-length rows, one independent stream per row of the global batch.

Row j of every global batch is the next packed row of stream j, which holds documents j, j+R, j+2R, ...
of the (shuffled) dataset, R being the global batch rows. A process builds only the streams of the rows
it loads, so processes read disjoint documents and the global batch is the same whatever the number of
processes. Each stream's position is a Grain iterator state, so a restored pipeline resumes exactly.
"""

import grain
import numpy as np

# Grain's packed feature names -> the batch keys the model reads.
_KEYS = {
  "inputs": "inputs",
  "inputs_segment_ids": "inputs_segmentation",
  "inputs_positions": "inputs_position",
  "targets": "targets",
  "targets_segment_ids": "targets_segmentation",
  "targets_positions": "targets_position",
}


def shift_to_inputs_and_targets(token_ids) -> dict:
  """Next-token prediction pairs of one document: inputs = ids[:-1], targets = ids[1:]."""
  ids = np.asarray(token_ids, dtype=np.int32)
  return {"inputs": ids[:-1], "targets": ids[1:]}


def _packed_stream(examples: grain.MapDataset, seq_len: int) -> grain.IterDataset:
  """Concatenates documents and cuts rows of seq_len; a document that does not fit continues in the next row."""
  lengths = {"inputs": seq_len, "targets": seq_len}
  return grain.experimental.ConcatThenSplitIterDataset(examples.to_iter_dataset(), length_struct=lengths)


class RowStreamBatcher:
  """Iterator of this process's rows of the global batch, as a dict of (rows, seq_len) int32 numpy arrays."""

  def __init__(self, examples: grain.MapDataset, num_rows: int, row_range: tuple[int, int], seq_len: int):
    """Args:
    examples: documents as {"inputs", "targets"} 1-D int arrays, already shuffled and repeated.
    num_rows: rows of the global batch (R).
    row_range: [start, stop) rows that this process loads.
    seq_len: length of every row.
    """
    self._iterators = [iter(_packed_stream(examples[row::num_rows], seq_len)) for row in range(*row_range)]

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    rows = [next(it) for it in self._iterators]
    return {ours: np.stack([row[theirs] for row in rows]).astype(np.int32) for theirs, ours in _KEYS.items()}

  def get_state(self) -> dict:
    return {"rows": [it.get_state() for it in self._iterators]}

  def set_state(self, state: dict) -> None:
    if len(state["rows"]) != len(self._iterators):
      raise ValueError(f"data iterator state has {len(state['rows'])} rows, this process loads {len(self._iterators)}")
    for it, row_state in zip(self._iterators, state["rows"]):
      it.set_state(row_state)
