"""Trains a SentencePiece tokenizer; by default the shipped MaxText/assets/tokenizer.default.

    python3 MaxText/train_tokenizer.py                       # rebuilds the shipped tokenizer
    python3 MaxText/train_tokenizer.py --text_files 'data/*.txt' --vocab_size 32000 --output my_tokenizer

Without --text_files the text is the embedded corpus's train split (Python's own documentation).
"""

import argparse
import glob
import os
import sys
import tempfile

if __package__ in (None, ""):  # Run as `python3 MaxText/train_tokenizer.py`: import from this checkout.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import sentencepiece  # pylint: disable=wrong-import-position
from sentencepiece import sentencepiece_model_pb2  # pylint: disable=wrong-import-position

from MaxText.input_pipeline import embedded_corpus  # pylint: disable=wrong-import-position

DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tokenizer.default")


def train_tokenizer(texts, output: str, vocab_size: int, max_corpus_chars: int) -> None:
  """Trains a byte-fallback BPE model on `texts` and writes it to `output` (the model file itself)."""
  with tempfile.TemporaryDirectory() as tmp:
    corpus_path = os.path.join(tmp, "corpus.txt")
    chars = 0
    with open(corpus_path, "w", encoding="utf-8") as f:
      for text in texts:
        if chars >= max_corpus_chars:
          break
        text = text[: max_corpus_chars - chars]
        f.write(text.replace("\r", "") + "\n")
        chars += len(text)
    sentencepiece.SentencePieceTrainer.Train(
      input=corpus_path,
      model_prefix=os.path.join(tmp, "spm"),
      model_type="bpe",
      vocab_size=vocab_size,
      character_coverage=1.0,
      byte_fallback=True,
      split_digits=True,
      unk_id=0,
      bos_id=1,
      eos_id=2,
      pad_id=-1,
      num_threads=1,  # One thread gives the same model on every run.
      max_sentence_length=1 << 16,
      minloglevel=2,
    )
    model = sentencepiece_model_pb2.ModelProto()
    with open(os.path.join(tmp, "spm.model"), "rb") as f:
      model.ParseFromString(f.read())
  # The trainer records its temporary paths; drop them so that a retrain gives the same bytes.
  del model.trainer_spec.input[:]
  model.trainer_spec.model_prefix = ""
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  with open(output, "wb") as f:
    f.write(model.SerializeToString())


def _read_files(patterns: str):
  paths = sorted(p for pattern in patterns.split(";") for p in glob.glob(pattern))
  if not paths:
    sys.exit(f"--text_files {patterns} matches no file")
  for path in paths:
    with open(path, encoding="utf-8", errors="replace") as f:
      yield f.read()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument(
    "--text_files", default="", help="';'-separated globs of UTF-8 text files (default: the embedded corpus)"
  )
  parser.add_argument("--vocab_size", type=int, default=4096)
  parser.add_argument("--max_corpus_chars", type=int, default=10_000_000)
  parser.add_argument("--output", default=DEFAULT_OUTPUT)
  args = parser.parse_args()
  texts = _read_files(args.text_files) if args.text_files else embedded_corpus.split_documents("train")
  train_tokenizer(texts, args.output, args.vocab_size, args.max_corpus_chars)
  print(f"Wrote a {args.vocab_size}-token SentencePiece model to {args.output}")


if __name__ == "__main__":
  main()
