"""Keys of base.yml's Data and Eval sections."""

from MaxText.configuration.common_types import DATASET_TYPES
from MaxText.configuration.config_keys import NON_NEGATIVE, POSITIVE, Key, On, Range

_SFT = On("use_sft", True)
_DPO = On("use_dpo", True)

SECTIONS = {
  "Data": {
    "dataset_type": Key(
      "embedded: text shipped with Python, no download; synthetic: random tokens; tfds; grain: ArrayRecord; hf.",
      choices=DATASET_TYPES,
    ),
    "tokenizer_path": Key(
      "SentencePiece model, tiktoken rank file (name with tiktoken) or HF tokenizer.json (or its dir); cwd, then MaxText/."
    ),
    "add_bos": Key("Start every document with the tokenizer's BOS token."),
    "add_eos": Key("End every document with the tokenizer's EOS token."),
    "per_device_batch_size": Key(
      "Rows per device per microbatch; may be fractional (fewer rows than devices).", range=Range(0, low_open=True)
    ),
    "max_target_length": Key("Tokens per row (the sequence length).", range=POSITIVE),
    "packing": Key("Concatenate documents into full rows; false: one document per row, cut to max_target_length."),
    "num_epoch": Key(
      "Passes over the training data; -1 repeats forever. Training stops when the data runs out.",
      range=Range(1, also=(-1,), says="a positive integer, or -1 to repeat forever"),
    ),
    "enable_data_shuffling": Key("Shuffle the training documents (again every epoch)."),
    "data_shuffle_seed": Key(
      "Seed of the shuffle (and of the synthetic tokens).", range=Range(0, 2**32 - 1, says="in [0, 2**32 - 1]")
    ),
    "reuse_example_batch": Key("1 trains on the first batch forever (for speed tests).", choices=(0, 1)),
    "train_data_column": Key("The record field with the text (or token ids when tokenize_train_data=false)."),
    "eval_data_column": Key("The record field of the eval data (see train_data_column)."),
    "tokenize_train_data": Key("false: the column already holds token ids (see MaxText/preprocess_data.py)."),
    "tokenize_eval_data": Key("false: the eval column already holds token ids."),
    # SFT (input_pipeline/sft.py)
    "use_sft": Key("Train on chat records: train_data_columns [messages] or [prompt, completion] (docs/fine_tuning.md)."),
    "sft_train_on_completion_only": Key(
      "The loss covers only the assistant turns and their end-of-turn token (or the completion).", acts_with=_SFT
    ),
    "use_chat_template": Key("Render prompt/completion records and decode.py's prompt as chat turns."),
    "chat_template": Key('A Jinja2 chat template or a file holding one; "": the tokenizer directory\'s own.'),
    "train_data_columns": Key("The record's columns (upstream's list form of train_data_column; set one of the two)."),
    # DPO (dpo.py, input_pipeline/dpo.py)
    "use_dpo": Key(
      "Train on preference pairs: train_data_columns [chosen, rejected] or [prompt, chosen, rejected] (docs/fine_tuning.md)."
    ),
    "dpo_beta": Key(
      "DPO's beta: the strength of the pull towards the reference model.", range=Range(0, low_open=True), acts_with=_DPO
    ),
    "dpo_label_smoothing": Key(
      "The share of pairs assumed mislabelled (conservative DPO, as TRL before 1.0).", range=Range(0, 0.5), acts_with=_DPO
    ),
    # tfds
    "dataset_path": Key("tfds: the data_dir holding prepared TFDS datasets (local or gs://); never downloads."),
    "dataset_name": Key("tfds: name[/config][:version]."),
    "eval_dataset_name": Key("tfds: the eval dataset; empty: dataset_name."),
    "train_split": Key("tfds and hf: the training split."),
    "eval_split": Key("tfds: the eval split."),
    # grain
    "grain_train_files": Key("grain: ';'-separated globs of ArrayRecord files (tf.train.Example or raw UTF-8 records)."),
    "grain_eval_files": Key("grain: the eval files, as grain_train_files."),
    "grain_worker_count": Key(
      "Worker processes that tokenize and pack (grain, embedded, ArrayRecord tfds); 0: in the training process.",
      range=NON_NEGATIVE,
    ),
    # hf: datasets.load_dataset(hf_path, data_dir=hf_data_dir, data_files=hf_train_files, streaming=True)
    "hf_path": Key("hf: the load_dataset path, e.g. parquet, json, arrow, or a hub dataset name."),
    "hf_data_dir": Key("hf: load_dataset's data_dir."),
    "hf_train_files": Key("hf: load_dataset's data_files for training (globs)."),
    "hf_eval_files": Key("hf: load_dataset's data_files for eval (globs)."),
    "hf_eval_split": Key("hf: the eval split of hf_path when hf_eval_files is empty."),
  },
  "Eval": {
    "eval_interval": Key("Evaluate after every this many steps; -1 (or 0) never."),
    "eval_steps": Key(
      "Eval batches per eval; -1: the whole eval split. Every eval starts the eval data from its beginning.",
      range=Range(1, also=(-1,), says="positive, or -1 for the whole eval split"),
    ),
    "eval_per_device_batch_size": Key(
      "Rows per device of an eval batch; 0: per_device_batch_size.", range=Range(0, says=">= 0 (0: per_device_batch_size)")
    ),
    "target_eval_loss": Key(
      "Stop training once the eval loss reaches this; 0: never.", range=Range(0, says=">= 0 (0: no early stop)")
    ),
  },
}
