"""Tiny training data and keys that several slow tests share: a chat tokenizer, chat and preference data, a numerics
statistics YAML, LoRA's keys and a tiny DeepSeek-V3. Frozen: the loss gate's recorded figures depend on them."""

import json

from MaxText.tests.helpers import tiny_args

STATS_YAML = """
all_gemms:
  enabled: true
  layers:
    layer_types: [qkv, attention_out, fc1, fc2]
  collect_tensor_stats:
    enabled: true
    type: [min, max, mean, std, l2_norm, cur_amax]
    tensors: [activation, gradient, weight]
    freq: 1
"""

# The chat and preference data of the SFT and DPO runs, and their tokenizer's training text: copies of sft_test's and
# dpo_test's, frozen (the gate's inputs must not move when those tests change).
CHATML = (
  "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
  "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
  "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = "hello there how are you the cat sat on the mat a dog ran far what is two plus two four yes no maybe"
CONVERSATIONS = [
  [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "how are you"}],
  [
    {"role": "system", "content": "you are a cat"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "yes or no"},
    {"role": "assistant", "content": "maybe the dog ran far"},
  ],
  [
    {"role": "user", "content": "the cat"},
    {"role": "assistant", "content": "sat on the mat"},
    {"role": "user", "content": "a dog"},
    {"role": "assistant", "content": "ran far"},
  ],
]
PAIRS = [
  {"prompt": "what is two plus two", "chosen": "four", "rejected": "the cat sat on the mat"},
  {"prompt": "hello there", "chosen": "how are you", "rejected": "no"},
  {"prompt": "the cat", "chosen": "sat on the mat", "rejected": "ran far"},
  {"prompt": "a dog", "chosen": "ran far", "rejected": "maybe yes"},
]

CHAT_DATA = [
  "dataset_type=hf",
  "hf_path=json",
  "enable_data_shuffling=false",
  "tokenizer_path={tokenizer}",
  "vocab_size=320",
]
# A DPO run on PAIRS ({pairs}) with the chat tokenizer ({tokenizer}).
DPO = [
  "use_dpo=true",
  "dpo_beta=0.1",
  "train_data_columns=['prompt','chosen','rejected']",
  "use_chat_template=true",
  "max_target_length=64",
  *CHAT_DATA,
  "hf_train_files={pairs}",
]
LORA = [
  "enable_lora=true",
  "lora_rank=4",
  "lora_alpha=8",
  "lora_module_path=decoder/layers/(self_attention/(query|key|value|out)|mlp/(wi_0|wi_1|wo))",
]
# deepseek_test's tiny DeepSeek-V3: a dense layer, then 2 MoE layers with grouped routing; latent attention, yarn.
DEEPSEEK = [
  "decoder_block=deepseek",
  "base_num_decoder_layers=3",
  "first_num_dense_layers=1",
  "num_experts=8",
  "num_experts_per_tok=2",
  "n_routing_groups=4",
  "topk_routing_group=2",
  "base_moe_mlp_dim=16",
  "routed_scaling_factor=2.5",
  "q_lora_rank=16",
  "kv_lora_rank=8",
  "qk_nope_head_dim=8",
  "qk_rope_head_dim=4",
  "v_head_dim=6",
  "rope_type=yarn",
  "rope_factor=4",
  "original_max_position_embeddings=16",
]


def build_chat_tokenizer(directory) -> str:
  """sft_test's tokenizer: a byte-level BPE of about 320 tokens with the ChatML template (the same files each time)."""
  import transformers  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel

  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, initial_alphabet=alphabet)
  tok.train_from_iterator([WORDS, "user assistant system"] * 4, trainer)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
  fast.chat_template = CHATML
  fast.save_pretrained(str(directory))
  return str(directory)


def write_jsonl(path, records, repeats: int) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for _ in range(repeats) for r in records), encoding="utf-8")
  return str(path)


def run_args(tmp_path, name: str, steps: int, files: dict, *extra) -> list[str]:
  """A tiny run's train.py args for sharded_runs.py: `steps` steps at learning_rate=1e-2, no warmup, no checkpoints,
  its metrics in tmp_path/<name>.jsonl; extra's {placeholders} filled from `files` (write_data_files)."""
  return tiny_args(
    f"run_name={name.replace('.', '_')}",
    f"base_output_directory={tmp_path}",
    f"metrics_file={tmp_path / name}.jsonl",
    f"steps={steps}",
    "learning_rate=1e-2",
    "warmup_steps_fraction=0",
    "enable_checkpointing=false",
    *[a.format(**files) for a in extra],
  )


def write_data_files(tmp_path) -> dict:
  """{stats_yaml, tokenizer, pairs, chat}: the files the runs' {placeholders} name, written under tmp_path."""
  files = {"stats_yaml": tmp_path / "stats.yml"}
  files["stats_yaml"].write_text(STATS_YAML)
  files["tokenizer"] = build_chat_tokenizer(tmp_path / "chatml")
  files["pairs"] = write_jsonl(tmp_path / "pairs.jsonl", PAIRS, repeats=16)
  files["chat"] = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS], repeats=32)
  return files
