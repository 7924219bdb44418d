"""use_grpo=true: one record -> one prompt row, and back on the host (features/grpo.py generates from it).

Records have train_data_columns [prompt, <other columns>...]. The prompt is text, or a list of messages (chat format),
rendered with the chat template and its generation prompt when it is messages or use_chat_template=true; text is
tokenized with BOS per add_bos. The other columns (an answer to check) go to the reward functions.

A row carries both through every pipeline (sharding, workers, checkpointed positions) as its int32 arrays: the
prompt's token ids as segment 1, then the other columns as one JSON object's UTF-8 bytes, four to an int32, as
segment 2. prompt_rows reads a batch of such rows back; they never train (grpo_rollouts.py builds the rows that do).
"""

import json

import numpy as np

from MaxText.errors import UserError
from MaxText.input_pipeline.chat_template import ChatRenderer
from MaxText.input_pipeline.sft import RecordPlace, as_dict, data_columns, record_text
from MaxText.input_pipeline.tokenizer import build_tokenizer

PROMPT, COLUMNS = 1, 2  # the inputs_segmentation of a row's prompt tokens and of its columns' bytes


def _plain(value):
  """A column's value as JSON takes it (text from bytes, lists from arrays, numbers from NumPy's)."""
  value = record_text(value)
  if isinstance(value, np.ndarray):
    return [_plain(v) for v in value.tolist()]
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  return value


def _messages(value):
  """The prompt's messages when it holds a list of them (or their JSON), else None."""
  value = _plain(value)
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError:
      return None
  if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
    return value
  return None


class GrpoPromptDecoder:
  """Callable record -> {"inputs", "targets", "segment_ids", "inputs_position", "loss_mask"} (int32): a prompt row."""

  def __init__(self, config, train: bool = True):
    self.columns = data_columns(config)
    self.max_prompt, self.row_length = config.max_prefill_predict_length, config.max_target_length
    self.split = "train" if train else "eval"
    self.use_chat_template = config.use_chat_template
    self._tokenizer_args = (config.tokenizer_path, config.add_bos)
    self._renderer_args = (config.tokenizer_path, config.chat_template)
    self._renderer = self._tokenizer = None
    self.read = 0

  def __getstate__(self):  # worker processes build their own
    return dict(self.__dict__, _renderer=None, _tokenizer=None)

  def prompt_ids(self, prompt, where) -> list[int]:
    messages = _messages(prompt)
    if messages is None and not self.use_chat_template:
      if self._tokenizer is None:
        self._tokenizer = build_tokenizer(self._tokenizer_args[0], self._tokenizer_args[1], False)
      text = _plain(prompt)
      if not isinstance(text, str):
        raise UserError(f"{where}: column 'prompt' holds {text!r}, not text or a list of messages")
      return self._tokenizer.encode(text)
    if self._renderer is None:
      self._renderer = ChatRenderer(*self._renderer_args)
    messages = messages or [{"role": "user", "content": _plain(prompt)}]
    return self._renderer.encode(self._renderer.render(messages, add_generation_prompt=True, where=str(where)))

  def __call__(self, record) -> dict:
    self.read += 1
    where = RecordPlace(self.split, self.read - 1, record)
    fields = as_dict(record)
    missing = [c for c in self.columns if c not in fields]
    if missing:
      raise UserError(
        f"records have no column '{missing[0]}' (they have: {', '.join(sorted(fields))}); set train_data_columns"
      )
    ids = self.prompt_ids(fields[self.columns[0]], where)
    if not ids:
      raise UserError(f"{where}: the prompt is empty (no tokens): GRPO needs something to complete")
    if len(ids) > self.max_prompt:
      raise UserError(
        f"{where}: the prompt is {len(ids)} tokens long but max_prefill_predict_length={self.max_prompt}; raise "
        "max_prefill_predict_length or shorten the prompts"
      )
    others = {c: _plain(fields[c]) for c in self.columns[1:]}
    text = json.dumps(others, ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 4)  # JSON allows the trailing spaces
    data = np.frombuffer(text, "<i4").astype(np.int32)
    if len(ids) + len(data) > self.row_length:
      raise UserError(
        f"{where}: its prompt ({len(ids)} tokens) and its other columns {self.columns[1:]} ({len(text)} bytes as JSON, "
        f"4 to a token) do not fit in a row of max_target_length={self.row_length}: raise max_target_length or shorten "
        "them"
      )
    inputs = np.concatenate([np.asarray(ids, np.int32), data])
    return {
      "inputs": inputs,
      "targets": inputs,
      "segment_ids": np.asarray([PROMPT] * len(ids) + [COLUMNS] * len(data), np.int32),
      "inputs_position": np.arange(len(inputs), dtype=np.int32),
      # Kept whole in its row. The row never trains; targets_segmentation marks its prompt as real tokens (where the
      # data ran out, a row is all 0).
      "loss_mask": np.asarray([1] * len(ids) + [0] * len(data), np.int32),
    }


def prompt_rows(batch: dict) -> tuple[list[list[int]], list[dict]]:
  """A host batch of prompt rows -> (each row's prompt token ids, each row's other columns); a row of padding (the
  data ran out) gives no ids and no columns."""
  inputs, segments = np.asarray(batch["inputs"]), np.asarray(batch["inputs_segmentation"])
  prompts, columns = [], []
  for row, segment in zip(inputs, segments):
    prompts.append([int(t) for t in row[segment == PROMPT]])
    data = row[segment == COLUMNS].astype("<i4").tobytes()
    columns.append(json.loads(data.decode("utf-8")) if data else {})
  return prompts, columns
