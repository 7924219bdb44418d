"""Picking the next token from the logits: greedy, weighted, nucleus (top-p) or top-k sampling.

Each row of the batch is sampled independently (one draw per row from the same key). Temperature divides
the logits before the nucleus or the top k are chosen, so both act on the distribution that is sampled.
"""

import jax
import jax.numpy as jnp

STRATEGIES = ("greedy", "weighted", "nucleus", "topk")
_MASKED = -1e30  # a logit that no draw picks (finite, so that a row never becomes NaN)


def nucleus_logits(logits, p: float):
  """The logits with every token outside the nucleus masked: the fewest most likely tokens whose probabilities
  sum to at least p (the most likely token always stays; tokens tied with the last one kept stay too).

  Args:
    logits: (B, V) float32.
    p: in [0, 1]; 0 keeps the most likely token only (as upstream MaxText).
  """
  sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # (B, V), descending
  cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
  # Tokens before the cutoff sum to less than p; the cutoff token is the one that reaches p.
  cutoff = jnp.minimum(jnp.sum(cumulative < p, axis=-1, keepdims=True), logits.shape[-1] - 1)  # (B, 1)
  threshold = jnp.take_along_axis(sorted_logits, cutoff, axis=-1)
  return jnp.where(logits < threshold, _MASKED, logits)


def sample(logits, rng, strategy: str, temperature: float = 1.0, top_k: int = 0, nucleus_p: float = 1.0):
  """The next token of each row.

  Args:
    logits: (B, V) logits of the next token.
    rng: a PRNG key (unused by greedy).
    strategy: one of STRATEGIES.
    temperature: > 0; the logits are divided by it (weighted, nucleus, topk).
    top_k: topk samples among the k most likely tokens.
    nucleus_p: nucleus samples among the most likely tokens that together hold probability p.
  Returns:
    (B,) int32 token ids.
  """
  logits = logits.astype(jnp.float32)
  if strategy == "greedy":
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if strategy not in STRATEGIES:
    raise ValueError(f"decode_sampling_strategy={strategy} is not one of {', '.join(STRATEGIES)}")
  logits = logits / temperature
  if strategy == "topk":
    top_logits, top_ids = jax.lax.top_k(logits, top_k)  # (B, k)
    choice = jax.random.categorical(rng, top_logits, axis=-1)  # (B,)
    return jnp.take_along_axis(top_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
  if strategy == "nucleus":
    logits = nucleus_logits(logits, nucleus_p)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)
