"""DPO (use_dpo=true): the loss on preference pairs, and the frozen reference model it compares the policy with.

A row holds one pair (input_pipeline/dpo.py): the chosen sample's response targets have targets_segmentation 1, the
rejected one's 2. The loss is TRL's sigmoid DPO loss, with rewards beta * (log pi(response) - log ref(response)):
  -logsigmoid(r_c - r_r) * (1 - label_smoothing) - logsigmoid(r_r - r_c) * label_smoothing.

The reference is the starting model. Without LoRA it is a second, untrained copy of the params in the train state
(the `reference_params` slot, sharded as the params, outside the optimizer, saved in checkpoints so that a resumed
run keeps it); with LoRA it is the base, the model with its adapters' B set to zero, as PEFT does.
"""

import jax
import jax.numpy as jnp
import optax

from MaxText import feature_protocol

CHOSEN, REJECTED = 1, 2  # the targets_segmentation of each sample's response tokens
REFERENCE, REFERENCE_STATE = "reference_params", "reference_state"  # the slots
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
  """use_dpo: DPO's objective against a frozen reference.

  The reference is the model the run started from: where another feature can tell it from the params (LoRA's base),
  that; else a copy of the params taken at step 0, in the `reference_params` slot. The model state that other
  features keep beside the params (fp8's scales) is copied at step 0 too (`reference_state`), so the reference
  computes as the starting model did while the policy's move on.
  """

  name = "dpo"

  def __init__(self, config, others):
    self.beta, self.label_smoothing = config.dpo_beta, config.dpo_label_smoothing
    self.others = tuple(others)
    self.model_slots = tuple(name for f in self.others for name in f.model_state)

  def _base(self, params):
    return next((b for f in self.others if (b := f.base_params(params)) is not None), None)

  def slots(self, variables: dict) -> dict:
    slots = {}
    if self._base(variables["params"]) is None:
      slots[REFERENCE] = variables["params"]
    if self.model_slots:
      slots[REFERENCE_STATE] = {name: variables[name] for name in self.model_slots if name in variables}
    return slots

  def on_start(self, state):
    """At step 0 (a fresh run, from load_parameters_path's params or an init) the reference becomes a copy of the
    starting model; a resumed run keeps its checkpoint's."""
    if int(state.step) > 0:
      return state
    copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))  # its own buffers: the step donates the state
    if REFERENCE in state.slots:
      state = state.with_slot(REFERENCE, copy(state.params))
    if REFERENCE_STATE in state.slots:
      state = state.with_slot(REFERENCE_STATE, copy({name: state.slots[name] for name in self.model_slots}))
    return state

  def step_constant(self, state, train: bool):
    params = state.slots[REFERENCE] if REFERENCE in state.slots else self._base(state.params)
    return {"params": params, "collections": state.slots.get(REFERENCE_STATE, {})}

  def objective(self, ctx: feature_protocol.StepContext, constant) -> feature_protocol.Objective:
    reference = jax.tree.map(jax.lax.stop_gradient, constant)
    reference_logits, _ = ctx.forward(reference["params"], reference["collections"], True)
    pairs_loss, pairs, metrics = loss(
      response_logps(ctx.logits, ctx.batch),
      response_logps(reference_logits, ctx.batch),
      ctx.batch,
      self.beta,
      self.label_smoothing,
    )
    return feature_protocol.Objective(pairs_loss, pairs, metrics)
