"""use_dpo=true: one preference record -> one document holding the chosen and the rejected sample as two segments.

Records have train_data_columns [chosen, rejected] or [prompt, chosen, rejected]. A column holds text or a message
list (chat format, rendered with the chat template, chat_template.py). Each sample is prompt + response; only the
response's tokens carry loss (with messages: the response's assistant turns; with no prompt column, the last
assistant turn; with texts and no prompt, the whole text).

Both samples of a pair sit in one row, the chosen one as segment 1 and the rejected one as segment 2 (attention
stays inside each, positions restart), so every row is a whole pair wherever sharding, gradient accumulation or a
data loader puts it. The response targets get targets_segmentation 1 (chosen) or 2 (rejected), the rest 0: the
loss (MaxText/dpo.py) sums each sample's response log-probs by that id. A pair longer than max_target_length
is cut, the longer sample first; a pair left without a response token in either sample is dropped.
"""

import json

import numpy as np

from MaxText.errors import UserError
from MaxText.input_pipeline.sft import RecordPlace, SftDecoder, check_rendered, data_columns, record_text
from MaxText.input_pipeline.tokenizer import build_tokenizer


def _is_messages(value) -> bool:
  value = record_text(value)
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError:
      return False
  return isinstance(value, (list, np.ndarray)) and len(value) > 0 and all(hasattr(m, "get") for m in value)


class DpoDecoder(SftDecoder):
  """Callable record -> {"inputs", "targets", "loss_mask", "segment_ids", "inputs_position"} (int32)."""

  LOG_WORDS = ("DPO", "pairs", "cut", "response token")

  def __init__(self, config, train: bool = True):
    self.columns = data_columns(config)
    if self.columns not in (["chosen", "rejected"], ["prompt", "chosen", "rejected"]):
      raise UserError(
        f"use_dpo=true takes train_data_columns [chosen, rejected] or [prompt, chosen, rejected], not {self.columns}"
      )
    self.completion_only = True
    self.max_tokens = config.max_target_length
    self.split = "train" if train else "eval"
    self._renderer_args = (config.tokenizer_path, config.chat_template)
    self._tokenizer_args = (config.tokenizer_path, config.add_bos, config.add_eos)
    self.use_chat_template = config.use_chat_template
    self._renderer = None
    self.counts = {"read": 0, "truncated": 0, "dropped": 0}

  def renderer(self):
    if self._renderer is None:
      from MaxText.input_pipeline.chat_template import ChatRenderer  # pylint: disable=import-outside-toplevel

      self._renderer = ChatRenderer(*self._renderer_args)
    return self._renderer

  def _as_messages(self, value, role: str, where) -> list:
    if not _is_messages(value):
      return [{"role": role, "content": record_text(value)}]
    value = record_text(value)
    value = json.loads(value) if isinstance(value, str) else value
    return [dict(m) for m in (value.tolist() if isinstance(value, np.ndarray) else value)]

  def _sample(self, prompt, response, where) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response, and 1 on the response's tokens."""
    chat = self.use_chat_template or _is_messages(response) or (prompt is not None and _is_messages(prompt))
    if not chat:
      path, add_bos, add_eos = self._tokenizer_args
      prompt_ids = build_tokenizer(path, add_bos, False).encode(record_text(prompt)) if prompt is not None else []
      response_ids = build_tokenizer(path, add_bos and prompt is None, add_eos).encode(record_text(response))
      return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)
    first = [] if prompt is None else self._as_messages(prompt, "user", where)
    messages = first + self._as_messages(response, "assistant", where)
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i >= len(first)]
    if not turns:
      raise UserError(f"{where} has no assistant turn in its response (roles: {[m.get('role') for m in messages]})")
    if prompt is None:
      turns = turns[-1:]  # the prompt is the conversation before the last assistant turn
    text, spans = self.renderer().assistant_spans(messages, where)  # one per assistant turn, in order
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    spans = [span for i, span in zip(assistant, spans) if i in turns]
    encoding = self.renderer()._tok.encode(text, add_special_tokens=False)  # pylint: disable=protected-access
    check_rendered(encoding.ids, where)
    mask = [int(any(start <= begin < end for start, end in spans)) for begin, _ in encoding.offsets]
    return encoding.ids, mask

  def _fit(self, chosen: list, rejected: list) -> tuple[int, int]:
    """How many tokens of each sample to keep so that both inputs fit one row (each is len - 1 inputs)."""
    room = self.max_tokens
    c, r = len(chosen) - 1, len(rejected) - 1
    if c + r <= room:
      return c + 1, r + 1
    self._count("truncated")
    keep_c = min(c, max(room // 2, room - r))
    return keep_c + 1, room - keep_c + 1

  def __call__(self, record) -> dict:
    self.counts["read"] += 1
    where = RecordPlace(self.split, self.counts["read"] - 1, record)
    values = self._columns(record)
    prompt = values[0] if len(values) == 3 else None
    (chosen, chosen_mask), (rejected, rejected_mask) = (self._sample(prompt, v, where) for v in values[-2:])
    keep_c, keep_r = self._fit(chosen, rejected)
    parts = [(chosen[:keep_c], chosen_mask[:keep_c], 1), (rejected[:keep_r], rejected_mask[:keep_r], 2)]
    if any(len(ids) < 2 or not any(mask[1:]) for ids, mask, _ in parts):
      self._drop(self.row_length)
      empty = np.zeros(0, np.int32)
      return {"inputs": empty, "targets": empty, "loss_mask": empty, "segment_ids": empty, "inputs_position": empty}
    self._dropped_in_a_row = 0
    document = {k: [] for k in ("inputs", "targets", "loss_mask", "segment_ids", "inputs_position")}
    for ids, mask, segment in parts:
      document["inputs"] += ids[:-1]
      document["targets"] += ids[1:]
      document["loss_mask"] += mask[1:]
      document["segment_ids"] += [segment] * (len(ids) - 1)
      document["inputs_position"] += list(range(len(ids) - 1))
    return {k: np.asarray(v, np.int32) for k, v in document.items()}

  @property
  def row_length(self) -> int:
    return self.max_tokens  # a pair's two samples share one row
