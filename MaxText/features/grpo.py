"""GRPO (use_grpo=true): the clipped policy-gradient objective on sampled completions, with group-relative advantages
and a k3 KL penalty against a frozen reference, following TRL's GRPOTrainer.

A train row holds one prompt and one sampled completion: the completion's target tokens
have targets_segmentation 1, the prompt's and the padding's 0. Besides the usual keys the batch holds
  advantages (B,) float32: the row's reward standardized within its prompt's group (group_advantages);
  old_logps (B, T) float32, when num_iterations > 1: the log-probs of the targets under the policy that sampled them.
With num_iterations = 1 the policy that sampled is the one trained, so the ratio is 1 (its value; not its gradient).

Per completion token t of row i, with r = exp(logp - old_logp) (loss_algo=grpo), or for gspo-token
r = exp(sg(mean_t(logp - old_logp)) + logp - sg(logp)) (the sequence's ratio in value, a token's in gradient):
  loss_it = -min(r A_i, clip(r, 1 - grpo_epsilon, 1 + epsilon_high) A_i) + grpo_beta kl_it,
  kl_it = exp(ref - logp) - (ref - logp) - 1   (k3, with ref the reference's log-prob; none when grpo_beta = 0).
Log-probs are of the logits divided by decode_sampling_temperature, the distribution the completions were sampled
from. loss_agg_mode: token-mean averages over all completion tokens of the batch; sequence-mean-token-mean averages
each completion's token mean; sequence-mean averages each completion's token sum.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from MaxText import feature_protocol
from MaxText.features import reference_model

ADVANTAGES, OLD_LOGPS = "advantages", "old_logps"  # the batch keys GRPO adds
ADVANTAGE_EPS = 1e-4  # TRL's: (r - mean) / (std + eps)


class Settings(NamedTuple):
  """The objective's keys."""

  algo: str  # loss_algo: grpo | gspo-token
  agg_mode: str  # loss_agg_mode
  epsilon: float
  epsilon_high: float
  beta: float
  temperature: float

  @classmethod
  def of(cls, config) -> "Settings":
    return cls(
      config.loss_algo,
      config.loss_agg_mode,
      config.grpo_epsilon,
      config.epsilon_high,
      config.grpo_beta,
      config.decode_sampling_temperature,
    )


def group_advantages(rewards, num_generations: int) -> np.ndarray:
  """(B,) rewards, num_generations consecutive rows per prompt -> (B,) float32 advantages: (r - the group's mean) /
  (the group's std with Bessel's correction + 1e-4). Equal rewards in a group give advantages 0."""
  groups = np.asarray(rewards, np.float32).reshape(-1, num_generations)
  mean = groups.mean(axis=1, keepdims=True)
  std = groups.std(axis=1, ddof=1, keepdims=True)
  return ((groups - mean) / (std + np.float32(ADVANTAGE_EPS))).reshape(-1).astype(np.float32)


def token_logps(logits, targets, temperature: float) -> jax.Array:
  """(B, T, V) logits, (B, T) targets -> (B, T) float32 log-probs of the targets under softmax(logits / temperature)."""
  return -optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32) / temperature, targets)


def loss(logps, old_logps, ref_logps, advantages, mask, settings: Settings):
  """The summed GRPO loss of a batch, its weights (the mean's denominator) and its metrics.

  Args:
    logps: (B, T) the policy's log-probs of the targets (differentiated).
    old_logps: (B, T) those of the policy that sampled (held constant).
    ref_logps: (B, T) the reference's, or None (grpo_beta = 0).
    advantages: (B,) float32.
    mask: (B, T) float32, 1 on the completions' tokens.
  Returns:
    (summed loss, weights, metrics): each metric a (sum, count) pair, logged as sum / count: rl/kl, the mean k3 KL
    over the completion tokens, and rl/clip_fraction, the share of tokens (of sequences, for gspo-token) whose ratio
    was clipped on the side its advantage pushes to (TRL's clip_ratio/region_mean).
  """
  old_logps = jax.lax.stop_gradient(old_logps)
  tokens = jnp.sum(mask, axis=1)  # (B,)
  sequences = (tokens > 0).astype(jnp.float32)
  log_ratio = logps - old_logps
  if settings.algo == "gspo-token":
    sequence_log_ratio = jnp.sum(log_ratio * mask, axis=1) / jnp.maximum(tokens, 1.0)  # (B,)
    log_ratio = jax.lax.stop_gradient(sequence_log_ratio)[:, None] + logps - jax.lax.stop_gradient(logps)
  ratio = jnp.exp(log_ratio)  # (B, T)
  advantage = advantages[:, None]
  clipped_ratio = jnp.clip(ratio, 1 - settings.epsilon, 1 + settings.epsilon_high)
  per_token = -jnp.minimum(ratio * advantage, clipped_ratio * advantage)
  metrics = {}
  if ref_logps is not None:
    delta = jax.lax.stop_gradient(ref_logps) - logps
    kl = jnp.exp(delta) - delta - 1
    per_token = per_token + settings.beta * kl
    metrics["rl/kl"] = (jnp.sum(kl * mask), jnp.sum(mask))
  summed = jnp.sum(per_token * mask, axis=1)  # (B,)
  if settings.agg_mode == "token-mean":
    total, weights = jnp.sum(summed), jnp.sum(mask)
  elif settings.agg_mode == "sequence-mean-token-mean":
    total, weights = jnp.sum(summed / jnp.maximum(tokens, 1.0)), jnp.sum(sequences)
  else:  # sequence-mean
    total, weights = jnp.sum(summed), jnp.sum(sequences)
  was_clipped = ((ratio < 1 - settings.epsilon) & (advantage < 0)) | ((ratio > 1 + settings.epsilon_high) & (advantage > 0))
  was_clipped = was_clipped.astype(jnp.float32)
  if settings.algo == "gspo-token":  # one ratio per sequence: the first token's stands for it
    metrics["rl/clip_fraction"] = (jnp.sum(was_clipped[:, 0] * sequences), jnp.sum(sequences))
  else:
    metrics["rl/clip_fraction"] = (jnp.sum(was_clipped * mask), jnp.sum(mask))
  metrics = jax.tree.map(jax.lax.stop_gradient, metrics)
  return total, weights, metrics


class Grpo(feature_protocol.Feature):
  """use_grpo: GRPO's objective. The reference (reference_model.py) is kept only when grpo_beta > 0."""

  name = "grpo"

  def __init__(self, config, others):
    self.settings = Settings.of(config)
    self.reference = reference_model.ReferenceModel(others) if config.grpo_beta > 0 else None

  def slots(self, variables: dict) -> dict:
    return self.reference.slots(variables) if self.reference else {}

  def on_start(self, state):
    return self.reference.on_start(state) if self.reference else state

  def step_constant(self, state, train: bool):
    return self.reference.constant(state) if self.reference else None

  def objective(self, ctx: feature_protocol.StepContext, constant) -> feature_protocol.Objective:
    batch, temperature = ctx.batch, self.settings.temperature
    logps = token_logps(ctx.logits, batch["targets"], temperature)
    old_logps = batch[OLD_LOGPS] if OLD_LOGPS in batch else logps
    ref_logps = None
    if self.reference is not None:
      ref_logps = token_logps(reference_model.logits(ctx, constant), batch["targets"], temperature)
    mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    total, weights, metrics = loss(logps, old_logps, ref_logps, batch[ADVANTAGES], mask, self.settings)
    return feature_protocol.Objective(total, weights, metrics)
