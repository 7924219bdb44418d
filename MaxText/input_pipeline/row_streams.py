"""Packs tokenized documents into fixed-length rows, one independent stream per row of the global batch.

Row j of every global batch is the next packed row of stream j, which holds documents j, j+R, j+2R, ...
of the (shuffled) dataset, R being the global batch rows. A process builds only the streams of the rows
it loads, so processes read disjoint documents and the global batch is the same whatever the number of
processes. Each stream's position is two integers, so a restored pipeline resumes exactly.
"""

import grain
import numpy as np

from MaxText.errors import UserError

FEATURES = ("inputs", "targets")


def shift_to_inputs_and_targets(token_ids) -> dict:
  """Next-token prediction pairs of one document: inputs = ids[:-1], targets = ids[1:]."""
  ids = np.asarray(token_ids, dtype=np.int32)
  return {"inputs": ids[:-1], "targets": ids[1:]}


class PackedStream:
  """Concatenates documents into rows of seq_len; a document that does not fit continues in the next row.

  Each piece of a document in a row is its own segment (ids 1, 2, ... in the row) with positions from 0.
  The state is (index of the current document, tokens of it already used): exact and JSON-friendly.
  (Grain's ConcatThenSplitIterDataset does the same packing, but its state does not survive a JSON
  round trip in grain 0.2.18, so it cannot resume from a checkpoint exactly.)
  """

  def __init__(self, examples: grain.MapDataset, seq_len: int):
    self._examples = examples
    self._seq_len = seq_len
    self._index, self._offset = 0, 0
    self._document = None  # cached examples[self._index]

  def _current(self):
    if self._document is None:
      self._document = self._examples[self._index]
    return self._document

  def next_row(self) -> dict:
    row = {f: np.zeros(self._seq_len, np.int32) for f in FEATURES}
    segmentation = np.zeros(self._seq_len, np.int32)
    position = np.zeros(self._seq_len, np.int32)
    filled, segment = 0, 0
    while filled < self._seq_len and self._index < len(self._examples):
      document = self._current()
      take = min(len(document["inputs"]) - self._offset, self._seq_len - filled)
      if take > 0:
        segment += 1
        for f in FEATURES:
          row[f][filled : filled + take] = document[f][self._offset : self._offset + take]
        segmentation[filled : filled + take] = segment
        position[filled : filled + take] = np.arange(take)
        filled += take
        self._offset += take
      if self._offset >= len(document["inputs"]):
        self._index, self._offset, self._document = self._index + 1, 0, None
    if filled == 0:
      raise StopIteration
    # A finite stream's last row is padded: segmentation 0 carries no loss.
    return {
      "inputs": row["inputs"],
      "inputs_position": position,
      "inputs_segmentation": segmentation,
      "targets": row["targets"],
      "targets_position": position,
      "targets_segmentation": segmentation,
    }

  def get_state(self) -> dict:
    return {"index": self._index, "offset": self._offset}

  def set_state(self, state: dict) -> None:
    self._index, self._offset, self._document = int(state["index"]), int(state["offset"]), None


class RowStreamBatcher:
  """Iterator of this process's rows of the global batch, as a dict of (rows, seq_len) int32 numpy arrays."""

  def __init__(self, examples: grain.MapDataset, num_rows: int, row_range: tuple[int, int], seq_len: int):
    """Args:
    examples: documents as {"inputs", "targets"} 1-D int arrays, already shuffled and repeated.
    num_rows: rows of the global batch (R).
    row_range: [start, stop) rows that this process loads.
    seq_len: length of every row.
    """
    self._num_rows = num_rows
    self._rows = list(range(*row_range))
    self._streams = [PackedStream(examples[row::num_rows], seq_len) for row in self._rows]

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    rows = [stream.next_row() for stream in self._streams]
    return {key: np.stack([row[key] for row in rows]) for key in rows[0]}

  def get_state(self) -> dict:
    """{"num_rows": R, "rows": {global row: stream state}}; a checkpoint unions the rows of all processes."""
    return {
      "num_rows": self._num_rows,
      "rows": {str(row): stream.get_state() for row, stream in zip(self._rows, self._streams)},
    }

  def set_state(self, state: dict) -> None:
    if state["num_rows"] != self._num_rows or any(str(row) not in state["rows"] for row in self._rows):
      raise UserError(
        f"the checkpoint's data position is for a global batch of {state['num_rows']} rows, this run loads "
        f"{self._num_rows}: resume with the same devices x per_device_batch_size x gradient_accumulation_steps"
      )
    for row, stream in zip(self._rows, self._streams):
      stream.set_state(state["rows"][str(row)])
