"""Supervised fine-tuning on chat data: the chat template against transformers' apply_chat_template, the
completion-only mask, the step-0 loss against a converted Hugging Face llama, bad input, and a short run.

A tiny byte-level BPE tokenizer with a ChatML template (helpers.build_chat_tokenizer) and a tiny llama
(tiny_models.hf_llama) are built, nothing downloaded.
"""

import json
import os
import types

import numpy as np
import pytest
import torch  # requirements-test.txt
import transformers

from MaxText.errors import ConfigError, UserError
from MaxText.features import selection
from MaxText.input_pipeline import sft
from MaxText.input_pipeline.chat_template import ChatRenderer
from MaxText.input_pipeline.packing import PackedStream, RandomAccessCursor
from MaxText.input_pipeline.sft import SftDecoder
from MaxText.tests.helpers import (
  CHATML,
  CONVERSATIONS,
  build_chat_tokenizer,
  chat_sft_losses,
  sft_decoder_config,
  tiny_config,
)
from MaxText.tests.tiny_models import hf_llama

# Llama 3's shape: a BOS variable, headers, an end-of-turn token with nothing after it.
LLAMA3_LIKE = (
  "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' }}"
  "{{ m['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
END_OF_TURN = {CHATML: "<|im_end|>", LLAMA3_LIKE: "<|eot_id|>"}


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("tok")
  return {t: build_chat_tokenizer(root / name, t) for name, t in (("chatml", CHATML), ("llama3", LLAMA3_LIKE))}


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_token_ids_equal_transformers_apply_chat_template(tokenizers_dir, template):
  path = tokenizers_dir[CHATML if template == "chatml" else LLAMA3_LIKE]
  hf = transformers.AutoTokenizer.from_pretrained(path)
  ours = ChatRenderer(path)
  for messages in CONVERSATIONS:
    for generation_prompt in (False, True):
      expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)["input_ids"]
      assert ours.encode(ours.render(messages, generation_prompt)) == expected
    assert ours.encode_with_mask(messages)[0] == hf.apply_chat_template(messages, tokenize=True)["input_ids"]
  prompt = ours.encode_prompt("hello there")
  assert (
    prompt == hf.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True)["input_ids"]
  )


@pytest.mark.parametrize("template", [CHATML, LLAMA3_LIKE])
def test_completion_only_mask_is_the_assistant_contents_and_end_of_turn(tokenizers_dir, template):
  renderer = ChatRenderer(tokenizers_dir[template])
  end = renderer.encode(END_OF_TURN[template])
  for messages in CONVERSATIONS:
    ids, mask = renderer.encode_with_mask(messages)
    masked = [i for i, m in zip(ids, mask) if m]
    expected = [t for m in messages if m["role"] == "assistant" for t in renderer.encode(m["content"]) + end]
    assert masked == expected


def test_packing_keeps_conversations_whole_and_masks_the_prompt(tokenizers_dir):
  decode = SftDecoder(sft_decoder_config(tokenizers_dir[CHATML]))
  documents = [decode({"messages": m}) for m in CONVERSATIONS * 2]
  stream = PackedStream(RandomAccessCursor(documents), seq_len=64)
  lengths = sorted(len(d["inputs"]) for d in documents)
  seen = []
  for _ in range(len(documents)):
    try:
      row = stream.next_row()
    except StopIteration:
      break
    for segment in set(row["inputs_segmentation"]) - {0}:
      in_segment = row["inputs_segmentation"] == segment
      seen.append(int(in_segment.sum()))
      assert row["inputs_position"][in_segment][0] == 0
      loss = row["targets_segmentation"][in_segment] != 0
      assert 0 < loss.sum() < in_segment.sum()  # the prompt carries no loss
  assert sorted(seen) == lengths  # every conversation whole, in one row


def test_a_conversation_longer_than_a_row_is_truncated_and_one_left_without_loss_dropped(tokenizers_dir):
  decode = SftDecoder(sft_decoder_config(tokenizers_dir[CHATML], max_target_length=20))  # the prompt is 13 tokens
  long_answer = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat sat on the mat " * 4}]
  document = decode({"messages": long_answer})
  assert len(document["inputs"]) == 20 and document["loss_mask"].any()
  long_prompt = [{"role": "user", "content": "the cat sat on the mat " * 4}, {"role": "assistant", "content": "yes"}]
  assert len(decode({"messages": long_prompt})["inputs"]) == 0
  assert decode.counts == {"read": 2, "truncated": 2, "dropped": 1}


def test_samples_that_are_all_dropped_stop_the_run_with_one_line(tokenizers_dir):
  decode = SftDecoder(sft_decoder_config(tokenizers_dir[CHATML], max_target_length=20))
  long_prompt = [{"role": "user", "content": "the cat sat on the mat " * 4}, {"role": "assistant", "content": "y"}]
  sample, kept = {"messages": long_prompt}, {"messages": [{"role": "user", "content": "hi"}, long_prompt[1]]}
  for _ in range(sft.MAX_DROPPED_IN_A_ROW - 1):
    decode(sample)
  decode(kept)  # one sample with a loss token starts the count again
  for _ in range(sft.MAX_DROPPED_IN_A_ROW - 1):
    decode(sample)
  with pytest.raises(UserError, match=r"the last 1,000 train samples were all dropped: none has a loss token left"):
    decode(sample)


def test_prompt_completion_columns(tokenizers_dir):
  path = tokenizers_dir[CHATML]
  record = {"prompt": "what is two plus two", "completion": "four"}
  renderer = ChatRenderer(path)
  for use_chat_template in (True, False):
    config = sft_decoder_config(path, train_data_columns=["prompt", "completion"], use_chat_template=use_chat_template)
    document = SftDecoder(config)(record)
    targets = document["targets"][document["loss_mask"] == 1].tolist()
    assert targets == renderer.encode("four") + renderer.encode("<|im_end|>" if use_chat_template else "</s>")


@pytest.mark.parametrize(
  "record, columns, template, says",
  [
    ({"messages": [{"role": "user", "content": "hi"}]}, ["messages"], "", "train record 0 ({'messages'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, ["messages"], "", "has no assistant turn"),
    ({"text": "hi", "id": 1}, ["messages"], "", "no column 'messages' (they have: id, text)"),
    ({"prompt": "hi"}, ["prompt", "completion"], "", "no column 'completion' (they have: prompt)"),
    (
      {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
      ["messages"],
      "",
      "the chat template fails to render train record 0 ({'messages': [{'role': 'tool'",
    ),
    (
      {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
      ["messages"],
      "",
      "TemplateError: unknown role tool",
    ),
    (
      {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
      ["messages"],
      "{{ messages[0].content.nope() }}",
      "the chat template fails to render train record 0",
    ),
    # A null is no text to learn (it would render as "None").
    ({"prompt": "hi", "completion": None}, ["prompt", "completion"], "", "column 'completion' holds None, not text"),
    (
      {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
      ["messages"],
      "",
      "message 1 (assistant) has no text content (None)",
    ),
  ],
)
def test_bad_input_is_one_line(tokenizers_dir, record, columns, template, says):
  config = sft_decoder_config(tokenizers_dir[CHATML], train_data_columns=columns, chat_template=template)
  with pytest.raises(UserError) as e:
    SftDecoder(config)(record)
  assert says in str(e.value) and "\n" not in str(e.value)


def test_train_data_column_and_columns_together_is_a_config_error():
  with pytest.raises(ConfigError, match="train_data_column=prompt and train_data_columns=.* are both set"):
    tiny_config("train_data_column=prompt", "train_data_columns=['prompt','completion']")


# SFT numerics: a tiny random llama converted from transformers; our step-0 completion-only loss on packed chat
# rows equals transformers' cross-entropy with labels -100 on the tokens outside the assistant turns.
def _hf_completion_loss(model, renderer) -> float:
  """Transformers' mean cross-entropy over the assistant tokens of all conversations (labels -100 elsewhere)."""
  total, count = 0.0, 0
  for messages in CONVERSATIONS:
    ids, mask = renderer.encode_with_mask(messages)
    labels = torch.tensor([i if m else -100 for i, m in zip(ids, mask)])[None]
    n = int((labels[0, 1:] != -100).sum())  # transformers shifts the labels inside
    with torch.no_grad():
      total += float(model(torch.tensor(ids)[None], labels=labels).loss) * n
    count += n
  return total / count


def test_step0_sft_loss_equals_transformers_masked_cross_entropy(tokenizers_dir, tmp_path):
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.hf_conversion import converter, logit_check  # pylint: disable=import-outside-toplevel
  from MaxText.training import train_step  # pylint: disable=import-outside-toplevel

  hf_dir = hf_llama(tmp_path / "hf")
  converter.to_maxtext(hf_dir, str(tmp_path / "maxtext"))
  renderer = ChatRenderer(tokenizers_dir[CHATML])
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
  expected = _hf_completion_loss(hf_model, renderer)

  length = 96
  decode = SftDecoder(sft_decoder_config(tokenizers_dir[CHATML], max_target_length=length))
  stream = PackedStream(RandomAccessCursor([decode({"messages": m}) for m in CONVERSATIONS]), seq_len=length)
  rows = []
  while True:
    try:
      rows.append(stream.next_row())
    except StopIteration:
      break
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  assert batch["inputs_segmentation"].max() > 1  # conversations packed together: attention must stay inside each
  config, model, params = logit_check.converted_model(
    os.path.join(tmp_path / "maxtext", converter.MODEL_YML), os.path.join(tmp_path / "maxtext", converter.PARAMS_DIR), length
  )
  with jax.default_matmul_precision("float32"):
    loss, aux = train_step.loss_fn(
      model, config, selection.for_config(config), params, batch, jax.random.PRNGKey(0), train=True
    )
  ours = float(loss / aux.weights)
  print(f"\nSFT step-0 loss: ours {ours:.6f}, transformers {expected:.6f}, relative {abs(ours - expected) / expected:.2e}")
  assert ours == pytest.approx(expected, rel=1e-4)


def test_sft_training_run_loss_falls(tokenizers_dir, tmp_path):
  """30 steps of train.py on a small jsonl chat set with the hf dataset type: the completion-only loss falls."""
  losses = chat_sft_losses(tmp_path, "sft", tokenizers_dir[CHATML])
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses


def test_grain_array_record_of_json_chat_records(tokenizers_dir, tmp_path):
  """dataset_type=grain: ArrayRecord records that are JSON objects; packed rows mask everything but the answers."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=import-outside-toplevel

  from MaxText.input_pipeline.input_pipeline_interface import RandomAccessRows  # pylint: disable=import-outside-toplevel

  path = str(tmp_path / "chat.array_record")
  writer = ArrayRecordWriter(path, "group_size:1")
  for messages in CONVERSATIONS:
    writer.write(json.dumps({"messages": messages}).encode())
  writer.close()
  config = tiny_config(
    "dataset_type=grain",
    f"grain_train_files={path}",
    "use_sft=true",
    "sft_train_on_completion_only=true",
    "train_data_columns=['messages']",
    f"tokenizer_path={tokenizers_dir[CHATML]}",
    "vocab_size=320",
    "max_target_length=96",
    "enable_data_shuffling=false",
  )
  batch = next(RandomAccessRows(config, True, 1)([0]))
  renderer = ChatRenderer(tokenizers_dir[CHATML])
  expected = [t for m in CONVERSATIONS for t in renderer.encode_with_mask(m)[0][1:]]  # conversations whole, in order
  real = batch["inputs_segmentation"][0] != 0
  assert batch["targets"][0][real].tolist() == expected[: int(real.sum())]
  loss = batch["targets_segmentation"][0] != 0
  answers = [t for m in CONVERSATIONS for t, k in zip(*renderer.encode_with_mask(m)) if k]
  assert batch["targets"][0][loss].tolist() == answers[: int(loss.sum())] and loss.sum() > 0


@pytest.mark.parametrize("template", [CHATML, LLAMA3_LIKE], ids=["chatml", "llama3"])
def test_decode_formats_the_prompt_as_a_user_turn_and_ends_at_the_end_of_turn(tokenizers_dir, template):
  from MaxText import decode  # pylint: disable=import-outside-toplevel

  path = tokenizers_dir[template]
  config = types.SimpleNamespace(
    use_chat_template=True, tokenizer_path=path, config_path="", chat_template="", prompt="what is two plus two"
  )
  hf = transformers.AutoTokenizer.from_pretrained(path)
  messages = [{"role": "user", "content": "what is two plus two"}]
  expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
  prompt, end_of_turn = decode._prompt_ids(config, None)  # pylint: disable=protected-access
  assert prompt == expected
  assert end_of_turn == [hf.convert_tokens_to_ids(END_OF_TURN[template])]  # not the tokenizer's EOS (</s>)


def test_sft_yml_is_a_starting_point():
  from MaxText import pyconfig  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import REPO_ROOT  # pylint: disable=import-outside-toplevel

  argv = ["t", os.path.join(REPO_ROOT, "MaxText/configs/sft.yml"), "run_name=t"]
  with pytest.raises(ConfigError, match="hf_path=json needs hf_train_files"):  # the user names the chat data
    pyconfig.initialize(argv, environ={})
  config = pyconfig.initialize([*argv, "hf_train_files=/data/chat/*.jsonl"], environ={})
  assert config.use_sft and config.sft_train_on_completion_only and config.train_data_columns == ["messages"]
  assert pyconfig.initialize(argv, environ={}, reads_data=False).use_chat_template  # decode.py reads no data
