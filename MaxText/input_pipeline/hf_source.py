"""dataset_type=hf: Hugging Face `datasets`, streamed (local Parquet/JSON/Arrow files, or the hub where a network exists).

    hf_path=parquet hf_train_files=/data/*.parquet    ->  datasets.load_dataset("parquet", data_files=..., streaming=True)

Each data shard streams its share (datasets.distributed.split_dataset_by_node), so the processes that hold
the same rows read the same records. The position is the stream's own state_dict: exact without
shuffling; with enable_data_shuffling the shuffle buffer is not saved, so after a restore the buffer
refills from the saved position (logged).
"""

import glob

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


def load(config, train: bool):
  """The streaming train or eval dataset (an IterableDataset); a UserError for bad paths or splits."""
  import datasets  # pylint: disable=import-outside-toplevel

  if train:
    files, split = _data_files(config.hf_train_files, "hf_train_files"), config.train_split
  elif config.hf_eval_files:
    files, split = _data_files(config.hf_eval_files, "hf_eval_files"), "train"
  else:  # config_validation made sure that one of the two is set
    files, split = None, config.hf_eval_split
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
    raise UserError(f"hf_path={config.hf_path}: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from None


def stream_opener(dataset, config, train: bool, decode, shard_index: int, shard_count: int):
  """open_stream(epoch, position) for packing.StreamCursor over share shard_index of shard_count of `dataset`."""
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
    for record in iterator:
      yield decode(record), ds.state_dict()

  return open_stream
