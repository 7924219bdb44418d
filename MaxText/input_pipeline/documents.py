"""One record of any source -> the token ids of one document, and next-token (inputs, targets) pairs.

A record can be a str, raw UTF-8 bytes, a serialized tf.train.Example, or a dict (TFDS, Hugging Face).
The text is in the column train_data_column/eval_data_column; with tokenize_*_data=false the column
already holds token ids (written, BOS/EOS included, by preprocess_data.py), which are used as they are.
Invalid UTF-8 is replaced by U+FFFD (logged once per process).
"""

import numpy as np

from MaxText import max_logging
from MaxText.errors import UserError
from MaxText.input_pipeline import tf_example
from MaxText.input_pipeline.tokenizer import build_tokenizer


def shift_to_inputs_and_targets(token_ids) -> dict:
  """Next-token prediction pairs of one document: inputs = ids[:-1], targets = ids[1:]."""
  ids = np.asarray(token_ids, dtype=np.int32)
  return {"inputs": ids[:-1], "targets": ids[1:]}


class DocumentDecoder:
  """Callable record -> {"inputs", "targets"} int32 arrays."""

  def __init__(self, column: str, tokenize: bool, tokenizer_path: str, add_bos: bool, add_eos: bool, vocab_size: int):
    self.column, self.tokenize, self.vocab_size = column, tokenize, vocab_size
    self.tokenizer_args = (tokenizer_path, add_bos, add_eos)
    self._warned_utf8 = False
    if tokenize:
      tokenizer = build_tokenizer(*self.tokenizer_args)
      if tokenizer.vocab_size > vocab_size:
        raise UserError(
          f"tokenizer_path={tokenizer_path} has {tokenizer.vocab_size} tokens but vocab_size={vocab_size}; "
          f"set vocab_size>={tokenizer.vocab_size}"
        )

  def _field(self, record):
    if isinstance(record, (str, np.str_)):
      return str(record)
    if isinstance(record, (bytes, np.bytes_)):
      features = tf_example.parse(bytes(record)) if record else {}
      if not features:
        return bytes(record)  # not an Example: raw text
      record = features
    if isinstance(record, dict):
      if self.column not in record:
        raise UserError(
          f"records have no column '{self.column}' (they have: {', '.join(sorted(record))}); "
          "set train_data_column/eval_data_column"
        )
      value = record[self.column]
      if isinstance(value, list) and len(value) == 1 and isinstance(value[0], bytes):
        value = value[0]  # a tf.train.Example bytes feature holds a list of one
      return value
    raise UserError(f"cannot read a record of type {type(record).__name__}; expected text, tf.train.Example bytes or a dict")

  def _text(self, value) -> str:
    if isinstance(value, np.ndarray) and value.dtype.kind in "SO" and value.ndim == 0:
      value = value.item()
    if isinstance(value, (bytes, np.bytes_)):
      try:
        return bytes(value).decode("utf-8")
      except UnicodeDecodeError:
        if not self._warned_utf8:
          max_logging.warn("a record holds invalid UTF-8; its bad bytes are replaced by U+FFFD (logged once)")
          self._warned_utf8 = True
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str):
      return value
    raise UserError(
      f"column '{self.column}' holds {type(value).__name__}, not text; for token ids set tokenize_train_data=false"
    )

  def token_ids(self, record) -> np.ndarray:
    value = self._field(record)
    if self.tokenize:
      return np.asarray(build_tokenizer(*self.tokenizer_args).encode(self._text(value)), dtype=np.int32)
    if isinstance(value, (str, bytes, np.bytes_)):
      raise UserError(f"column '{self.column}' holds text but tokenize_train_data/tokenize_eval_data is false")
    ids = np.asarray(value, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      raise UserError(f"column '{self.column}' holds token id {int(ids.max())} outside [0, vocab_size={self.vocab_size})")
    return ids.astype(np.int32)

  def __call__(self, record) -> dict:
    return shift_to_inputs_and_targets(self.token_ids(record))
