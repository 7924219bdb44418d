"""GRPO's rollouts, on the host: a batch of prompt rows (input_pipeline/grpo_prompts.py) -> num_generations
completions of each prompt sampled with the current params (generation/row_sampler.py, on the training mesh) ->
their rewards (grpo_rewards.py) -> group advantages -> the batch that the train step trains on.

A train row holds one prompt and one completion: inputs and targets over prompt + completion (its end token
included), targets_segmentation 1 on the completion's targets only. The rows of a prompt's group are consecutive.
Besides the usual keys a batch holds
  advantages (B,) float32: group_advantages of the rewards;
  old_logps (B, T) float32, with num_iterations > 1: the sampled tokens' log-probs under the params that sampled;
  rewards (B,), reward_std (B,) (the std of the row's group) and function_rewards (B, F), for the step's metrics.
"""

import os
import time

import jax
import numpy as np

from MaxText import max_logging
from MaxText.configuration import rl_config
from MaxText.features import grpo_rewards
from MaxText.generation import prefill_decode, row_sampler
from MaxText.input_pipeline import grpo_prompts
from MaxText.input_pipeline.chat_template import ChatRenderer
from MaxText.input_pipeline.packing import BATCH_KEYS
from MaxText.input_pipeline.tokenizer import build_tokenizer

ADVANTAGES, OLD_LOGPS = "advantages", "old_logps"  # the batch keys GRPO's objective reads
REWARDS, REWARD_STD, FUNCTION_REWARDS = "rewards", "reward_std", "function_rewards"  # its metrics' columns
ADVANTAGE_EPS = 1e-4  # TRL's: (r - mean) / (std + eps)
SAMPLES_FILE = "completions.txt"  # under the run's directory, every grpo_samples_interval steps
SAMPLES_SHOWN = 4  # rows of the first group written each time


def group_advantages(rewards, num_generations: int) -> np.ndarray:
  """(B,) rewards, num_generations consecutive rows per prompt -> (B,) float32 advantages: (r - the group's mean) /
  (the group's std with Bessel's correction + 1e-4). Equal rewards in a group give advantages 0."""
  groups = np.asarray(rewards, np.float32).reshape(-1, num_generations)
  mean = groups.mean(axis=1, keepdims=True)
  std = groups.std(axis=1, ddof=1, keepdims=True)
  return ((groups - mean) / (std + np.float32(ADVANTAGE_EPS))).reshape(-1).astype(np.float32)


def batch_shapes(config) -> dict:
  """{key: (shape, dtype)} of a GRPO train batch (what the rollouts slot holds)."""
  rows, length = config.global_batch_size_to_load, config.max_target_length
  shapes = {key: ((rows, length), np.int32) for key in BATCH_KEYS}
  shapes |= {ADVANTAGES: ((rows,), np.float32), REWARDS: ((rows,), np.float32), REWARD_STD: ((rows,), np.float32)}
  shapes[FUNCTION_REWARDS] = ((rows, len(rl_config.reward_function_names(config.get_keys()))), np.float32)
  if config.num_iterations > 1:
    shapes[OLD_LOGPS] = ((rows, length), np.float32)
  return shapes


def train_rows(prompts, samples: row_sampler.Samples, config) -> dict:
  """The train rows of prompt + completion (numpy), with the sampled log-probs at the completions' targets."""
  out = {key: np.zeros(shape, dtype) for key, (shape, dtype) in batch_shapes(config).items()}
  logps = np.zeros_like(out["targets"], np.float32)
  for i, prompt in enumerate(prompts):
    if not prompt:  # padding: the data ran out
      continue
    completion = samples.tokens[i, : samples.lengths[i]]
    sequence = np.concatenate([np.asarray(prompt, np.int32), completion])
    n, start = len(sequence) - 1, len(prompt) - 1  # the first completion token is the target at the prompt's last
    out["inputs"][i, :n], out["targets"][i, :n] = sequence[:-1], sequence[1:]
    out["inputs_position"][i, :n] = out["targets_position"][i, :n] = np.arange(n)
    out["inputs_segmentation"][i, :n] = 1
    out["targets_segmentation"][i, start:n] = 1
    logps[i, start:n] = samples.logps[i, : samples.lengths[i]]
  if OLD_LOGPS in out:
    out[OLD_LOGPS] = logps
  return out


class Rollouts:
  """Generates and scores GRPO's completions with the run's model on its mesh (compiled once, at the first round)."""

  def __init__(self, config, model, mesh):
    self.config = config
    self.tokenizer = build_tokenizer(config.tokenizer_path, config.add_bos, False)
    end_ids = set(prefill_decode.end_token_ids(self.tokenizer))
    if config.use_chat_template:  # a chat completion ends at the template's end of turn (ChatML's <|im_end|>)
      end_ids |= set(ChatRenderer(config.tokenizer_path, config.chat_template).end_of_turn_ids())
    self.end_ids = tuple(sorted(end_ids))
    valid_vocab = min(self.tokenizer.vocab_size, config.vocab_size)
    self.sampler = row_sampler.RowSampler(config, model, mesh, self.end_ids, valid_vocab)
    self.rewards = grpo_rewards.RewardFunctions(
      config.reward_functions_path,
      rl_config.reward_function_names(config.get_keys()),
      config.reward_weights,
    )

  def batch(self, params, prompt_batch: dict, rng, step: int) -> dict:
    """The train batch (numpy) of step `step`'s round from a host batch of prompt rows."""
    config, generations = self.config, self.config.num_generations
    started = time.perf_counter()
    prompts, columns = grpo_prompts.prompt_rows(prompt_batch)
    prompts = [p for p in prompts for _ in range(generations)]  # a group's rows are consecutive
    columns = [c for c in columns for _ in range(generations)]
    tokens = np.zeros((len(prompts), config.max_prefill_predict_length), np.int32)
    lengths = np.asarray([max(len(p), 1) for p in prompts], np.int32)  # padding rows sample after one token 0
    for i, prompt in enumerate(prompts):
      tokens[i, : len(prompt)] = prompt
    samples = self.sampler.sample(params, tokens, lengths, rng)
    generated = time.perf_counter() - started
    out = train_rows(prompts, samples, config)
    real = [i for i, p in enumerate(prompts) if p]
    if real:
      completion_ids = [prefill_decode.completion(samples.tokens[i, : samples.lengths[i]], self.end_ids) for i in real]
      texts = [self.tokenizer.decode(ids) for ids in completion_ids]
      prompt_texts = [self.tokenizer.decode(prompts[i]) for i in real]
      names = sorted({name for i in real for name in columns[i]})
      by_column = {name: [columns[i].get(name) for i in real] for name in names} | {"completion_ids": completion_ids}
      scores = self.rewards.score(prompt_texts, texts, by_column)
      out[REWARDS][real] = scores.total
      out[FUNCTION_REWARDS][real] = np.stack(list(scores.per_function.values()), axis=1)
      self._write_samples(step, prompt_texts, texts, scores.total)
    groups = out[REWARDS].reshape(-1, generations)
    out[REWARD_STD] = np.repeat(groups.std(axis=1, ddof=1), generations).astype(np.float32)
    out[ADVANTAGES] = group_advantages(out[REWARDS], generations)
    out[ADVANTAGES][[i for i, p in enumerate(prompts) if not p]] = 0.0
    length, reward = (samples.lengths[real].mean(), out[REWARDS][real].mean()) if real else (0.0, 0.0)
    max_logging.log(
      f"GRPO step {step}: {len(real)} completions of {len(real) // generations} prompts, {length:.1f} tokens on "
      f"average, generated in {generated:.3f} s and scored in {time.perf_counter() - started - generated:.3f} s; "
      f"mean reward {reward:.4f}"
    )
    return out

  def _write_samples(self, step: int, prompts, completions, rewards) -> None:
    """Every grpo_samples_interval steps (at the round that covers it): the first group's completions, appended to
    <run_dir>/completions.txt by process 0."""
    interval, config = self.config.grpo_samples_interval, self.config
    if interval <= 0 or step % interval >= config.num_iterations or jax.process_index() != 0 or not config.run_dir:
      return
    os.makedirs(config.run_dir, exist_ok=True)
    with open(os.path.join(config.run_dir, SAMPLES_FILE), "a", encoding="utf-8") as f:
      f.write(f"=== step {step}: prompt\n{prompts[0]}\n")
      for i in range(min(SAMPLES_SHOWN, config.num_generations, len(completions))):
        f.write(f"--- completion {i} (reward {rewards[i]:.4f})\n{completions[i]}\n")
