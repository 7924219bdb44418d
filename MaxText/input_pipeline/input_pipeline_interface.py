"""create_data_iterator / create_eval_iterator: config.dataset_type -> an iterator of global batches.

Every iterator yields dicts of (rows, max_target_length) int32 jax.Arrays on the data sharding
(inputs, inputs_position, inputs_segmentation, targets, targets_position, targets_segmentation) and
has get_state()/set_state() for exact resume from a checkpoint. When the data runs out it yields
all-padding batches (no loss), so that every process keeps stepping until all are done.
"""

import grain
import jax

from MaxText import max_logging, sharding
from MaxText.errors import UserError
from MaxText.input_pipeline import embedded_corpus, grain_source, hf_source, tfds_source
from MaxText.input_pipeline.batching import RowStreamBatcher, StreamBatcher, WorkerRowStreamBatcher
from MaxText.input_pipeline.documents import DocumentDecoder
from MaxText.input_pipeline.multihost_dataloading import GlobalBatchIterator, process_row_range
from MaxText.input_pipeline.synthetic import SyntheticDataIterator


def document_decoder(config, train: bool) -> DocumentDecoder:
  return DocumentDecoder(
    column=config.train_data_column if train else config.eval_data_column,
    tokenize=config.tokenize_train_data if train else config.tokenize_eval_data,
    tokenizer_path=config.tokenizer_path,
    add_bos=config.add_bos,
    add_eos=config.add_eos,
    vocab_size=config.vocab_size,
  )


def _random_access_records(config, train: bool, tfds_builder=None):
  """The records of a random-access source (embedded corpus, Grain ArrayRecord, TFDS ArrayRecord), else None."""
  if config.dataset_type == "embedded":
    return embedded_corpus.split_documents("train" if train else "eval")
  if config.dataset_type == "grain":
    return grain_source.array_record_source(
      config.grain_train_files if train else config.grain_eval_files, "grain_train_files" if train else "grain_eval_files"
    )
  if config.dataset_type == "tfds":
    builder, split = tfds_builder or tfds_source.open_builder(config, train)
    return tfds_source.random_access_records(builder, split) if tfds_source.is_array_record(builder) else None
  return None


class RandomAccessRows:
  """Picklable factory of the RowStreamBatcher of some global rows (also run in worker processes, which
  open the records again: `records` is not sent to them)."""

  def __init__(self, config, train: bool, num_rows: int, records=None):
    self.config, self.train, self.num_rows, self.records = config, train, num_rows, records

  def __getstate__(self):
    return dict(self.__dict__, records=None)

  def __call__(self, rows) -> RowStreamBatcher:
    config = self.config
    records = self.records if self.records is not None else _random_access_records(config, self.train)
    if len(records) == 0:
      raise UserError(f"the {'train' if self.train else 'eval'} data of dataset_type={config.dataset_type} holds no records")
    documents = grain.MapDataset.source(records)
    if self.train:
      if config.enable_data_shuffling:
        documents = documents.shuffle(seed=config.data_shuffle_seed)  # reshuffled every epoch
      documents = documents.repeat(None if config.num_epoch == -1 else config.num_epoch)
    documents = documents.map(document_decoder(config, self.train))
    return RowStreamBatcher(documents, self.num_rows, rows, config.max_target_length, config.packing)


def _local_batcher(config, mesh, train: bool, num_rows: int):
  """The iterator of this process's rows of each global batch."""
  start, stop = process_row_range(sharding.data_sharding(config, mesh), (num_rows, config.max_target_length))
  if train:
    max_logging.log(f"Process {jax.process_index()} loads rows [{start}, {stop}) of each {num_rows}-row train batch")
  tfds_builder = tfds_source.open_builder(config, train) if config.dataset_type == "tfds" else None
  records = _random_access_records(config, train, tfds_builder)
  if records is not None:
    factory = RandomAccessRows(config, train, num_rows, records)
    if train and config.grain_worker_count > 0:
      return WorkerRowStreamBatcher(factory, range(start, stop), config.grain_worker_count)
    return factory(range(start, stop))
  decode = document_decoder(config, train)
  process = (jax.process_index(), jax.process_count())
  if tfds_builder is not None:
    opener = tfds_source.stream_opener(config, *tfds_builder, train, decode, *process)
  else:
    opener = hf_source.stream_opener(config, train, decode, *process)
  epochs = config.num_epoch if train else 1
  return StreamBatcher(opener, epochs, stop - start, config.max_target_length, config.packing, process)


def create_data_iterator(config, mesh):
  """The train iterator for config.dataset_type."""
  if config.dataset_type == "synthetic":
    return SyntheticDataIterator(config, mesh)
  rows = config.global_batch_size_to_load
  local = _local_batcher(config, mesh, True, rows)
  return GlobalBatchIterator(local, sharding.data_sharding(config, mesh), (rows, config.max_target_length), "training")


def create_eval_iterator(config, mesh):
  """A fresh pass over the eval data (unshuffled), from its beginning."""
  rows = config.global_batch_size_to_load_eval
  local = _local_batcher(config, mesh, False, rows)
  return GlobalBatchIterator(local, sharding.data_sharding(config, mesh), (rows, config.max_target_length), "eval")
