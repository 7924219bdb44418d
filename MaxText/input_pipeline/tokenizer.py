"""Tokenizers from local files: SentencePiece models, tiktoken rank files, Hugging Face tokenizer.json.

The kind is chosen from the path: a name containing "tiktoken" is a tiktoken rank file (Llama 3 layout);
a .json file, or a directory holding tokenizer.json, is a Hugging Face tokenizer; anything else must be
a SentencePiece model. Nothing is downloaded.
"""

import base64
import functools
import json
import os

from MaxText.errors import UserError


class SentencePieceTokenizer:
  """A SentencePiece model file (the shipped assets/tokenizer.default, Llama 2, Mistral, Gemma...)."""

  def __init__(self, path: str, add_bos: bool, add_eos: bool):
    import sentencepiece  # pylint: disable=import-outside-toplevel

    self._sp = sentencepiece.SentencePieceProcessor()
    try:
      self._sp.Load(path)
    except (OSError, RuntimeError) as e:
      raise UserError(f"tokenizer_path={path} is not a SentencePiece model ({e})") from None
    self.add_bos, self.add_eos = add_bos, add_eos
    self.vocab_size = self._sp.GetPieceSize()
    self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()

  def encode(self, text: str) -> list[int]:
    ids = self._sp.EncodeAsIds(text)
    return (
      ([self.bos_id] if self.add_bos and self.bos_id >= 0 else [])
      + ids
      + ([self.eos_id] if self.add_eos and self.eos_id >= 0 else [])
    )

  def decode(self, ids) -> str:
    return self._sp.DecodeIds([int(i) for i in ids])

  def token_id(self, token: str) -> int | None:
    """The id of a piece (e.g. a special token), or None if the model has no such piece."""
    piece_id = self._sp.PieceToId(token)
    return piece_id if piece_id != self._sp.unk_id() or token == self._sp.IdToPiece(piece_id) else None


# Llama 3 pre-tokenisation pattern and special tokens (256 reserved ids after the ranks).
_LLAMA3_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NUM_RESERVED_SPECIAL_TOKENS = 256


# Llama 3.1's named special tokens (ids 128000...); Llama 3 has the same ids for the ones both name.
_LLAMA3_SPECIAL_TOKENS = (
  "<|begin_of_text|>",
  "<|end_of_text|>",
  "<|reserved_special_token_0|>",
  "<|reserved_special_token_1|>",
  "<|finetune_right_pad_id|>",
  "<|reserved_special_token_2|>",
  "<|start_header_id|>",
  "<|end_header_id|>",
  "<|eom_id|>",
  "<|eot_id|>",
  "<|python_tag|>",
)


def _llama3_special_tokens(path: str, num_ranks: int) -> list[str]:
  """The 256 special tokens after the ranks: as a tokenizer_config.json next to the file names them (a converted
  Hugging Face directory), else Llama 3.1's names with the rest reserved."""
  names = list(_LLAMA3_SPECIAL_TOKENS) + [
    f"<|reserved_special_token_{i}|>" for i in range(3, _NUM_RESERVED_SPECIAL_TOKENS - len(_LLAMA3_SPECIAL_TOKENS) + 3)
  ]
  config_file = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
  if os.path.isfile(config_file):
    with open(config_file, encoding="utf-8") as f:
      added = json.load(f).get("added_tokens_decoder") or {}
    for token_id, token in added.items():
      if num_ranks <= int(token_id) < num_ranks + _NUM_RESERVED_SPECIAL_TOKENS:
        names[int(token_id) - num_ranks] = token["content"]
  return names


class TikTokenTokenizer:
  """A tiktoken BPE rank file (`<base64 token> <rank>` per line) with Llama 3's special tokens."""

  def __init__(self, path: str, add_bos: bool, add_eos: bool):
    import tiktoken  # pylint: disable=import-outside-toplevel

    ranks = {}
    try:
      with open(path, "rb") as f:
        for line in f:
          if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    except (OSError, ValueError) as e:
      raise UserError(f"tokenizer_path={path} is not a tiktoken rank file ({e})") from None
    specials = _llama3_special_tokens(path, len(ranks))
    special_ids = {tok: len(ranks) + i for i, tok in enumerate(specials)}
    self._enc = tiktoken.Encoding(
      os.path.basename(path), pat_str=_LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special_ids
    )
    self.add_bos, self.add_eos = add_bos, add_eos
    self.vocab_size = len(ranks) + len(specials)
    self.bos_id, self.eos_id = special_ids["<|begin_of_text|>"], special_ids["<|end_of_text|>"]

  def encode(self, text: str) -> list[int]:
    # Special tokens written in the text (chat formats: <|start_header_id|>, <|eot_id|>) are encoded as those tokens,
    # as transformers' Llama 3 tokenizer does.
    ids = self._enc.encode(text, allowed_special="all")
    return ([self.bos_id] if self.add_bos else []) + ids + ([self.eos_id] if self.add_eos else [])

  def decode(self, ids) -> str:
    return self._enc.decode([int(i) for i in ids])

  def token_id(self, token: str) -> int | None:
    """The id of a special token (e.g. <|eot_id|>), or None if it has none."""
    return self._enc.encode_single_token(token) if token in self._enc.special_tokens_set else None


# Special tokens that mark the start and end of a document in common tokenizer.json files.
_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
_EOS_NAMES = ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "[SEP]")


class HuggingFaceTokenizer:
  """A Hugging Face `tokenizers` tokenizer.json (a file, or a directory with tokenizer_config.json naming BOS/EOS)."""

  def __init__(self, path: str, add_bos: bool, add_eos: bool):
    from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel

    directory = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
      self._tok = Tokenizer.from_file(file)
    except Exception as e:  # pylint: disable=broad-except  # the Rust library raises plain Exceptions
      raise UserError(f"tokenizer_path={path} is not a Hugging Face tokenizer.json ({e})") from None
    named = {}
    config_file = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config_file):
      with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
      for key in ("bos_token", "eos_token"):
        token = config.get(key)
        named[key] = token.get("content") if isinstance(token, dict) else token
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.bos_id = self._special_id(vocab, named.get("bos_token"), _BOS_NAMES)
    self.eos_id = self._special_id(vocab, named.get("eos_token"), _EOS_NAMES)
    for flag, token_id, what in ((add_bos, self.bos_id, "bos"), (add_eos, self.eos_id, "eos")):
      if flag and token_id is None:
        raise UserError(f"tokenizer_path={path} has no {what.upper()} token that MaxText recognises; set add_{what}=false")
    self.add_bos, self.add_eos = add_bos, add_eos
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

  @staticmethod
  def _special_id(vocab, configured, candidates):
    for token in ([configured] if configured else []) + list(candidates):
      if token in vocab:
        return vocab[token]
    return None

  def encode(self, text: str) -> list[int]:
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return ([self.bos_id] if self.add_bos else []) + ids + ([self.eos_id] if self.add_eos else [])

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def token_id(self, token: str) -> int | None:
    """The id of a token of the vocabulary (e.g. a special token), or None if it has none."""
    return self._tok.token_to_id(token)


@functools.cache
def build_tokenizer(path: str, add_bos: bool = True, add_eos: bool = True):
  """The tokenizer stored at `path` (a local file or directory), adding BOS/EOS around each text as asked."""
  if not os.path.exists(path):
    raise UserError(f"tokenizer_path={path} does not exist")
  if os.path.isdir(path) or path.endswith(".json"):
    return HuggingFaceTokenizer(path, add_bos, add_eos)
  if "tiktoken" in os.path.basename(path):
    return TikTokenTokenizer(path, add_bos, add_eos)
  return SentencePieceTokenizer(path, add_bos, add_eos)
