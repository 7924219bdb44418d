"""Example reward functions for GRPO (reward_functions_path=MaxText/configs/rl/gsm8k_rewards.py), with TRL's signature
f(prompts, completions, **columns) -> list[float]: `columns` holds the records' other columns (here `answer`).

GSM8K's answers end with a line `#### <number>`; a completion is asked to end the same way.
  reward_functions=gsm8k_exact_answer,gsm8k_format reward_weights=[1.0,0.2]
"""

import re

_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def final_number(text: str) -> str | None:
  """The number after the last `####` of a text (commas dropped, a trailing .0 too), or None."""
  found = _FINAL.findall(text)
  if not found:
    return None
  number = found[-1].replace(",", "")
  return number[:-2] if number.endswith(".0") else number


def gsm8k_exact_answer(prompts, completions, answer, **columns):
  """1.0 where the completion's final `#### <number>` equals the record's answer's, else 0.0."""
  del prompts, columns
  return [float(final_number(c) is not None and final_number(c) == final_number(a)) for c, a in zip(completions, answer)]


def gsm8k_format(prompts, completions, **columns):
  """1.0 where the completion ends with a line `#### <number>`, else 0.0."""
  del prompts, columns
  return [float(re.search(r"(^|\n)####\s*-?[\d,]*\.?\d+\s*$", c) is not None) for c in completions]
