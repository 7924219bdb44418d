"""Tokenizes text, JSON-lines or Parquet files into ArrayRecord shards for dataset_type=grain.

    python3 MaxText/preprocess_data.py --input 'corpus/*.jsonl' --output_prefix /data/tokenized/train \\
        [--tokenizer_path MaxText/assets/tokenizer.default] [--column text] [--num_shards 8]

A .txt file is one document; a .jsonl line or a Parquet row is one document (its --column). Each
document becomes one tf.train.Example whose --column holds the token ids (with BOS/EOS unless
--no_bos/--no_eos). Train on them with:

    python3 MaxText/train.py MaxText/configs/base.yml run_name=x dataset_type=grain \\
        grain_train_files='/data/tokenized/train.array_record-*' tokenize_train_data=false
"""

import argparse
import glob
import json
import os
import sys

if __package__ in (None, ""):  # Run as `python3 MaxText/preprocess_data.py`.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxText.configuration.config_loader import PACKAGE_DIR  # pylint: disable=wrong-import-position
from MaxText.errors import UserError  # pylint: disable=wrong-import-position
from MaxText.pyconfig import resolve_asset_path  # pylint: disable=wrong-import-position
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=wrong-import-position


def _documents(path: str, column: str):
  """Yields (text or bytes) documents of one input file."""
  if path.endswith(".txt"):
    with open(path, "rb") as f:
      yield f.read()
  elif path.endswith((".jsonl", ".json")):
    with open(path, "rb") as f:
      for number, line in enumerate(f, start=1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise UserError(f"{path}:{number} is not JSON ({e.msg})") from None
        if column not in record:
          raise UserError(f"{path}:{number} has no column '{column}' (it has: {', '.join(record)}); set --column")
        yield record[column]
  elif path.endswith(".parquet"):
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

    table = pq.ParquetFile(path)
    if column not in table.schema_arrow.names:
      raise UserError(f"{path} has no column '{column}' (it has: {', '.join(table.schema_arrow.names)}); set --column")
    for batch in table.iter_batches(columns=[column]):
      yield from batch.column(0).to_pylist()
  else:
    raise UserError(f"{path}: unknown file kind; use .txt, .jsonl/.json or .parquet")


def preprocess(
  inputs: str, output_prefix: str, tokenizer_path: str, column: str, num_shards: int, add_bos: bool, add_eos: bool
):
  """Writes the shards and returns a summary dict (documents, tokens, empty, invalid_utf8, shards)."""
  # pylint: disable=import-outside-toplevel
  from array_record.python.array_record_module import ArrayRecordWriter
  from tqdm import tqdm

  from MaxText.input_pipeline import tf_example
  from MaxText.input_pipeline.tokenizer import build_tokenizer

  paths = sorted(p for pattern in inputs.split(";") for p in glob.glob(pattern.strip()))
  if not paths:
    raise UserError(f"--input {inputs} matches no file")
  if num_shards < 1:
    raise UserError(f"--num_shards={num_shards} must be positive")
  found = resolve_asset_path(tokenizer_path, os.path.join(PACKAGE_DIR, "configs", "base.yml"))
  if found is None:
    raise UserError(f"--tokenizer_path {tokenizer_path} does not exist")
  tokenizer = build_tokenizer(found, add_bos, add_eos)
  existing = glob.glob(f"{output_prefix}.array_record-*")
  if existing:
    # Old shards would match the same train glob and mix with the new ones.
    raise UserError(
      f"--output_prefix {output_prefix}: {len(existing)} shards already exist ({existing[0]}, ...); "
      "remove them or choose another prefix"
    )
  os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
  shards = [f"{output_prefix}.array_record-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)]
  writers = [ArrayRecordWriter(p, "group_size:1") for p in shards]
  summary = {"documents": 0, "tokens": 0, "empty": 0, "invalid_utf8": 0, "shards": shards}
  try:
    with tqdm(desc=f"tokenizing {len(paths)} files", unit=" docs", mininterval=1.0) as progress:
      for path in paths:
        for document in _documents(path, column):
          if isinstance(document, bytes):
            try:
              document = document.decode("utf-8")
            except UnicodeDecodeError:
              summary["invalid_utf8"] += 1
              document = document.decode("utf-8", errors="replace")
          if not document or not str(document).strip():
            summary["empty"] += 1
            continue
          ids = tokenizer.encode(str(document))
          writers[summary["documents"] % num_shards].write(tf_example.serialize({column: ids}))
          summary["documents"] += 1
          summary["tokens"] += len(ids)
          progress.update()
          progress.set_postfix(tokens=summary["tokens"], refresh=False)
  finally:
    for writer in writers:
      writer.close()
  return summary


def main(argv) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--input", required=True, help="';'-separated globs of .txt, .jsonl or .parquet files")
  parser.add_argument("--output_prefix", required=True, help="shards are <prefix>.array_record-NNNNN-of-NNNNN")
  parser.add_argument("--tokenizer_path", default="assets/tokenizer.default")
  parser.add_argument("--column", default="text", help="the text field of .jsonl/.parquet records, and the output feature")
  parser.add_argument("--num_shards", type=int, default=1)
  parser.add_argument("--no_bos", action="store_true")
  parser.add_argument("--no_eos", action="store_true")
  args = parser.parse_args(argv[1:])
  s = preprocess(
    args.input, args.output_prefix, args.tokenizer_path, args.column, args.num_shards, not args.no_bos, not args.no_eos
  )
  print(
    f"Wrote {s['documents']:,} documents, {s['tokens']:,} tokens in {len(s['shards'])} shards "
    f"({args.output_prefix}.array_record-*); skipped {s['empty']} empty documents; "
    f"{s['invalid_utf8']} had invalid UTF-8 (replaced by U+FFFD)"
  )


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
