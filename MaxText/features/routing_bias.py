"""DeepSeek-V3's balancing without an auxiliary loss, on the train step's side: the routers' selection bias
(`.../MoeBlock_0/gate/bias`, layers/deepseek_moe.py) is kept out of the optimizer, and after each update it moves by
routed_bias_update_rate towards equal expert loads (moe.update_routing_bias), from the step's sown loads.

Off (routed_bias=false) nothing here runs: the bias stays at its initial or converted value, which the routing still
adds to the scores when it chooses experts.
"""

import jax
import jax.numpy as jnp
import optax

from MaxText import feature_protocol
from MaxText.configuration import common_types
from MaxText.layers import moe

_BIAS = ("gate", "bias")


def _keys(path) -> tuple:
  return tuple(str(getattr(p, "key", p)) for p in path)


def _is_bias(keys: tuple) -> bool:
  return keys[-2:] == _BIAS


def present(config) -> bool:
  """Whether the model's routers hold selection biases, which the optimizer must leave alone."""
  return config.decoder_block in common_types.ROUTING_BIAS_BLOCKS


def keep_out_of_optimizer(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """The optimizer with its updates of the routing biases set to zero (their gradient is zero anyway, but AdamW's
  weight decay would shrink them)."""

  def biases(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: _is_bias(_keys(path)), params)

  return optax.chain(optimizer, optax.masked(optax.set_to_zero(), biases))


def loads(sown: dict) -> dict:
  """The step's per-expert loads as {path of a bias param: (E,) or (layers, E)}, from the sown intermediates."""
  found = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(sown)[0]:
    keys = _keys(path)
    if moe.ROW_CHOICES in keys:
      owner = keys[1 : keys.index(moe.ROW_CHOICES)]  # below "intermediates", down to the MoE block
      found[owner + _BIAS] = jnp.sum(leaf, axis=-2)  # the batch's rows summed: (E,), or (layers, E) when scanned
  return found


def update(params, step_loads: dict, rate: float, scan_axis: int):
  """params with each routing bias moved by `rate` towards equal loads. A scanned bias stacks its layers on
  scan_axis ((E, L) with param_scan_axis=1); the sown loads stack theirs on axis 0."""

  def moved(path, bias):
    keys = _keys(path)
    if not _is_bias(keys):
      return bias
    load = step_loads[keys]
    if bias.ndim == 2:
      return jnp.moveaxis(moe.update_routing_bias(jnp.moveaxis(bias, scan_axis, 0), load, rate), 0, scan_axis)
    return moe.update_routing_bias(bias, load, rate)

  return jax.tree_util.tree_map_with_path(moved, params)


class RoutingBias(feature_protocol.Feature):
  """The routers' selection biases kept out of the optimizer; with routed_bias, moved towards equal loads after each
  update from the step's summed loads."""

  name = "routing_bias"

  def __init__(self, config):
    self.moves = config.routed_bias
    self.rate, self.scan_axis = config.routed_bias_update_rate, config.param_scan_axis

  def optimizer(self, tx):
    return keep_out_of_optimizer(tx)

  def result(self, ctx, input_gradient):
    return loads(ctx.sown) if self.moves else None

  def after_update(self, state, result):
    if result is None:
      return state
    return state.replace(params=update(state.params, result, self.rate, self.scan_axis))
