"""The loss, train_step and eval_step: pure functions shared by train.py, train_compile.py, the benchmarks and tests.

A batch is a dict of (batch, length) int32 arrays: inputs, inputs_position, inputs_segmentation, targets,
targets_segmentation (segmentation 0 marks padding, which carries no loss); with use_multimodal also images, the rows'
pixel values (B, N, C, H, W) float32. The run's optional features
(MaxText/feature_protocol.py) act through their hooks; gradient accumulation, the fractional batch, clipping (in the
optimizer), the non-finite guard and checkify are every run's, here. Compiling the step ahead of time is in
aot_compile.py.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from MaxText import feature_protocol
from MaxText.diagnostics import nonfinite
from MaxText.feature_protocol import Objective, StepContext
from MaxText.layers import layer_names
from MaxText.training import step_metrics


class LossAux(NamedTuple):
  """What the loss returns besides its value."""

  weights: jax.Array  # the objective's weights (real target tokens for the cross-entropy): the mean's denominator
  terms: dict  # the features' loss terms, summed as the loss is (training only), by name
  metrics: dict  # the objective's metrics, summed as the loss is
  sown: dict  # the `intermediates` collection the forward pass sowed (the features read theirs from it)


class Gradients(NamedTuple):
  """A microbatch's (or the summed microbatches') loss, gradients and what the features collect."""

  loss: jax.Array  # the summed loss
  weights: jax.Array
  terms: dict
  metrics: dict
  params: Any  # the summed loss's gradient
  results: dict  # by feature name, combined over microbatches by each feature's `combine`


def cross_entropy(ctx: StepContext) -> Objective:
  """The summed token cross-entropy over the real target tokens."""
  xent = optax.softmax_cross_entropy_with_integer_labels(ctx.logits, ctx.batch["targets"])  # (B, T)
  weights = (ctx.batch["targets_segmentation"] != 0).astype(jnp.float32)
  return Objective(jnp.sum(xent * weights), jnp.sum(weights), {})


def loss_fn(model, config, features, params, batch, dropout_rng, train: bool, inputs=None, constants=None):
  """The summed loss to differentiate, and its LossAux.

  The objective is the cross-entropy unless a feature brings its own. In training the features' loss terms are added
  (each summed as the objective's loss is, so that dividing by its weights averages it over microbatches).

  Args:
    inputs: the features' step inputs by name (differentiated); constants: their constant inputs. None: none.
  """
  batch = feature_protocol.apply_all(features, "prepare_batch", batch)  # the layout the model expects
  inputs = inputs or dict.fromkeys((f.name for f in features), None)
  constants = constants or dict.fromkeys((f.name for f in features), None)

  def forward(params, collections, deterministic):
    return model.apply(
      {"params": params, **collections},
      batch["inputs"],
      batch["inputs_position"],
      batch["inputs_segmentation"],
      deterministic=deterministic,
      images=batch.get("images"),  # (B, N, C, H, W) pixel values of a multimodal batch
      rngs={"dropout": dropout_rng},
      mutable=["intermediates"],
    )  # (B, T, V) float32

  logits, sown = forward(params, feature_protocol.collections(features, inputs), not (train and config.enable_dropout))
  ctx = StepContext(params, batch, logits, sown, inputs, forward, train)
  objective = next((o for f in features if (o := f.objective(ctx, constants[f.name])) is not None), None)
  objective = objective or cross_entropy(ctx)
  ctx = ctx._replace(weights=objective.weights)
  terms = {name: value for f in features for name, value in f.loss_terms(ctx).items()} if train else {}
  loss = objective.loss + sum(terms.values())
  return loss, LossAux(objective.weights, terms, objective.metrics, sown)


def _microbatch_gradients(model, config, features, params, inputs, constants, batch, dropout_rng) -> Gradients:
  trainable, frozen = layer_names.partition(params, lambda _, leaf: feature_protocol.is_frozen(features, leaf))

  def loss_of(trainable, inputs):
    return loss_fn(
      model, config, features, layer_names.merge(frozen, trainable), batch, dropout_rng, True, inputs, constants
    )

  (loss, aux), (grads, input_grads) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(trainable, inputs)
  grads = layer_names.merge(jax.tree.map(lambda c: c * jnp.zeros((), c.dtype), frozen), grads) if frozen else grads
  ctx = StepContext(params, batch, None, aux.sown, inputs, None, True, aux.weights)
  results = {f.name: f.result(ctx, input_grads[f.name]) for f in features}
  return Gradients(loss, aux.weights, aux.terms, aux.metrics, grads, results)


def summed_gradients(model, config, features, params, inputs, constants, batch, dropout_rng) -> Gradients:
  """The Gradients of the summed loss over all gradient_accumulation_steps microbatches, scanned one at a time.

  Summing per-token losses (not per-microbatch means) makes the result the large batch's gradient. Microbatch i
  takes rows i, i+G, i+2G, ... so that no row leaves the device it was loaded on.
  """
  steps = config.gradient_accumulation_steps
  one = functools.partial(_microbatch_gradients, model, config, features, params, inputs, constants)
  if steps == 1:
    return one(batch, dropout_rng)

  def to_microbatches(x):  # (B, T) -> (G, B/G, T)
    return jnp.swapaxes(x.reshape(x.shape[0] // steps, steps, *x.shape[1:]), 0, 1)

  def add(a: Gradients, b: Gradients) -> Gradients:
    results = {f.name: f.combine(a.results[f.name], b.results[f.name]) for f in features}
    return Gradients(*(jax.tree.map(jnp.add, x, y) for x, y in zip(a[:5], b[:5])), results)

  def accumulate(total, microbatch_and_index):
    microbatch, index = microbatch_and_index
    return add(total, one(microbatch, jax.random.fold_in(dropout_rng, index))), None

  microbatches = jax.tree.map(to_microbatches, batch)
  shape = jax.eval_shape(one, jax.tree.map(lambda x: x[0], microbatches), dropout_rng)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape[:5])
  nothing = Gradients(*zeros, {f.name: f.start(shape.results[f.name], inputs[f.name]) for f in features})
  total, _ = jax.lax.scan(accumulate, nothing, (microbatches, jnp.arange(steps)))
  return total


def _rows_to_train_on(config, batch):
  """With a fractional per_device_batch_size, more rows are loaded than trained on: keep the first ones."""
  rows = config.micro_batch_size_to_train_on * config.gradient_accumulation_steps
  if rows == config.global_batch_size_to_load:
    return batch
  return jax.tree.map(lambda x: x[:rows], batch)


def step_inputs(features, state, batch, train: bool) -> tuple[dict, dict]:
  """The features' step inputs and constant inputs, by feature name."""
  inputs = {f.name: f.step_input(state, batch, train) for f in features}
  return inputs, {f.name: f.step_constant(state, train) for f in features}


def train_step(model, config, features, state, batch):
  """One optimizer update: loss -> gradient -> update. Returns (new_state, metrics) with scalar metrics for logging.

  With nonfinite_action abort or skip, a step with a non-finite loss or gradient does not update the params or the
  optimizer state and metrics["nonfinite"] says where the values are (nonfinite.locate).
  """
  batch = _rows_to_train_on(config, batch)
  inputs, constants = step_inputs(features, state, batch, True)
  dropout_rng = jax.random.fold_in(jax.random.PRNGKey(config.init_weights_seed), state.step)
  summed = summed_gradients(model, config, features, state.params, inputs, constants, batch, dropout_rng)
  denominator = jnp.maximum(summed.weights, 1.0)  # An all-padding batch gives zero loss and no update.
  # Back to each parameter's dtype: a float32 denominator would promote bfloat16 grads (weight_dtype=bfloat16),
  # and with them the optimizer state and the params, so that the state would change type at the first step.
  frozen = functools.partial(feature_protocol.is_frozen, features)
  grads = jax.tree.map(lambda g: g if frozen(g) else (g / denominator).astype(g.dtype), summed.params)
  new_state, finite = _update(config, features, state, grads, summed)
  return new_state, step_metrics.metrics(config, features, state, new_state, summed, grads, finite)


def _update(config, features, state, grads, summed: Gradients):
  """The optimizer's update, or none: (new state, whether the step's loss and gradients are finite or None).

  A batch of padding only (the data ran out on every process) must not move the weights (momentum, weight decay):
  it skips the update and does not count the step. With nonfinite_action abort or skip, a non-finite step keeps the
  params and the optimizer state, and counts as a step.
  """
  has_tokens = summed.weights > 0

  def updated():
    new_state = state.apply_gradients(grads=grads)
    for feature in features:  # their own updates, after the optimizer's
      new_state = feature.after_update(new_state, summed.results[feature.name])
    return new_state

  if config.nonfinite_action == "none":
    return jax.lax.cond(has_tokens, updated, lambda: state), None
  finite = nonfinite.is_finite(summed.loss, step_metrics.norm(features, grads))
  kept = lambda: state.replace(step=state.step + has_tokens.astype(state.step.dtype))
  return jax.lax.cond(has_tokens & finite, updated, kept), finite


def eval_step(model, config, features, state, batch):
  """Summed loss and weights of one eval batch (no dropout, no update), and the objective's metrics summed as the loss
  is (evaluation/<name>)."""
  inputs, constants = step_inputs(features, state, batch, False)
  total_loss, aux = loss_fn(model, config, features, state.params, batch, jax.random.PRNGKey(0), False, inputs, constants)
  metrics = {"evaluation/total_loss": total_loss, "evaluation/total_weights": aux.weights}
  for name, value in aux.metrics.items():  # summed as the loss is; a (sum, count) pair: its mean, weighted so
    metrics[f"evaluation/{name}"] = step_metrics.own_mean(value) * aux.weights if isinstance(value, tuple) else value
  return metrics
