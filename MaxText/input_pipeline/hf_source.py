"""dataset_type=hf: Hugging Face `datasets`, streamed (local Parquet/JSON/Arrow files, or the hub where a network exists).

    hf_path=parquet hf_train_files=/data/*.parquet    ->  datasets.load_dataset("parquet", data_files=..., streaming=True)

Each data shard streams its share (datasets.distributed.split_dataset_by_node), so the processes that hold
the same rows read the same records. The position is the stream's own state_dict: exact without
shuffling; with enable_data_shuffling the shuffle buffer is not saved, so after a restore the buffer
refills from the saved position (logged).
"""

import glob
import gzip
import json
import os

from MaxText import max_logging
from MaxText.errors import UserError

_SHUFFLE_BUFFER = 1024


def _data_files(files: str, key: str):
  if not files:
    return None
  patterns = [p.strip() for p in files.split(";") if p.strip()]
  for pattern in patterns:
    if "://" not in pattern and not glob.glob(pattern):
      raise UserError(f"{key}: '{pattern}' matches no file")
  return patterns


def _first_line(e: BaseException) -> str:
  """'Type: the message's first line' (some errors have no message, e.g. StopIteration)."""
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def _local_files(files) -> list[str]:
  return [f for pattern in files or [] if "://" not in pattern for f in sorted(glob.glob(pattern))]


def _json_lines_error(path: str) -> str | None:
  """Where and why the file is not JSON lines (None if it is, or is one JSON document, or cannot be checked)."""
  if path.endswith((".bz2", ".xz", ".zst", ".zip")):
    return None
  try:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          json.loads(line)
        except json.JSONDecodeError as e:
          if number == 1 and line.lstrip()[:1] in "[{":  # maybe one multi-line JSON document, which datasets reads too
            f.seek(0)
            try:
              json.load(f)
              return None
            except json.JSONDecodeError:
              pass
          return f"line {number}: {e.msg} at column {e.colno} ({line.strip()[:80]})"
  except UnicodeDecodeError as e:
    return f"not UTF-8 text ({e.reason} at byte {e.start} of a line)"
  except OSError as e:
    return f"{type(e).__name__}: {e}"
  return None


def read_error(config, train: bool, error: BaseException) -> str:
  """The line of a UserError for an error of `datasets` reading the data files (at load or while streaming)."""
  key, files = _key_and_files(config, train)
  local = _local_files(files)
  if isinstance(error, StopIteration) and local:  # datasets found no first record to infer the columns from
    named = [f for f in local if _is_empty(f)] or local
    return f"{key}: {', '.join(named)[:300]} {'has' if len(named) == 1 else 'have'} no records"
  if config.hf_path == "json" and _is_parse_error(error):
    for path in local:  # the error does not say which file: the first one that is not JSON lines
      problem = _json_lines_error(path)
      if problem:
        return f"{key}: {path} is not valid JSON lines: {problem}"
  where = f"{key}: {local[0]}" if len(local) == 1 else f"hf_path={config.hf_path}"
  return f"{where}: cannot read the data: {_first_line(error)}"


def _is_parse_error(error: BaseException) -> bool:
  import pyarrow  # pylint: disable=import-outside-toplevel  # a dependency of datasets

  return isinstance(error, (pyarrow.lib.ArrowException, json.JSONDecodeError))


def _is_empty(path: str) -> bool:
  """Whether the file holds nothing but whitespace (looked at when datasets found no record; big files are not)."""
  try:
    with open(path, "rb") as f:
      return os.path.getsize(path) <= 1 << 20 and not f.read().strip()
  except OSError:
    return False


def _key_and_files(config, train: bool):
  if train:
    return "hf_train_files", _data_files(config.hf_train_files, "hf_train_files")
  if config.hf_eval_files:
    return "hf_eval_files", _data_files(config.hf_eval_files, "hf_eval_files")
  return "hf_path", None


def load(config, train: bool):
  """The streaming train or eval dataset (an IterableDataset); a UserError for bad paths or splits."""
  import datasets  # pylint: disable=import-outside-toplevel

  _, files = _key_and_files(config, train)
  if train:
    split = config.train_split
  else:  # config_validation made sure that hf_eval_files or hf_eval_split is set
    split = "train" if config.hf_eval_files else config.hf_eval_split
  try:
    return datasets.load_dataset(
      config.hf_path,
      data_dir=config.hf_data_dir or None,
      data_files=files,
      split=split,
      streaming=True,
      token=config.hf_access_token or None,  # None: the HF_TOKEN environment or the cached login, if any
    )
  except Exception as e:  # pylint: disable=broad-except  # datasets raises many kinds for bad paths and splits
    if isinstance(e, StopIteration) or _is_parse_error(e):  # it reads the first records to find the columns
      raise UserError(read_error(config, train, e)) from None
    raise UserError(f"hf_path={config.hf_path}: {_first_line(e)}") from None


def stream_opener(dataset, config, train: bool, decode, shard_index: int, shard_count: int):
  """open_stream(epoch, position) for packing.StreamCursor over share shard_index of shard_count of `dataset`."""
  import pyarrow  # pylint: disable=import-outside-toplevel  # a dependency of datasets
  from datasets.distributed import split_dataset_by_node  # pylint: disable=import-outside-toplevel

  shuffle = train and config.enable_data_shuffling

  def open_stream(epoch: int, position):
    ds = split_dataset_by_node(dataset, rank=shard_index, world_size=shard_count)
    if shuffle:
      ds = ds.shuffle(seed=config.data_shuffle_seed, buffer_size=_SHUFFLE_BUFFER)
      ds.set_epoch(epoch)
    if position is not None:
      if shuffle:
        max_logging.warn("Resuming a shuffled hf stream: its shuffle buffer refills from the saved position")
      ds.load_state_dict(position)
    iterator = iter(ds)
    while True:
      try:
        record = next(iterator)
      except StopIteration:
        return
      except (ValueError, pyarrow.lib.ArrowException) as e:  # files are read lazily: a malformed one shows here
        raise UserError(read_error(config, train, e)) from None
      yield decode(record), ds.state_dict()

  return open_stream
