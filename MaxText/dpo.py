"""DPO (use_dpo=true): the loss on preference pairs, and the frozen reference model it compares the policy with.

A row holds one pair (input_pipeline/dpo.py): the chosen sample's response targets have targets_segmentation 1, the
rejected one's 2. The loss is TRL's sigmoid DPO loss, with rewards beta * (log pi(response) - log ref(response)):
  -logsigmoid(r_c - r_r) * (1 - label_smoothing) - logsigmoid(r_r - r_c) * label_smoothing.

The reference is the starting params. Without LoRA they are a second, untrained copy in the train state
(DpoTrainState.reference_params, sharded as the params, outside the optimizer, saved in checkpoints so that a resumed
run keeps it); with LoRA the reference is the base, the model with its adapters' B set to zero, as PEFT does.
"""

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

CHOSEN, REJECTED = 1, 2  # the targets_segmentation of each sample's response tokens
METRICS = ("dpo/reward_accuracy", "dpo/chosen_rewards", "dpo/rejected_rewards", "dpo/margin")


class DpoTrainState(train_state.TrainState):
  """The train state of a DPO run without LoRA: also the frozen reference params, which no update touches."""

  reference_params: dict = struct.field(default_factory=dict)


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


def reference_params(config, state):
  """The reference model's params: DpoTrainState's frozen copy, or with LoRA the params with every lora_b zeroed."""
  if not config.use_dpo:
    return None
  if not config.enable_lora:
    return state.reference_params

  def base(path, x):
    return jnp.zeros_like(x) if getattr(path[-1], "key", None) == "lora_b" else x

  return jax.tree_util.tree_map_with_path(base, state.params)


def with_starting_reference(config, state):
  """At step 0 (a fresh run, from load_parameters_path's params or an init), the reference becomes a copy of the
  params; a resumed run keeps its checkpoint's."""
  if not config.use_dpo or config.enable_lora or int(state.step) > 0:
    return state
  copy = jax.jit(lambda params: jax.tree.map(jnp.copy, params))  # its own buffers: the step donates the state
  return state.replace(reference_params=copy(state.params))
