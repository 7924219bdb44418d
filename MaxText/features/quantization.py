"""quantization=int8|int8w|int4w|intmp|fp8 as a feature: the dense layers' quantizer (layers/quantizations.py), and
fp8's delayed-scaling state.

fp8 keeps each dense layer's scales and amax histories in the train state's `fp8_meta` slot. The step feeds them to the
model as its `fp8_meta` collection and differentiates the loss with respect to them: their "gradient" is their new
value (the custom VJP of layers/quantizations.py), so no optimizer, clipping or weight decay touches them.
Microbatches combine by maximum (the largest amax seen), and the new value replaces the slot after the update.
"""

import dataclasses

import jax
import jax.numpy as jnp

from MaxText import feature_protocol
from MaxText.errors import UserError
from MaxText.layers import quantizations

SLOT = quantizations.FP8_COLLECTION  # the slot holds the collection of the same name


class Quantization(feature_protocol.Feature):
  name = "quantization"

  def __init__(self, config):
    self.quant = quantizations.from_config(config)
    self.fp8 = config.quantization == "fp8"
    self.model_state = (SLOT,) if self.fp8 else ()  # DPO's frozen reference copies them

  def gemm(self, gemm):
    return dataclasses.replace(gemm, quant=self.quant)

  def slots(self, variables: dict) -> dict:
    return {SLOT: variables[SLOT]} if SLOT in variables else {}

  def step_input(self, state, batch, train):
    return state.slots.get(SLOT)

  def collections(self, step_input) -> dict:
    return {} if step_input is None else {SLOT: step_input}

  def result(self, ctx, input_gradient):
    return input_gradient  # the new fp8 state

  def start(self, result_shape, step_input):
    return jax.tree.map(lambda s: jnp.full(s.shape, -jnp.inf, s.dtype), result_shape)

  def combine(self, a, b):
    return jax.tree.map(jnp.maximum, a, b)

  def after_update(self, state, result):
    return state if result is None else state.with_slot(SLOT, result)

  def check_restore(self, tree: dict, abstract_state, where: str) -> None:
    if SLOT not in abstract_state.slots:
      return
    items = where if where.endswith("/items") else f"{where}/items"
    if SLOT not in tree:
      raise UserError(
        f"checkpoint {where} holds no fp8 state, which this run's quantization=fp8 needs: resume with the "
        f"quantization it was trained with, or change it in a new run_name started from its params "
        f"(load_parameters_path={items})"
      )
    _check_amax_history_length(tree[SLOT], abstract_state.slots[SLOT], where, items)


def _shapes(tree) -> dict:
  return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_amax_history_length(saved_meta, wanted_meta, where: str, items: str) -> None:
  """The fp8 state's shapes differ only by fp8_amax_history_length (the last axis of each *_amax_history)."""
  saved, wanted = _shapes(saved_meta), _shapes(wanted_meta)
  if saved == wanted:
    return
  lengths = {shape[-1] for key, shape in saved.items() if key.endswith("_amax_history']")}
  was = f"fp8_amax_history_length={lengths.pop()}" if len(lengths) == 1 else "another fp8 layout"
  raise UserError(
    f"checkpoint {where} holds an fp8 state saved with {was}, which this run's fp8_amax_history_length does not "
    f"fit: resume with {was}, or change it in a new run_name started from its params (load_parameters_path={items})"
  )
