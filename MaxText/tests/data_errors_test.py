"""Bad data of the hf pipeline and bad SFT/DPO samples: one line (a UserError) naming the file or the record.

Data files are read lazily, in the data iterator's thread, so a malformed line may surface at load time (datasets
reads the first records to find the columns) or at any later batch, of the train or the eval data.
"""

import json

import pytest

from MaxText.errors import UserError
from MaxText.input_pipeline import hf_source, input_pipeline_interface
from MaxText.input_pipeline.dpo import DpoDecoder
from MaxText.input_pipeline.sft import SftDecoder
from MaxText.runtime import mesh
from MaxText.tests.helpers import build_chat_tokenizer, run_train, sft_decoder_config, tiny_config

CHAT = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "how are you"}]
BAD_LINE = '{"messages": [ oops'
# Renders every conversation as "": jinja2's undefined (the content has no character 1000) renders empty.
EMPTY_TEMPLATE = "{% for m in messages %}{{ m['content'][1000] }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  return build_chat_tokenizer(tmp_path_factory.mktemp("tok"))


def _write(path, lines) -> str:
  path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
  return str(path)


def _chat_file(path, n: int = 2) -> str:
  return _write(path, [json.dumps({"messages": CHAT})] * n)


def _hf_flags(tokenizer, train_files: str, *extra) -> list[str]:
  return [
    "use_sft=true",
    "train_data_columns=['messages']",
    f"tokenizer_path={tokenizer}",
    "vocab_size=320",
    "max_target_length=64",
    "dataset_type=hf",
    "hf_path=json",
    f"hf_train_files={train_files}",
    *extra,
  ]


def _bad_line_message(key: str, path: str) -> str:
  return f"{key}: {path} is not valid JSON lines: line 2: Expecting value at column 16 ({BAD_LINE})"


@pytest.mark.parametrize("train", [True, False])
def test_a_malformed_json_line_met_while_streaming_is_one_line(tokenizer, tmp_path, train):
  """The bad file comes after a good one: datasets raises ArrowInvalid (no file name) in the data thread."""
  good = _chat_file(tmp_path / "good.jsonl")
  bad = _write(tmp_path / "bad.jsonl", [json.dumps({"messages": CHAT}), BAD_LINE])
  files = f"{good};{bad}"
  extra = [] if train else [f"hf_eval_files={files}", "eval_interval=1"]
  config = tiny_config(*_hf_flags(tokenizer, files if train else good, "enable_data_shuffling=false", *extra))
  create = input_pipeline_interface.create_data_iterator if train else input_pipeline_interface.create_eval_iterator
  iterator = create(config, mesh.create_device_mesh(config))
  try:
    with pytest.raises(UserError) as error:
      for _ in range(20):
        next(iterator)
  finally:
    iterator.close()
  assert str(error.value) == _bad_line_message("hf_train_files" if train else "hf_eval_files", bad)


@pytest.mark.parametrize("train", [True, False])
def test_an_empty_data_file_is_one_line(tokenizer, tmp_path, train):
  good = _chat_file(tmp_path / "good.jsonl")
  empty = _write(tmp_path / "empty.jsonl", [])
  extra = [] if train else [f"hf_eval_files={empty}", "eval_interval=1"]
  config = tiny_config(*_hf_flags(tokenizer, empty if train else good, *extra))
  with pytest.raises(UserError) as error:
    hf_source.load(config, train)
  assert str(error.value) == f"{'hf_train_files' if train else 'hf_eval_files'}: {empty} has no records"


@pytest.mark.parametrize(
  "columns,record",
  [
    (["messages"], {"messages": CHAT}),
    (["prompt", "completion"], {"prompt": "hello there", "completion": "how are you"}),
  ],
)
@pytest.mark.parametrize("completion_only", [False, True])
def test_a_chat_template_that_renders_nothing_names_the_record(tokenizer, columns, record, completion_only):
  """An error, not a dropped sample: it is the template's fault, and would be every sample's."""
  config = sft_decoder_config(
    tokenizer,
    train_data_columns=columns,
    chat_template=EMPTY_TEMPLATE,
    use_chat_template=True,
    sft_train_on_completion_only=completion_only,
  )
  with pytest.raises(UserError, match=r"^the chat template renders train record 0 \(\{.*\) as no text; check chat_t"):
    SftDecoder(config)(record)


def test_a_sample_without_tokens_is_dropped(tokenizer):
  """Empty prompt and completion without a template or BOS/EOS: no tokens, dropped like a sample without loss."""
  config = sft_decoder_config(
    tokenizer, train_data_columns=["prompt", "completion"], sft_train_on_completion_only=False, add_bos=False, add_eos=False
  )
  decoder = SftDecoder(config)
  sample = decoder({"prompt": "", "completion": ""})
  assert decoder.counts["dropped"] == 1 and len(sample["inputs"]) == 0 and len(sample["loss_mask"]) == 0


def test_dpo_chat_template_that_renders_nothing_names_the_record(tokenizer):
  config = sft_decoder_config(
    tokenizer, train_data_columns=["prompt", "chosen", "rejected"], chat_template=EMPTY_TEMPLATE, use_chat_template=True
  )
  with pytest.raises(UserError, match=r"^the chat template renders train record 0 \(\{.*\) as no text"):
    DpoDecoder(config)({"prompt": "hello there", "chosen": "how are you", "rejected": "no"})


def test_train_py_prints_a_malformed_eval_file_as_one_line(tokenizer, tmp_path):
  """The eval data's error, raised in its data thread after training started, reaches train.py's top level."""
  good = _chat_file(tmp_path / "good.jsonl", 1)
  bad = _write(tmp_path / "bad.jsonl", [json.dumps({"messages": CHAT}), BAD_LINE])
  flags = _hf_flags(tokenizer, good, f"hf_eval_files={good};{bad}", "eval_interval=1", "enable_checkpointing=false")
  result, _ = run_train(tmp_path, "bad_eval", "steps=1", *flags)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == "Error: " + _bad_line_message("hf_eval_files", bad)
