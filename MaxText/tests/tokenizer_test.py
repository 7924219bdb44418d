"""Tokenizers from local files: the shipped SentencePiece model and a tiktoken rank file."""

import base64

import pytest

from MaxText.errors import UserError
from MaxText.tests.helpers import tiny_config
from MaxText.tokenizer import build_tokenizer


def test_shipped_tokenizer_round_trips_and_adds_bos_eos():
  path = tiny_config().tokenizer_path
  tok = build_tokenizer(path, True, True)
  assert tok.vocab_size == 4096 and (tok.bos_id, tok.eos_id) == (1, 2)
  text = "The quick brown fox jumps over 1234 lazy dogs: naïve café."
  ids = tok.encode(text)
  assert ids[0] == 1 and ids[-1] == 2
  assert tok.decode(ids[1:-1]) == text
  assert build_tokenizer(path, False, False).encode(text) == ids[1:-1]


def test_tiktoken_rank_file(tmp_path):
  ranks = [bytes([b]) for b in range(256)] + [b"ab", b"abc"]
  path = tmp_path / "toy.tiktoken"
  path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
  tok = build_tokenizer(str(path), True, False)
  assert tok.vocab_size == len(ranks) + 256
  ids = tok.encode("abcab")
  assert ids == [tok.bos_id, 257, 256]
  assert tok.decode(ids[1:]) == "abcab"


def test_not_a_tokenizer_is_a_clear_error(tmp_path):
  bad = tmp_path / "tokenizer.bin"
  bad.write_bytes(b"not a model")
  with pytest.raises(UserError, match="is not a SentencePiece model"):
    build_tokenizer(str(bad))
