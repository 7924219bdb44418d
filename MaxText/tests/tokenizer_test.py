"""Tokenizers from local files: the shipped SentencePiece model and a tiktoken rank file."""

import base64

import pytest

from MaxText.errors import UserError
from MaxText.input_pipeline.tokenizer import build_tokenizer
from MaxText.tests.helpers import tiny_config


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


@pytest.mark.parametrize("file_format", ["tfrecord", "array_record"])
def test_train_tokenizer_takes_upstreams_tfds_flags(tmp_path, file_format):
  """Upstream's train_tokenizer.py flags: the text of a prepared TFDS dataset, written to assets_path/vocab_model_name."""
  from MaxText.input_pipeline import sample_datasets  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import run_python  # pylint: disable=import-outside-toplevel

  data = tmp_path / "tfds"
  sample_datasets.write_tfds(str(data), file_format, limit=40)
  flags = [f"--dataset_path={data}", f"--dataset_name={sample_datasets.TFDS_NAME}", "--vocab_size=1024"]
  result = run_python(["MaxText/train_tokenizer.py", *flags, f"--assets_path={tmp_path}/assets", "--vocab_model_name=t"])
  assert result.returncode == 0, result.stderr[-2000:]
  tokenizer = build_tokenizer(str(tmp_path / "assets" / "t"), add_bos=False, add_eos=False)
  text = sample_datasets.split_texts("train", 40)[0][:400]
  assert len(tokenizer.encode(text)) < len(text) / 2  # trained on that text: its merges compress it
  missing = run_python(["MaxText/train_tokenizer.py", f"--dataset_path={tmp_path}/none", "--dataset_name=nope"])
  assert missing.returncode != 0 and "Error: dataset_name=nope" in missing.stderr and "Traceback" not in missing.stderr


def test_train_tokenizer_with_too_small_a_vocabulary_is_one_line(tmp_path):
  from MaxText.tests.helpers import run_python  # pylint: disable=import-outside-toplevel

  corpus = tmp_path / "a.txt"
  corpus.write_text("".join(chr(0x4E00 + i) for i in range(600)))  # 600 distinct characters
  result = run_python(["MaxText/train_tokenizer.py", f"--text_files={corpus}", "--vocab_size=300", f"--output={tmp_path}/t"])
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert "Error: SentencePiece cannot train a 300-token model on this text: Vocabulary size is smaller" in result.stderr
