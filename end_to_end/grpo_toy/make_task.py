"""Writes a toy task with a checkable answer for GRPO's worked run (docs/fine_tuning.md), with no download:

    python3 end_to_end/grpo_toy/make_task.py OUT

OUT gets tokenizer/ (a byte-level BPE of 320 tokens with a ChatML template, as Hugging Face saves one), sft.jsonl
(chats that answer each prompt right one time in three), prompts.jsonl (each prompt with its `answer` column) and
rewards.py (`exact`: 1 where the completion is the answer).
"""

import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Each prompt has one right word; the SFT data gives it once and each wrong one once.
TASK = [
  ("what is two plus two", "four", ("two", "maybe")),
  ("the cat sat on the", "mat", ("dog", "far")),
  ("how are", "you", ("no", "there")),
  ("a dog ran", "far", ("yes", "cat")),
]
CHATML = (
  "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = "hello there how are you the cat sat on the mat a dog ran far what is two plus two four yes no maybe"
REWARDS = '''"""The toy task's reward: 1 where the completion, stripped, is the record's answer."""


def exact(prompts, completions, answer, **columns):
  return [float(c.strip() == a) for c, a in zip(completions, answer)]
'''


def write_tokenizer(directory: str) -> None:
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator([WORDS, "user assistant system"] * 4, trainer)
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHATML}
  with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)


def write_jsonl(path: str, records: list[dict], repeats: int) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for _ in range(repeats):
      for record in records:
        f.write(json.dumps(record) + "\n")


def main(out: str) -> None:
  write_tokenizer(os.path.join(out, "tokenizer"))
  chats = [
    {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": [a, *wrong][k]}]}
    for k in range(3)
    for p, a, wrong in TASK
  ]
  write_jsonl(os.path.join(out, "sft.jsonl"), chats, repeats=16)
  write_jsonl(os.path.join(out, "prompts.jsonl"), [{"prompt": p, "answer": a} for p, a, _ in TASK], repeats=64)
  with open(os.path.join(out, "rewards.py"), "w", encoding="utf-8") as f:
    f.write(REWARDS)
  print(f"Wrote the toy task to {out}: tokenizer/, sft.jsonl, prompts.jsonl, rewards.py")


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit("usage: python3 end_to_end/grpo_toy/make_task.py OUT")
  main(sys.argv[1])
