"""Sampling completions of a batch of prompts, one prompt per row, as reinforcement learning needs it (GRPO): the
prefill and the decode step compiled once for the run's shapes and reused on every call with new params and prompts;
each row stops at its first end token (EOS, end of turn); the log-prob of every sampled token is returned with it.

It runs prefill_decode.py's prefill and decode step: the same model, KV cache and sampling (the config's
decode_sampling_* keys). Rows of different prompt lengths share the cache: each row's tokens sit at their own
positions, and the causal mask over positions keeps a row from attending to its prompt's padding.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.generation import prefill_decode
from MaxText.runtime import sharding


@dataclasses.dataclass
class Samples:
  """What RowSampler.sample returns.

  Attributes:
    tokens: (B, N) int32 sampled tokens of each row, 0 after the row's end (N = max_target_length -
      max_prefill_predict_length).
    logps: (B, N) float32 log-probs of the sampled tokens under softmax(logits / decode_sampling_temperature) over the
      whole vocabulary (what training computes), 0 after the row's end.
    lengths: (B,) int32 tokens of each completion, its end token included.
  """

  tokens: np.ndarray
  logps: np.ndarray
  lengths: np.ndarray


def _logp(logits, token, temperature):
  """(B,) log-probs of the sampled tokens (B,) under softmax(logits (B, V) / temperature), on every process."""
  logps = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  return prefill_decode.on_every_process(jnp.take_along_axis(logps, token[:, None], axis=-1)[:, 0])


def _prefill(model, pick, temperature, params, tokens, true_length, rng):
  cache, last, token = prefill_decode.prefill(model, pick, params, tokens, true_length, rng)
  return cache, token, _logp(last, token, temperature)


def _step(model, pick, temperature, params, cache, tokens, positions, step, rng):
  cache, logits, token, positions, step = prefill_decode.decode_step(
    model, pick, params, cache, tokens, positions, step, rng
  )
  return cache, token, _logp(logits, token, temperature), positions, step


class RowSampler:
  """Samples a completion for each row's prompt, with the prefill and the decode step jitted once for the run.

  Args:
    config: the Config: its sampling keys, max_prefill_predict_length (the padded prompt) and max_target_length.
    model: the Transformer (training_setup.build's).
    mesh: the device mesh; rows are sharded as the train batch's.
    end_ids: token ids that end a row (prefill_decode.end_token_ids).
    valid_vocab: sample only ids below it (the tokenizer's vocabulary); default: all of vocab_size.
  """

  def __init__(self, config, model, mesh, end_ids=(), valid_vocab: int | None = None):
    self.config, self.mesh = config, mesh
    self.end_ids = np.asarray(end_ids, np.int32)
    pick = prefill_decode.sampler(config, valid_vocab or config.vocab_size)
    temperature = config.decode_sampling_temperature
    self._prefill = jax.jit(functools.partial(_prefill, model, pick, temperature))
    self._step = jax.jit(functools.partial(_step, model, pick, temperature), donate_argnums=(1,))
    # Compiled at the first call, for the run's shapes and shardings, and reused: a jitted function would compile the
    # step again for the cache and positions that the step itself returns (committed to their devices).
    self.prefill = self.step = None
    self.rows_sharding = NamedSharding(mesh, PartitionSpec(*config.data_sharding))

  def sample(self, params, prompts: np.ndarray, prompt_lengths: np.ndarray, rng) -> Samples:
    """Completions of `prompts` (B, max_prefill_predict_length), right-padded, of prompt_lengths (B,) tokens each.

    Sampling draws from fold_in(rng, i) at the i-th token. Stops once every row has produced an end token.
    """
    budget = self.config.max_target_length - self.config.max_prefill_predict_length
    tokens = jax.device_put(np.asarray(prompts, np.int32), self.rows_sharding)
    true_length = jax.device_put(np.asarray(prompt_lengths, np.int32), self.rows_sharding)
    with sharding.logical_context(self.mesh, self.config):
      if self.prefill is None:
        self.prefill = self._prefill.lower(params, tokens, true_length, rng).compile()
      cache, token, logp = self.prefill(params, tokens, true_length, rng)
      sampled, logps = [np.asarray(token)], [np.asarray(logp)]
      done = np.isin(sampled[0], self.end_ids)
      positions, index = true_length, jnp.ones((), jnp.int32)
      if self.step is None:
        self.step = self._step.lower(params, cache, token, positions, index, rng).compile()
      while len(sampled) < budget and not done.all():
        cache, token, logp, positions, index = self.step(params, cache, token, positions, index, rng)
        sampled.append(np.asarray(token))  # waits for the step: the loop stops as soon as every row has ended
        logps.append(np.asarray(logp))
        done |= np.isin(sampled[-1], self.end_ids)
    tokens, logps = np.stack(sampled, axis=1), np.stack(logps, axis=1)
    ended = np.isin(tokens, self.end_ids)
    lengths = np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, tokens.shape[1]).astype(np.int32)
    kept = np.arange(tokens.shape[1]) < lengths[:, None]
    pad = ((0, 0), (0, budget - tokens.shape[1]))
    return Samples(np.pad(tokens * kept, pad), np.pad((logps * kept).astype(np.float32), pad), lengths)
