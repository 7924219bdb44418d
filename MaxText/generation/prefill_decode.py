"""The prefill and the decode step over the training model and its KV cache, and the sampling they draw with.

The model is train.py's (training_setup.build), applied with the `cache` collection mutable: each attention layer
then keeps its keys and values in `cache/cached_key|cached_value` (layers.attentions.Attention), sharded by the
logical axes cache_batch / cache_sequence / cache_heads / cache_kv of logical_axis_rules. decode.py
(inference/decoding.py) and GRPO (row_sampler.py) both run these steps.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from MaxText.configuration import pipeline_schedule
from MaxText.errors import UserError
from MaxText.generation import sampling
from MaxText.layers import context_parallel

# Tokens that end a completion besides the tokenizer's EOS (Llama 3: end of turn, end of text).
END_TOKENS = ("<|eot_id|>", "<|end_of_text|>")


def end_token_ids(tokenizer) -> tuple[int, ...]:
  """The ids at which a row stops: the tokenizer's EOS and those of END_TOKENS it has."""
  ids = {tokenizer.eos_id} | {tokenizer.token_id(t) for t in END_TOKENS}
  return tuple(sorted(i for i in ids if i is not None and i >= 0))


def check_mesh(config, who: str) -> None:
  """A UserError for a mesh that generation does not run on (`who`: what generates, e.g. "decode.py")."""
  if context_parallel.mesh_size(config, context_parallel.AXIS) > 1:
    raise UserError(
      f"decoding does not run with context parallelism (it trains long sequences): set ici_context_parallelism=1 "
      f"and dcn_context_parallelism=1 for {who}; the checkpoint loads on any mesh"
    )
  if pipeline_schedule.stages(config.get_keys()) > 1:
    raise UserError(
      f"decoding does not run with pipeline parallelism (it trains): set ici_pipeline_parallelism=1 and "
      f"dcn_pipeline_parallelism=1 for {who}; a pipelined run's checkpoint loads on any mesh"
    )


def sampler(config, valid_vocab: int):
  """pick(logits (B, V), rng) -> (B,) tokens: the config's sampling, over the ids below valid_vocab."""

  def pick(logits, rng):
    if valid_vocab < logits.shape[-1]:  # never sample ids the tokenizer cannot decode
      logits = jnp.where(jnp.arange(logits.shape[-1]) < valid_vocab, logits, -jnp.inf)
    return sampling.sample(
      logits,
      rng,
      config.decode_sampling_strategy,
      temperature=config.decode_sampling_temperature,
      top_k=config.decode_sampling_top_k,
      nucleus_p=config.decode_sampling_nucleus_p,
    )

  return pick


def on_every_process(x):
  """x replicated over the mesh: the rows of a batch may sit on other processes' devices, and every process reads
  the sampled tokens (to stop at end tokens, and to print)."""
  return jax.lax.with_sharding_constraint(x, PartitionSpec())


def to_host(x) -> np.ndarray:
  """The whole array on this host, also when it spans other processes' devices."""
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def prefill(model, pick, params, tokens, true_length, rng, images=None):
  """Runs the padded prompts (B, P) through the model from an empty cache; returns (cache, last logits, first token).

  Sampling draws from fold_in(rng, 0) here and fold_in(rng, i) at step i (all on the device, no eager ops).
  images: None, or the prompts' images (B, N, C, H, W) (use_multimodal).
  """
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  segment_ids = (positions < true_length[:, None]).astype(jnp.int32)  # 0: padding
  logits, variables = model.apply({"params": params}, tokens, positions, segment_ids, images=images, mutable=["cache"])
  last = jnp.take_along_axis(logits, (true_length - 1)[:, None, None], axis=1)[:, 0]  # (B, V)
  return nn.unbox(variables["cache"]), last, on_every_process(pick(last, jax.random.fold_in(rng, 0)))


def decode_step(model, pick, params, cache, tokens, positions, step, rng):
  """Feeds one token per row (B,) at `positions` (B,); returns (cache, logits, next token, positions + 1, step + 1)."""
  logits, variables = model.apply({"params": params, "cache": cache}, tokens[:, None], positions[:, None], mutable=["cache"])
  token = on_every_process(pick(logits[:, 0], jax.random.fold_in(rng, step)))
  return variables["cache"], logits[:, 0], token, positions + 1, step + 1


def completion(tokens, end_ids) -> list[int]:
  """A row's tokens up to (not including) its first end token."""
  tokens = [int(t) for t in tokens]
  ends = [i for i, t in enumerate(tokens) if t in set(end_ids)]
  return tokens[: ends[0]] if ends else tokens


def check_prompt(config, prompt_ids, what: str = "the prompt") -> None:
  """A UserError for a prompt that the cache cannot take."""
  if len(prompt_ids) > config.max_prefill_predict_length:
    raise UserError(
      f"{what} is {len(prompt_ids)} tokens long but max_prefill_predict_length={config.max_prefill_predict_length}; "
      "shorten the prompt or raise max_prefill_predict_length"
    )
