"""use_sft=true: one chat record -> a next-token document whose loss_mask says which targets carry loss.

Records hold either a `messages` column (OpenAI/HF chat: a list of {"role", "content"}) or `prompt` and `completion`
columns (train_data_columns: [prompt, completion]), as dicts (hf: jsonl/parquet), or in grain's ArrayRecord files
as tf.train.Example features or raw UTF-8 JSON objects (a message list may be a JSON string).

Messages are rendered with the chat template (chat_template.py); prompt/completion with use_chat_template=true
become a user turn and an assistant turn, else their texts are concatenated (BOS/EOS per add_bos/add_eos). With
sft_train_on_completion_only=true only the assistant turns (content and end-of-turn token) or the completion
carry loss. A conversation longer than max_target_length is truncated (packing never splits one across rows);
one left with no loss token is dropped, and 1000 dropped in a row stop the run with one line (an endless stream of
such samples would otherwise never yield a row). The counts are logged at the first such sample and at every 10x of
samples read (from 1000).
"""

import json

import numpy as np

from MaxText import max_logging
from MaxText.errors import UserError
from MaxText.input_pipeline import tf_example
from MaxText.input_pipeline.chat_template import ChatRenderer
from MaxText.input_pipeline.tokenizer import build_tokenizer

MAX_DROPPED_IN_A_ROW = 1000


def data_columns(config) -> list[str]:
  """train_data_columns, or [train_data_column] when only the shorthand is set (config_validation refuses both)."""
  columns = list(config.train_data_columns)
  if columns == ["text"] and config.train_data_column != "text":
    return [config.train_data_column]
  return columns


def as_dict(record) -> dict:
  """A record as {column: value}: dicts as they are, tf.train.Example bytes by feature, raw bytes as JSON."""
  if isinstance(record, dict):
    return record
  if isinstance(record, (bytes, np.bytes_)):
    features = tf_example.parse(bytes(record)) if record else {}
    if features:
      return {k: v[0] if isinstance(v, list) and len(v) == 1 else v for k, v in features.items()}
    record = bytes(record).decode("utf-8", errors="replace")
  if isinstance(record, str):
    try:
      value = json.loads(record)
    except json.JSONDecodeError:
      value = None
    if isinstance(value, dict):
      return value
  raise UserError(
    f"use_sft=true needs records with columns (dicts, tf.train.Example or JSON objects), not {type(record).__name__}"
  )


class RecordPlace:
  """Names a record in an error line; formatted only when an error is raised."""

  def __init__(self, split: str, index: int, record):
    self.split, self.index, self.record = split, index, record

  def __str__(self) -> str:
    return f"{self.split} record {self.index} ({str(self.record)[:100]}...)"


def record_text(value):
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()
  return bytes(value).decode("utf-8", errors="replace") if isinstance(value, (bytes, np.bytes_)) else value


def check_rendered(ids: list, where) -> None:
  """A conversation the chat template renders as nothing is an error, not a dropped sample: it is the template's
  fault (e.g. an undefined variable renders empty), and dropping would end in a line blaming the samples' length."""
  if len(ids) == 0:
    raise UserError(f"the chat template renders {where} as no text; check chat_template (an undefined variable?)")


class SftDecoder:
  """Callable record -> {"inputs", "targets", "loss_mask"} (int32; empty arrays for a dropped sample)."""

  def __init__(self, config, train: bool = True):
    self.columns = data_columns(config)
    if len(self.columns) not in (1, 2):
      raise UserError(f"use_sft=true takes train_data_columns [messages] or [prompt, completion], not {self.columns}")
    self.completion_only = config.sft_train_on_completion_only
    self.max_tokens = config.max_target_length + 1  # a row holds max_target_length (input, target) pairs
    self.split = "train" if train else "eval"
    self._renderer_args = (config.tokenizer_path, config.chat_template)
    self._tokenizer_args = (config.tokenizer_path, config.add_bos, config.add_eos)
    self.use_chat_template = config.use_chat_template or len(self.columns) == 1
    self._renderer = None
    self.counts = {"read": 0, "truncated": 0, "dropped": 0}
    self._dropped_in_a_row = 0
    self.renderer()  # a bad tokenizer or template stops the run now, not at the first record

  def __getstate__(self):  # worker processes build their own renderer
    return dict(self.__dict__, _renderer=None)

  def renderer(self):
    if self._renderer is None and self.use_chat_template:
      self._renderer = ChatRenderer(*self._renderer_args)
    return self._renderer

  def _columns(self, record) -> list:
    fields = as_dict(record)
    missing = [c for c in self.columns if c not in fields]
    if missing:
      raise UserError(
        f"records have no column '{missing[0]}' (they have: {', '.join(sorted(fields))}); set train_data_columns"
      )
    return [fields[c] for c in self.columns]

  def _messages(self, value, where) -> list:
    value = record_text(value)
    if isinstance(value, str):
      try:
        value = json.loads(value)
      except json.JSONDecodeError:
        raise UserError(f"{where}: column '{self.columns[0]}' holds text, not a list of messages") from None
    messages = [dict(m) for m in (value.tolist() if isinstance(value, np.ndarray) else value)]
    for i, m in enumerate(messages):
      if not isinstance(record_text(m.get("content")), str):
        raise UserError(f"{where}: message {i} ({m.get('role')}) has no text content ({m.get('content')!r})")
    if not any(m.get("role") == "assistant" for m in messages):
      raise UserError(f"{where} has no assistant turn (roles: {[m.get('role') for m in messages]}): nothing to learn from")
    return messages

  def token_ids_and_mask(self, record, where) -> tuple[list[int], list[int]]:
    """The sample's token ids and 1 where a token is one the loss covers (assistant turns, or the completion)."""
    values = self._columns(record)
    if len(values) == 1:
      return self._render(self._messages(values[0], where), where)
    prompt, completion = (record_text(v) for v in values)
    for column, value in zip(self.columns, (prompt, completion)):
      if not isinstance(value, str):
        raise UserError(f"{where}: column '{column}' holds {value!r}, not text")
    if self.use_chat_template:
      messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
      return self._render(messages, where)
    path, add_bos, add_eos = self._tokenizer_args
    prompt_ids = build_tokenizer(path, add_bos, False).encode(prompt)  # BOS before the prompt, EOS after the completion
    completion_ids = build_tokenizer(path, False, add_eos).encode(completion)
    return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)

  def _render(self, messages, where) -> tuple[list[int], list[int]]:
    ids, mask = self.renderer().encode_with_mask(messages, where)
    check_rendered(ids, where)
    return ids, mask

  def __call__(self, record) -> dict:
    self.counts["read"] += 1
    where = RecordPlace(self.split, self.counts["read"] - 1, record)
    ids, mask = self.token_ids_and_mask(record, where)
    if len(ids) > self.max_tokens:
      ids, mask = ids[: self.max_tokens], mask[: self.max_tokens]
      self._count("truncated")
    ids, mask = np.asarray(ids, np.int32), np.asarray(mask, np.int32)
    # No tokens at all (empty prompt and completion without a template): dropped below, like a sample without loss.
    loss_mask = mask[1:] if self.completion_only else np.ones(max(len(ids) - 1, 0), np.int32)
    if len(ids) < 2 or not loss_mask.any():
      self._drop(self.row_length)
      ids, loss_mask = np.zeros(1, np.int32), np.zeros(0, np.int32)
    else:
      self._dropped_in_a_row = 0
    if self.counts["read"] >= 1000 and str(self.counts["read"]).strip("0") == "1":
      self._log()
    return {"inputs": ids[:-1], "targets": ids[1:], "loss_mask": loss_mask}

  def _drop(self, row_length: int) -> None:
    """Counts a dropped sample. MAX_DROPPED_IN_A_ROW in a row stop the run: an epoch-less stream of such samples
    would never yield a row."""
    self._count("dropped")
    self._dropped_in_a_row = getattr(self, "_dropped_in_a_row", 0) + 1
    if self._dropped_in_a_row >= MAX_DROPPED_IN_A_ROW:
      raise UserError(
        f"the last {self._dropped_in_a_row:,} {self.split} samples were all dropped: none has a loss token left "
        f"within max_target_length={row_length} (e.g. prompts longer than a row); raise max_target_length or "
        "shorten the samples"
      )

  def _count(self, what: str) -> None:
    self.counts[what] += 1
    if self.counts[what] == 1:
      self._log()

  # The counts line's words: (what the decoder is, its samples, what truncation did, what a dropped one lacks).
  LOG_WORDS = ("SFT", "samples", "truncated", "loss token")

  def _log(self) -> None:
    c, (kind, samples, truncated, lacking) = self.counts, self.LOG_WORDS
    max_logging.log(
      f"{kind} {self.split} data so far: {c['read']:,} {samples} read, {c['truncated']:,} {truncated} to "
      f"max_target_length={self.row_length}, {c['dropped']:,} dropped with no {lacking} left",
      every_process=True,
    )

  @property
  def row_length(self) -> int:
    return self.max_tokens - 1  # max_tokens counts the (input, target) pairs' tokens, one more than a row
