"""use_sft with use_multimodal: image-text chat records (Gemma 3) -> SFT documents with their images' pixels.

A record holds its images in train_image_column (eval_image_column): PIL images (a datasets Image column of Parquet
or Arrow files), encoded bytes, or paths relative to the data files' directory; its text (the prompt and completion,
or the messages' contents) holds one image_placeholder per image, in order. Each placeholder becomes the image's
soft tokens (images.image_sequence) before the text is rendered and tokenized as sft.py does, and the document gets
"images" (max_num_images_per_example, C, H, W). Rows are unpacked (packing=false): one sample and its images per row.
A sample whose soft tokens max_target_length would cut is dropped and counted (it cannot be half an image).
"""

import glob
import os

import numpy as np

from MaxText import max_logging
from MaxText.input_pipeline import images
from MaxText.input_pipeline.sft import SftDecoder, as_dict, record_text
from MaxText.input_pipeline.tokenizer import build_tokenizer


def data_dir(config, train: bool) -> str:
  """The directory of the split's first data file, where relative image paths start ("" without local files)."""
  files = config.hf_train_files if train else config.hf_eval_files
  first = next((p.strip() for p in files.split(";") if p.strip()), "")
  matches = sorted(glob.glob(first)) if first and "://" not in first else []
  return os.path.dirname(os.path.abspath(matches[0])) if matches else ""


class ImageSftDecoder(SftDecoder):
  """SftDecoder of image-text records: also {"images": (N, C, H, W) float32}."""

  def __init__(self, config, train: bool = True):
    super().__init__(config, train)
    self.image_column = config.train_image_column if train else config.eval_image_column
    self.config, self.base_dir = config, data_dir(config, train)
    self.counts["images_cut"] = 0
    self._pixels = None
    images.check_image_token(build_tokenizer(config.tokenizer_path, False, False), config)

  def _expanded(self, value):
    """A column's text (or each message's content) with its placeholders expanded; how many it held."""
    placeholder, soft = self.config.image_placeholder, self.config.mm_tokens_per_image
    value = record_text(value)
    if isinstance(value, str):
      return images.expand_placeholders(value, placeholder, soft), value.count(placeholder)
    if isinstance(value, (list, np.ndarray)):  # messages
      messages = [dict(m) for m in (value.tolist() if isinstance(value, np.ndarray) else value)]
      count = 0
      for m in messages:
        if isinstance(record_text(m.get("content")), str):
          count += record_text(m["content"]).count(placeholder)
          m["content"] = images.expand_placeholders(record_text(m["content"]), placeholder, soft)
      return messages, count
    return value, 0

  def token_ids_and_mask(self, record, where) -> tuple[list[int], list[int]]:
    fields = dict(as_dict(record))
    placeholders = 0
    for column in self.columns:
      if column in fields:
        fields[column], count = self._expanded(fields[column])
        placeholders += count
    self._pixels = images.record_pixels(fields.get(self.image_column), placeholders, self.config, where, self.base_dir)
    ids, mask = super().token_ids_and_mask(fields, where)
    last = max((i for i, t in enumerate(ids) if t == self.config.image_token_id), default=-1)
    if last >= self.row_length:  # an input past the row: the image would be cut
      self._count("images_cut")
      return [], []  # dropped (sft.py counts it too)
    return ids, mask

  def __call__(self, record) -> dict:
    document = super().__call__(record)
    kept = len(document["loss_mask"]) > 0
    pixels = self._pixels if kept else np.zeros_like(self._pixels)
    return dict(document, images=pixels)

  def _log(self) -> None:
    super()._log()
    if self.counts.get("images_cut"):
      max_logging.log(
        f"SFT {self.split} data so far: {self.counts['images_cut']:,} samples dropped whose image tokens "
        f"max_target_length={self.row_length} would cut",
        every_process=True,
      )
