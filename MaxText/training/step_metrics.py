"""The metrics a train step returns: the loss and its terms, the norms of the gradients, params and update, the
learning rate, the features' own metrics, and the non-finite guard's report."""

import jax
import jax.numpy as jnp
import optax

from MaxText import feature_protocol
from MaxText.diagnostics import nonfinite
from MaxText.training.optimizers import create_learning_rate_schedule


def norm(features, tree):
  """The global norm of a tree's float leaves (frozen leaves, e.g. integer codes, left out)."""
  return optax.tree.norm(
    jax.tree.map(lambda x: jnp.zeros((), jnp.float32) if feature_protocol.is_frozen(features, x) else x, tree)
  )


def own_mean(pair) -> jax.Array:
  """An objective's metric given as (sum, count): its mean (0 where nothing was counted)."""
  total, count = pair
  return total / jnp.maximum(count, 1.0)


def metrics(config, features, state, new_state, summed, grads, finite) -> dict:
  denominator = jnp.maximum(summed.weights, 1.0)
  raw_grad_norm = norm(features, grads)
  threshold = config.gradient_clipping_threshold
  metrics = {
    "learning/loss": summed.loss / denominator,
    "learning/total_weights": summed.weights,
    "learning/raw_grad_norm": raw_grad_norm,
    # clip_by_global_norm rescales to exactly the threshold, so the clipped norm needs no second pass.
    "learning/grad_norm": jnp.minimum(raw_grad_norm, threshold) if threshold > 0 else raw_grad_norm,
    "learning/param_norm": norm(features, new_state.params),
    "learning/update_norm": norm(features, jax.tree.map(jnp.subtract, new_state.params, state.params)),
    "learning/current_learning_rate": create_learning_rate_schedule(config)(state.step),
  }
  for name, value in summed.terms.items():  # learning/loss includes them (what is minimised), as upstream's
    metrics[f"learning/{name}"] = value / denominator
  for name, value in summed.metrics.items():  # the objective's, as means
    metrics[name] = own_mean(value) if isinstance(value, tuple) else value / denominator
  for feature in features:
    metrics.update(feature.metrics(summed.results[feature.name]))
  if finite is not None:
    metrics[nonfinite.SKIPPED] = (~finite).astype(jnp.float32)
    metrics[nonfinite.REPORT] = nonfinite.locate(finite, state.params, grads, config)
  return metrics
