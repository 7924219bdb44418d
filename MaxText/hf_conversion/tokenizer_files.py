"""Carries a model's tokenizer files between a Hugging Face directory and a converted MaxText directory.

MaxText's tokenizer_path then points at the original format when there is one (SentencePiece `tokenizer.model`
for Llama 2 / Mistral / Gemma, Llama 3's tiktoken rank file, which Meta ships as `original/tokenizer.model` and
is kept here as `tokenizer.tiktoken`), else at `tokenizer.json`; tokenizer_config.json sits next to them for the
special tokens.
"""

import base64
import binascii
import os
import shutil

# Files that transformers reads next to the weights (tokenizer, generation defaults, chat template).
SIDE_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "added_tokens.json",
  "generation_config.json",
  "chat_template.jinja",
)
TIKTOKEN_FILE = "tokenizer.tiktoken"
SENTENCEPIECE_FILE = "tokenizer.model"


def is_tiktoken(path: str) -> bool:
  """A tiktoken rank file is text lines `<base64 token> <rank>`; a SentencePiece model is a binary protobuf."""
  try:
    with open(path, "rb") as f:
      first = f.readline().split()
    return len(first) == 2 and first[1].isdigit() and bool(base64.b64decode(first[0], validate=True))
  except (OSError, binascii.Error, ValueError):
    return False


def copy_to_maxtext(hf_dir: str, out_dir: str) -> str | None:
  """Copies the tokenizer files into out_dir; returns the file name for tokenizer_path (None: no tokenizer)."""
  for name in SIDE_FILES:
    if os.path.isfile(os.path.join(hf_dir, name)):
      shutil.copyfile(os.path.join(hf_dir, name), os.path.join(out_dir, name))
  chosen = None
  for candidate in (os.path.join("original", "tokenizer.model"), SENTENCEPIECE_FILE, TIKTOKEN_FILE):
    path = os.path.join(hf_dir, candidate)
    if not os.path.isfile(path):
      continue
    target = TIKTOKEN_FILE if is_tiktoken(path) else SENTENCEPIECE_FILE
    if not os.path.exists(os.path.join(out_dir, target)):
      shutil.copyfile(path, os.path.join(out_dir, target))
    chosen = chosen or target
  if chosen is None and os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
    chosen = "tokenizer.json"
  return chosen


def copy_to_hf(tokenizer_dir: str, hf_dir: str) -> None:
  """Copies the tokenizer files found in tokenizer_dir (a converted directory) into an HF directory."""
  for name in SIDE_FILES:
    if os.path.isfile(os.path.join(tokenizer_dir, name)):
      shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(hf_dir, name))
  if os.path.isfile(os.path.join(tokenizer_dir, SENTENCEPIECE_FILE)):
    shutil.copyfile(os.path.join(tokenizer_dir, SENTENCEPIECE_FILE), os.path.join(hf_dir, SENTENCEPIECE_FILE))
  if os.path.isfile(os.path.join(tokenizer_dir, TIKTOKEN_FILE)):
    os.makedirs(os.path.join(hf_dir, "original"), exist_ok=True)
    shutil.copyfile(os.path.join(tokenizer_dir, TIKTOKEN_FILE), os.path.join(hf_dir, "original", "tokenizer.model"))
