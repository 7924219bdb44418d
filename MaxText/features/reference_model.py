"""The frozen reference model that an objective compares the policy with (DPO, GRPO): the model the run started from.

Where another feature can tell the starting model from the params (LoRA's base: the adapters' B zeroed), that;
else a copy of the params taken at step 0, in the `reference_params` slot (sharded as the params, outside the
optimizer, saved in checkpoints so that a resumed run keeps it). The model state that other features keep beside the
params (fp8's scales) is copied at step 0 too (`reference_state`), so that the reference computes as the starting
model did while the policy's move on.
"""

import jax
import jax.numpy as jnp

from MaxText import feature_protocol

REFERENCE, REFERENCE_STATE = "reference_params", "reference_state"  # the slots


class ReferenceModel:
  """The reference of a feature that holds one; `others` are the run's features chosen before it."""

  def __init__(self, others):
    self.others = tuple(others)
    self.model_slots = tuple(name for f in self.others for name in f.model_state)

  def base(self, params):
    """The starting model as another feature tells it from the params (LoRA's base), or None."""
    return next((b for f in self.others if (b := f.base_params(params)) is not None), None)

  def slots(self, variables: dict) -> dict:
    """The slots that hold the reference (for Feature.slots)."""
    slots = {}
    if self.base(variables["params"]) is None:
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

  def constant(self, state) -> dict:
    """The step's constant input (for Feature.step_constant): the reference's params and model collections."""
    params = state.slots[REFERENCE] if REFERENCE in state.slots else self.base(state.params)
    return {"params": params, "collections": state.slots.get(REFERENCE_STATE, {})}


def logits(ctx: feature_protocol.StepContext, constant: dict) -> jax.Array:
  """(B, T, V) logits of the reference (a step's `constant`) on the step's batch, not differentiated."""
  reference = jax.tree.map(jax.lax.stop_gradient, constant)
  reference_logits, _ = ctx.forward(reference["params"], reference["collections"], True)
  return reference_logits
