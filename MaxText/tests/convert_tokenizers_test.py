"""Tokenizers travel with a converted checkpoint and encode exactly as their own library does.

Tiny tokenizers are built here (nothing is downloaded): a SentencePiece model (Llama 2 / Mistral / Gemma), a
Llama 3 tiktoken rank file in Meta's `original/tokenizer.model` place, and a Hugging Face tokenizer.json.
"""

import base64
import json
import os

import pytest
import torch  # requirements-test.txt
import transformers

from MaxText import pyconfig
from MaxText.hf_conversion import converter, tokenizer_files
from MaxText.input_pipeline import tokenizer

TEXT = "Hello world! The theory of the thing: 12345 apples, <|eot_id|> then more text.\nA second line."
CORPUS = [
  "the quick brown fox jumps over the lazy dog",
  "hello world, the theory of everything is a thing",
  "numbers 12345 and 67890 appear in text",
] * 20


def _tiny_llama(directory) -> str:
  config = transformers.AutoConfig.for_model(
    "llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=128,
  )
  torch.manual_seed(0)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
  return str(directory)


def _convert(hf_dir: str, out_dir: str):
  """Converts; returns the tokenizer that model.yml's tokenizer_path names (resolved as train.py resolves it)."""
  model_yml = converter.to_maxtext(hf_dir, out_dir)
  config = pyconfig.initialize(["test", model_yml, "run_name=t", "dataset_type=embedded"], environ={})
  assert os.path.dirname(config.tokenizer_path) == os.path.abspath(out_dir)
  return config.tokenizer_path


def test_sentencepiece(tmp_path):
  sentencepiece = pytest.importorskip("sentencepiece")
  hf_dir = _tiny_llama(tmp_path / "hf")
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(CORPUS))
  sentencepiece.SentencePieceTrainer.train(
    input=str(corpus), model_prefix=os.path.join(hf_dir, "tokenizer"), vocab_size=60, model_type="bpe"
  )
  path = _convert(hf_dir, str(tmp_path / "out"))
  assert os.path.basename(path) == "tokenizer.model"
  reference = sentencepiece.SentencePieceProcessor(model_file=os.path.join(hf_dir, "tokenizer.model"))
  ours = tokenizer.build_tokenizer(path, add_bos=True, add_eos=False)
  assert ours.encode(TEXT) == [reference.bos_id()] + reference.encode(TEXT)
  assert ours.decode(ours.encode(TEXT)[1:]) == reference.decode(reference.encode(TEXT))


def _llama3_ranks() -> dict[bytes, int]:
  ranks = {bytes([i]): i for i in range(256)}
  for merge in (b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"or", b"ld", b"wor", b"world"):
    ranks.setdefault(merge, len(ranks))
  return ranks


def test_llama3_tiktoken_with_special_tokens(tmp_path):
  tiktoken = pytest.importorskip("tiktoken")
  hf_dir = _tiny_llama(tmp_path / "hf")
  ranks = _llama3_ranks()
  os.makedirs(os.path.join(hf_dir, "original"))
  with open(os.path.join(hf_dir, "original", "tokenizer.model"), "wb") as f:
    for token, rank in ranks.items():
      f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
  named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "<|eot_id|>"}
  added = {str(len(ranks) + i): {"content": name, "special": True} for i, name in named.items()}
  with open(os.path.join(hf_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"added_tokens_decoder": added, "bos_token": "<|begin_of_text|>"}, f)
  path = _convert(hf_dir, str(tmp_path / "out"))
  assert os.path.basename(path) == tokenizer_files.TIKTOKEN_FILE
  ours = tokenizer.build_tokenizer(path, add_bos=True, add_eos=True)
  specials = {name: len(ranks) + i for i, name in enumerate(tokenizer._llama3_special_tokens(path, len(ranks)))}  # pylint: disable=protected-access
  assert specials["<|eot_id|>"] == len(ranks) + 9 and specials["<|begin_of_text|>"] == len(ranks)
  reference = tiktoken.Encoding(
    "reference",
    pat_str=tokenizer._LLAMA3_PATTERN,
    mergeable_ranks=ranks,
    special_tokens=specials,  # pylint: disable=protected-access
  )
  expected = reference.encode(TEXT, allowed_special="all")
  assert len(ranks) + 9 in expected  # <|eot_id|> is one special token, not text
  assert ours.encode(TEXT) == [specials["<|begin_of_text|>"]] + expected + [specials["<|end_of_text|>"]]
  assert ours.decode(expected) == TEXT


def test_tokenizer_json(tmp_path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel

  hf_dir = _tiny_llama(tmp_path / "hf")
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
  bpe.save(os.path.join(hf_dir, "tokenizer.json"))
  with open(os.path.join(hf_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)
  path = _convert(hf_dir, str(tmp_path / "out"))
  assert os.path.basename(path) == "tokenizer.json"
  ours = tokenizer.build_tokenizer(path, add_bos=True, add_eos=True)
  reference = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
  bos, eos = reference.token_to_id("<s>"), reference.token_to_id("</s>")
  assert ours.encode(TEXT) == [bos] + reference.encode(TEXT, add_special_tokens=False).ids + [eos]
  # transformers' own tokenizer reads the converted directory alike.
  auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  assert auto(TEXT, add_special_tokens=False)["input_ids"] == ours.encode(TEXT)[1:-1]
