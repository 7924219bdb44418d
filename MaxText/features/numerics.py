"""numerics_debug_config's statistics as a feature: a tap on every dense layer's GEMM (diagnostics/numerics_taps.py)
and, each step, the statistics of the selected layers' activations, weights and gradients.

The taps' inputs (their gates, the gradient scale and placeholders) are the step's input in the taps' collection:
differentiating the loss with respect to them gives the gradients' reductions, and the forward pass sows the
activations' and weights' reductions. Microbatches combine reductions (numerics_stats.combine); the step returns the
statistics under metrics["numerics"], which the StatsWriter observer writes.
"""

import dataclasses

import jax.numpy as jnp

from MaxText import feature_protocol
from MaxText.diagnostics import numerics_log, numerics_stats, numerics_taps


class NumericsStatistics(feature_protocol.Feature):
  name = "numerics"

  def __init__(self, config):
    self.config = config
    self.plan = None  # numerics_stats.Plan, made when the params are known (bind_params)

  def gemm(self, gemm):
    return dataclasses.replace(gemm, tap=numerics_taps.dot_general) if self.config.numerics_debug.collects_stats else gemm

  def bind_params(self, abstract_params) -> None:
    self.plan = numerics_stats.create_plan(self.config, abstract_params)

  def step_input(self, state, batch, train: bool):
    if not train or self.plan is None:
      return None
    # The gradients of the mean loss: scaled by 1 / real target tokens, as the update's.
    tokens = jnp.maximum(jnp.sum(batch["targets_segmentation"] != 0), 1.0)
    return self.plan.step_inputs(state.step, 1.0 / tokens)

  def collections(self, step_input) -> dict:
    return {} if step_input is None else {numerics_taps.COLLECTION: step_input}

  def result(self, ctx, input_gradient):
    return None if input_gradient is None else self.plan.reductions(ctx.sown, input_gradient)

  def start(self, result_shape, step_input):
    return None if step_input is None else self.plan.identity(step_input)

  def combine(self, a, b):
    return None if a is None else numerics_stats.combine(a, b)

  def metrics(self, result) -> dict:
    return {} if result is None else {numerics_stats.METRICS_KEY: self.plan.finalize(result)}

  def observers(self, config, params, writer, start_step: int) -> list:
    return numerics_log.observers(config, params, writer, start_step)
