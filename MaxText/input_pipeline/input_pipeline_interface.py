"""create_data_iterator: the dataset_type of the config -> an iterator of global batches.

Every iterator yields dicts of (global_batch_size_to_load, max_target_length) int32 jax.Arrays on the
data sharding (inputs, inputs_position, inputs_segmentation, targets, targets_position,
targets_segmentation) and has get_state()/set_state() for exact resume from a checkpoint.
"""

import grain

from MaxText import sharding
from MaxText.errors import UserError
from MaxText.input_pipeline import embedded_corpus, row_streams
from MaxText.input_pipeline.multihost_dataloading import GlobalBatchIterator, process_row_range
from MaxText.input_pipeline.synthetic import SyntheticDataIterator
from MaxText.tokenizer import build_tokenizer


def tokenize_documents(documents: grain.MapDataset, config) -> grain.MapDataset:
  """Documents (str) -> {"inputs", "targets"} token arrays; checks that the ids fit the model's vocab."""
  tokenizer = build_tokenizer(config.tokenizer_path, config.add_bos, config.add_eos)
  if tokenizer.vocab_size > config.vocab_size:
    raise UserError(
      f"tokenizer_path={config.tokenizer_path} has {tokenizer.vocab_size} tokens but vocab_size={config.vocab_size}; "
      f"set vocab_size>={tokenizer.vocab_size}"
    )
  return documents.map(lambda text: row_streams.shift_to_inputs_and_targets(tokenizer.encode(text)))


def _embedded_train_iterator(config, mesh):
  docs = grain.MapDataset.source(embedded_corpus.split_documents("train"))
  if config.enable_data_shuffling:
    docs = docs.shuffle(seed=config.data_shuffle_seed)
  examples = tokenize_documents(docs.repeat(None), config)
  global_shape = (config.global_batch_size_to_load, config.max_target_length)
  rows = process_row_range(sharding.data_sharding(config, mesh), global_shape)
  local = row_streams.RowStreamBatcher(examples, global_shape[0], rows, config.max_target_length)
  return GlobalBatchIterator(local, config, mesh)


def create_data_iterator(config, mesh):
  """The train iterator for config.dataset_type."""
  if config.dataset_type == "synthetic":
    return SyntheticDataIterator(config, mesh)
  if config.dataset_type == "embedded":
    return _embedded_train_iterator(config, mesh)
  raise UserError(f"dataset_type={config.dataset_type} has no input pipeline")
