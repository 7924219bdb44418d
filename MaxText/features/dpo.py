"""DPO (use_dpo=true): the loss on preference pairs, and the frozen reference model it compares the policy with.

A row holds one pair (input_pipeline/dpo.py): the chosen sample's response targets have targets_segmentation 1, the
rejected one's 2. The loss is TRL's sigmoid DPO loss, with rewards beta * (log pi(response) - log ref(response)):
  -logsigmoid(r_c - r_r) * (1 - label_smoothing) - logsigmoid(r_r - r_c) * label_smoothing.

The reference is the starting model (reference_model.py). Without LoRA it is a second, untrained copy of the params in
the train state (the `reference_params` slot); with LoRA it is the base, the model with its adapters' B set to zero,
as PEFT does.
"""

import jax
import jax.numpy as jnp
import optax

from MaxText import feature_protocol
from MaxText.features import reference_model

CHOSEN, REJECTED = 1, 2  # the targets_segmentation of each sample's response tokens
METRICS = ("dpo/reward_accuracy", "dpo/chosen_rewards", "dpo/rejected_rewards", "dpo/margin")


def response_logps(logits, batch) -> jax.Array:
  """(B, T, V) logits -> (B, 2): each row's summed log-probs of the chosen and of the rejected response tokens."""
  logps = -optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # (B, T)
  segments = batch["targets_segmentation"]
  return jnp.stack([jnp.sum(logps * (segments == s), axis=1) for s in (CHOSEN, REJECTED)], axis=1)


def loss(policy_logps, reference_logps, batch, beta: float, label_smoothing: float):
  """The summed DPO loss over the batch's pairs, the number of pairs, and the summed METRICS.

  Args:
    policy_logps, reference_logps: (B, 2) response_logps of the policy and of the reference.
    batch: the rows (a row of padding only, when the data ran out, holds no pair and counts for nothing).
  """
  is_pair = jnp.any(batch["targets_segmentation"] == CHOSEN, axis=1).astype(jnp.float32)  # (B,)
  rewards = beta * (policy_logps - jax.lax.stop_gradient(reference_logps))  # (B, 2)
  chosen, rejected = rewards[:, 0], rewards[:, 1]
  margin = chosen - rejected
  losses = -jax.nn.log_sigmoid(margin) * (1 - label_smoothing) - jax.nn.log_sigmoid(-margin) * label_smoothing
  metrics = dict(zip(METRICS, ((chosen > rejected).astype(jnp.float32), chosen, rejected, margin)))
  metrics = {name: jax.lax.stop_gradient(jnp.sum(value * is_pair)) for name, value in metrics.items()}
  return jnp.sum(losses * is_pair), jnp.sum(is_pair), metrics


class Dpo(feature_protocol.Feature):
  """use_dpo: DPO's objective against a frozen reference, the model the run started from (reference_model.py)."""

  name = "dpo"

  def __init__(self, config, others):
    self.beta, self.label_smoothing = config.dpo_beta, config.dpo_label_smoothing
    self.reference = reference_model.ReferenceModel(others)

  def slots(self, variables: dict) -> dict:
    return self.reference.slots(variables)

  def on_start(self, state):
    return self.reference.on_start(state)

  def step_constant(self, state, train: bool):
    return self.reference.constant(state)

  def objective(self, ctx: feature_protocol.StepContext, constant) -> feature_protocol.Objective:
    pairs_loss, pairs, metrics = loss(
      response_logps(ctx.logits, ctx.batch),
      response_logps(reference_model.logits(ctx, constant), ctx.batch),
      ctx.batch,
      self.beta,
      self.label_smoothing,
    )
    return feature_protocol.Objective(pairs_loss, pairs, metrics)
