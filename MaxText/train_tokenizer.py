"""Trains a SentencePiece tokenizer; by default the shipped MaxText/assets/tokenizer.default.

    python3 MaxText/train_tokenizer.py                       # rebuilds the shipped tokenizer
    python3 MaxText/train_tokenizer.py --text_files 'data/*.txt' --vocab_size 32000 --output my_tokenizer
    python3 MaxText/train_tokenizer.py --dataset_path=/data --dataset_name=c4/en:3.0.1 --assets_path=assets \
        --vocab_model_name=tokenizer                          # upstream's flags: a prepared TFDS dataset's text

Without --text_files or --dataset_name the text is the embedded corpus's train split (Python's own documentation).
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


def _train(corpus_path: str, model_prefix: str, vocab_size: int) -> None:
  sentencepiece.SentencePieceTrainer.Train(
    input=corpus_path,
    model_prefix=model_prefix,
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
    try:
      _train(corpus_path, os.path.join(tmp, "spm"), vocab_size)
    except RuntimeError as e:  # a vocabulary too small for the text's characters, an empty corpus, ...
      sys.exit(f"Error: SentencePiece cannot train a {vocab_size}-token model on this text: {str(e).split('] ')[-1]}")
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


def _read_tfds(dataset_path: str, dataset_name: str):
  """The `text` of a prepared TFDS dataset's train split (TFRecord or ArrayRecord), as the training pipeline reads
  it; never downloads."""
  import types  # pylint: disable=import-outside-toplevel

  from MaxText.errors import UserError  # pylint: disable=import-outside-toplevel
  from MaxText.input_pipeline import tfds_source  # pylint: disable=import-outside-toplevel

  config = types.SimpleNamespace(
    dataset_path=dataset_path, dataset_name=dataset_name, eval_dataset_name="", train_split="train",
    enable_data_shuffling=False, data_shuffle_seed=0,
  )  # fmt: skip
  try:
    builder, split = tfds_source.open_builder(config, train=True)
  except UserError as e:
    sys.exit(f"Error: {e}")
  text = lambda value: value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)  # noqa: E731
  if tfds_source.is_array_record(builder):
    source = tfds_source.random_access_records(builder, split)
    yield from (text(source[i]["text"]) for i in range(len(source)))
    return
  stream = tfds_source.stream_opener(config, builder, split, False, lambda record: text(record["text"]), 0, 1)
  yield from (document for document, _ in stream(0, None))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument(
    "--text_files", default="", help="';'-separated globs of UTF-8 text files (default: the embedded corpus)"
  )
  parser.add_argument("--dataset_path", default="", help="upstream's: the TFDS data directory of --dataset_name")
  parser.add_argument("--dataset_name", default="", help="upstream's: a prepared TFDS dataset whose `text` to read")
  parser.add_argument("--vocab_size", type=int, default=4096)
  parser.add_argument("--max_corpus_chars", type=int, default=10_000_000)
  parser.add_argument("--output", default="", help=f"the model file to write (default: {DEFAULT_OUTPUT})")
  parser.add_argument("--assets_path", default="", help="upstream's: with --vocab_model_name, write the model there")
  parser.add_argument("--vocab_model_name", default="", help="upstream's: the model file's name under --assets_path")
  args = parser.parse_args()
  if args.text_files and args.dataset_name:
    parser.error("give --text_files or --dataset_name, not both")
  if args.output and (args.assets_path or args.vocab_model_name):
    parser.error("give --output, or upstream's --assets_path and --vocab_model_name, not both")
  output = args.output or DEFAULT_OUTPUT
  if args.assets_path or args.vocab_model_name:
    output = os.path.join(args.assets_path or ".", args.vocab_model_name or "tokenizer")
  if args.text_files:
    texts = _read_files(args.text_files)
  elif args.dataset_name:
    texts = _read_tfds(args.dataset_path, args.dataset_name)
  else:
    texts = embedded_corpus.split_documents("train")
  train_tokenizer(texts, output, args.vocab_size, args.max_corpus_chars)
  print(f"Wrote a {args.vocab_size}-token SentencePiece model to {output}")


if __name__ == "__main__":
  main()
