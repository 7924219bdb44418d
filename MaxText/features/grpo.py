"""GRPO (use_grpo=true): the clipped policy-gradient objective on sampled completions, with group-relative advantages
and a k3 KL penalty against a frozen reference, following TRL's GRPOTrainer.

A train row holds one prompt and one sampled completion (grpo_rollouts.py builds the batch): the completion's target
tokens have targets_segmentation 1, the prompt's and the padding's 0. Besides the usual keys the batch holds
  advantages (B,) float32: the row's reward standardized within its prompt's group (group_advantages);
  old_logps (B, T) float32, when num_iterations > 1: the log-probs of the targets under the policy that sampled them
    (the sampler's, which equal a forward pass's within 1e-5: row_sampler_test.py).
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
from jax.sharding import NamedSharding, PartitionSpec

from MaxText import feature_protocol
from MaxText.configuration import rl_config
from MaxText.features import grpo_rollouts, reference_model
from MaxText.features.grpo_rollouts import ADVANTAGES, OLD_LOGPS, group_advantages  # noqa: F401  # the batch's keys
from MaxText.generation import prefill_decode
from MaxText.runtime import sharding

ROLLOUTS, RNG = "grpo_rollouts", "grpo_rng"  # the slots: the round's train batch, the sampling key of the next round


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
  """use_grpo: GRPO's loop and objective. Every num_iterations steps host_batch generates the completions of the
  data's next prompts with the current params and scores them (grpo_rollouts.py); the round's batch and the sampling
  key stay in the state's slots, so the steps between rounds, and a resumed run, train on the same rollouts. The
  reference (reference_model.py) is kept only when grpo_beta > 0."""

  name = "grpo"

  def __init__(self, config, others):
    prefill_decode.check_mesh(config, "use_grpo=true")
    self.config, self.settings = config, Settings.of(config)
    self.reference = reference_model.ReferenceModel(others) if config.grpo_beta > 0 else None
    self.reward_names = rl_config.reward_function_names(config.get_keys())
    self.rollouts = None  # grpo_rollouts.Rollouts, built at the first round (it compiles the sampler)

  def slots(self, variables: dict) -> dict:
    shapes = grpo_rollouts.batch_shapes(self.config)
    slots = {
      ROLLOUTS: {key: jnp.zeros(shape, dtype) for key, (shape, dtype) in shapes.items()},
      RNG: jax.random.PRNGKey(self.config.decode_sampling_seed),
    }
    return slots | (self.reference.slots(variables) if self.reference else {})

  def on_start(self, state):
    return self.reference.on_start(state) if self.reference else state

  def batch_shapes(self, shapes: dict) -> dict:
    return grpo_rollouts.batch_shapes(self.config)

  def host_batch(self, state, pull, model, mesh):
    step = int(state.step)
    if step % self.config.num_iterations == 0:  # a round: generate from the data's next prompts
      if self.rollouts is None:
        self.rollouts = grpo_rollouts.Rollouts(self.config, model, mesh)
      rng, sampling_rng = jax.random.split(state.slots[RNG])
      prompts = {key: prefill_decode.to_host(value) for key, value in pull().items()}
      batch = self.rollouts.batch(state.params, prompts, sampling_rng, step)
      replicated = NamedSharding(mesh, PartitionSpec())
      state = state.with_slot(ROLLOUTS, _on(batch, replicated)).with_slot(RNG, rng)
    else:  # between rounds: the round's batch again
      batch = {key: np.asarray(value) for key, value in state.slots[ROLLOUTS].items()}
    rows = sharding.data_sharding(self.config, mesh)
    return state, lambda: _on(batch, rows)

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
    if grpo_rollouts.REWARDS in batch:  # a batch of the loop (the objective's tests give the advantages alone)
      metrics |= self._rollout_metrics(batch, mask)
    return feature_protocol.Objective(total, weights, metrics)

  def _rollout_metrics(self, batch, mask) -> dict:
    """The rollouts' metrics, each a (sum, count) pair over the completions."""
    tokens = jnp.sum(mask, axis=1)
    rows = (tokens > 0).astype(jnp.float32)
    count = jnp.sum(rows)
    mean = lambda x: (jax.lax.stop_gradient(jnp.sum(x * rows)), count)  # pylint: disable=unnecessary-lambda-assignment
    metrics = {"rl/reward_mean": mean(batch[grpo_rollouts.REWARDS]), "rl/reward_std": mean(batch[grpo_rollouts.REWARD_STD])}
    metrics["rl/completion_length"] = mean(tokens)
    for i, name in enumerate(self.reward_names):
      metrics[f"rl/rewards/{name}"] = mean(batch[grpo_rollouts.FUNCTION_REWARDS][:, i])
    return metrics


def _on(batch: dict, where) -> dict:
  """A host batch (every process holds all of it) as global arrays on `where`, in buffers of their own."""
  return {k: jax.make_array_from_callback(v.shape, where, lambda index, v=v: v[index]) for k, v in batch.items()}
