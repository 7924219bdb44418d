"""Documents -> fixed-length rows, reading documents through a cursor whose position is a small JSON state.

With packing, documents are concatenated and cut into rows; a document that does not fit continues in
the next row. Each piece of a document in a row is its own segment (ids 1, 2, ... in the row) with
positions from 0, which the attention mask and RoPE respect. Without packing, each row holds one
document, truncated to the row (logged once) and padded. Padding has segment 0 and carries no loss.

A document may carry its own "segment_ids" (1, 2, ...) and "inputs_position" (a DPO pair: two samples in one row).

A document with a "loss_mask" (SFT samples, input_pipeline/sft.py) is never split: one that does not fit in the
row's room starts the next row. Its targets where the mask is 0 get targets_segmentation 0, which the loss skips,
while inputs_segmentation keeps attention inside the sample. A document's "images" (use_multimodal, unpacked) become
its row's.
"""

import numpy as np

from MaxText import max_logging

BATCH_KEYS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_position", "targets_segmentation")


class RandomAccessCursor:
  """Walks a random-access dataset (grain.MapDataset) of {"inputs", "targets"} documents by index."""

  def __init__(self, documents):
    self._documents = documents
    self._index = 0
    self._cached = None

  def current(self):
    """The current document, or None at the end of the data."""
    if self._index >= len(self._documents):
      return None
    if self._cached is None:
      self._cached = self._documents[self._index]
    return self._cached

  def advance(self) -> None:
    self._index, self._cached = self._index + 1, None

  def get_state(self) -> dict:
    return {"index": self._index}

  def set_state(self, state: dict) -> None:
    self._index, self._cached = int(state["index"]), None


class StreamCursor:
  """Walks a sequential source, epoch after epoch.

  open_stream(epoch, position) must return an iterator of (document, position after it); position None
  means the start of the epoch. num_epochs -1 repeats forever.
  """

  def __init__(self, open_stream, num_epochs: int):
    self._open, self._num_epochs = open_stream, num_epochs
    self._epoch, self._position = 0, None  # the position *before* the current document
    self._iterator, self._cached, self._after = None, None, None

  def current(self):
    while self._cached is None:
      if self._num_epochs != -1 and self._epoch >= self._num_epochs:
        return None
      if self._iterator is None:
        self._iterator = self._open(self._epoch, self._position)
      try:
        self._cached, self._after = next(self._iterator)
      except StopIteration:
        self._epoch, self._position, self._iterator = self._epoch + 1, None, None
    return self._cached

  def advance(self) -> None:
    self.current()
    self._position, self._cached = self._after, None

  def get_state(self) -> dict:
    return {"epoch": self._epoch, "position": self._position}

  def set_state(self, state: dict) -> None:
    self._epoch, self._position = int(state["epoch"]), state["position"]
    self._iterator, self._cached = None, None


class PackedStream:
  """Rows of seq_len tokens from a cursor's documents. State: the cursor's and the tokens of the current
  document already used, so a restored stream continues exactly."""

  def __init__(self, cursor, seq_len: int, packing: bool = True):
    self._cursor, self._seq_len, self._packing = cursor, seq_len, packing
    self._offset = 0
    self._warned_truncation = False

  def _take_from_current(self, document, room: int, filled: int) -> int:
    remaining = len(document["inputs"]) - self._offset
    if "loss_mask" in document and remaining > room and filled > 0:
      return -1  # kept whole: it starts the next row (one longer than a row, which sft.py prevents, is cut)
    if not self._packing and remaining > room and not self._warned_truncation:
      max_logging.warn(
        f"a document of {remaining + 1} tokens is cut to max_target_length={self._seq_len} (packing=false; logged once)"
      )
      self._warned_truncation = True
    return min(remaining, room)

  def next_row(self) -> dict:
    """The next row as {key: (seq_len,) int32}; raises StopIteration when the documents are used up."""
    row = {k: np.zeros(self._seq_len, np.int32) for k in BATCH_KEYS}
    filled, segment = 0, 0
    while filled < self._seq_len:
      document = self._cursor.current()
      if document is None:
        break
      take = self._take_from_current(document, self._seq_len - filled, filled)
      if take < 0:
        break
      if take > 0:
        segment += 1
        piece = slice(self._offset, self._offset + take)
        row["inputs"][filled : filled + take] = document["inputs"][piece]
        row["targets"][filled : filled + take] = document["targets"][piece]
        # A document may hold several segments of its own (a DPO pair, input_pipeline/dpo.py), with their positions.
        segments = segment if "segment_ids" not in document else segment - 1 + document["segment_ids"][piece]
        row["inputs_segmentation"][filled : filled + take] = segments
        positions = document["inputs_position"][piece] if "inputs_position" in document else np.arange(take)
        row["inputs_position"][filled : filled + take] = positions
        mask = document.get("loss_mask")
        row["targets_segmentation"][filled : filled + take] = segments if mask is None else segments * mask[piece]
        segment = int(np.max(segments))
        if "images" in document:  # a multimodal sample's pixels (unpacked: one sample per row)
          row["images"] = document["images"]
        filled += take
        self._offset += take
      if not self._packing or self._offset >= len(document["inputs"]) or "loss_mask" in document:
        self._cursor.advance()
        self._offset = 0
      if not self._packing and filled > 0:
        break
    if filled == 0:
      raise StopIteration
    row["targets_position"][:] = row["inputs_position"]
    return row

  def get_state(self) -> dict:
    return {"cursor": self._cursor.get_state(), "offset": self._offset}

  def set_state(self, state: dict) -> None:
    self._cursor.set_state(state["cursor"])
    self._offset = int(state["offset"])
