"""create_data_iterator / create_eval_iterator: config.dataset_type -> an iterator of global batches.

Every iterator yields dicts of (rows, max_target_length) int32 jax.Arrays on the data sharding
(inputs, inputs_position, inputs_segmentation, targets, targets_position, targets_segmentation) and
has get_state()/set_state() for exact resume from a checkpoint. When the data runs out it yields
all-padding batches (no loss), so that every process keeps stepping until all are done.
"""

import functools

import jax

from MaxText import max_logging
from MaxText.errors import UserError
from MaxText.input_pipeline import embedded_corpus, grain_source, hf_source, tfds_resplit, tfds_source
from MaxText.input_pipeline.batching import RowStreamBatcher, ShardStreamBatcher, WorkerRowStreamBatcher
from MaxText.input_pipeline.documents import DocumentDecoder
from MaxText.input_pipeline.dpo import DpoDecoder
from MaxText.input_pipeline.grpo_prompts import GrpoPromptDecoder
from MaxText.input_pipeline.image_sft import ImageSftDecoder
from MaxText.input_pipeline.multihost_dataloading import GlobalBatchIterator, data_shards, describe_rows, process_rows
from MaxText.input_pipeline.sft import SftDecoder
from MaxText.input_pipeline.synthetic import SyntheticDataIterator
from MaxText.runtime import sharding


def document_decoder(config, train: bool):
  """record -> document: DocumentDecoder, or with use_sft the chat samples' SftDecoder (the eval data too), with
  use_dpo the preference pairs' DpoDecoder, with use_grpo the prompts' GrpoPromptDecoder."""
  if config.use_grpo:
    return GrpoPromptDecoder(config, train)
  if config.use_dpo:
    return DpoDecoder(config, train)
  if config.use_sft:
    return ImageSftDecoder(config, train) if config.use_multimodal else SftDecoder(config, train)
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
    import grain  # pylint: disable=import-outside-toplevel  # here: synthetic data runs without grain

    documents = grain.MapDataset.source(records)
    if self.train:
      if config.enable_data_shuffling:
        documents = documents.shuffle(seed=config.data_shuffle_seed)  # reshuffled every epoch
      documents = documents.repeat(None if config.num_epoch == -1 else config.num_epoch)
    documents = documents.map(document_decoder(config, self.train))
    return RowStreamBatcher(documents, self.num_rows, rows, config.max_target_length, config.packing)


def _shard_stream_opener(config, train: bool, tfds_builder):
  """open_shard(k, S) -> open_stream(epoch, position) over share k of S of a sequential source."""
  decode = document_decoder(config, train)
  if tfds_builder is not None:
    return lambda shard, count: tfds_source.stream_opener(config, *tfds_builder, train, decode, shard, count)
  dataset = hf_source.load(config, train)
  return lambda shard, count: hf_source.stream_opener(dataset, config, train, decode, shard, count)


def local_batcher(config, mesh, train: bool, num_rows: int, processes=None):
  """The iterator of a process's rows of each global batch.

  Args:
    processes: the process indices whose rows to load (default: this process). All of them give the whole
      global batch, as one process holding every device would load it.

  Returns:
    (iterator, rows): rows are the global rows that the processes' devices hold, in the order of the
    iterator's batch rows.
  """
  processes = [jax.process_index()] if processes is None else list(processes)
  data_sharding = sharding.data_sharding(config, mesh)
  global_shape = (num_rows, config.max_target_length)
  rows = sorted({row for p in processes for row in process_rows(data_sharding, global_shape, p)})
  if train:
    who = f"Process {processes[0]}" if len(processes) == 1 else f"Processes {processes}"
    max_logging.log(f"{who} loads rows {describe_rows(rows)} of each {num_rows}-row train batch", every_process=True)
  tfds_builder = tfds_source.open_builder(config, train) if config.dataset_type == "tfds" else None
  records = _random_access_records(config, train, tfds_builder)
  if records is not None:
    factory = RandomAccessRows(config, train, num_rows, records)
    if train and config.grain_worker_count > 0:
      return WorkerRowStreamBatcher(factory, rows, config.grain_worker_count), rows
    return factory(rows), rows
  blocks = data_shards(data_sharding, global_shape)
  shards = [k for k, block in enumerate(blocks) if block.start in rows]
  open_shard = _shard_stream_opener(config, train, tfds_builder)
  resplit = None  # a Hugging Face stream cannot seek: it resumes only on the same data shards
  if tfds_builder is not None:
    resplit = functools.partial(tfds_resplit.resplit, tfds_source.Shares(config, *tfds_builder, train))
  batcher = ShardStreamBatcher(
    lambda k: open_shard(k, len(blocks)),
    shards,
    len(blocks),
    len(blocks[0]),
    config.num_epoch if train else 1,
    config.max_target_length,
    config.packing,
    resplit,
  )
  return batcher, rows


def _global_iterator(config, mesh, train: bool, num_rows: int) -> GlobalBatchIterator:
  local, rows = local_batcher(config, mesh, train, num_rows)
  global_shape = (num_rows, config.max_target_length)
  return GlobalBatchIterator(
    local, sharding.data_sharding(config, mesh), global_shape, rows, "training" if train else "eval"
  )


def create_data_iterator(config, mesh):
  """The train iterator for config.dataset_type."""
  if config.dataset_type == "synthetic":
    return SyntheticDataIterator(config, mesh)
  # GRPO loads the batch's prompts, num_generations rows each once generated (features/grpo.py).
  rows = config.global_batch_size_to_load // (config.num_generations if config.use_grpo else 1)
  return _global_iterator(config, mesh, True, rows)


def create_eval_iterator(config, mesh):
  """A fresh pass over the eval data (unshuffled), from its beginning."""
  return _global_iterator(config, mesh, False, config.global_batch_size_to_load_eval)
