"""The optimizer: global-norm clipping -> AdamW (or Pax's Adam, SGD, or Muon with AdamW), driven by the warmup +
cosine learning-rate schedule."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from MaxText.training import muon


def create_learning_rate_schedule(config) -> optax.Schedule:
  """Linear warmup to learning_rate, cosine decay to learning_rate * final_fraction, then 0 past the schedule.

  warmup = warmup_steps_fraction * learning_rate_schedule_steps; the cosine covers the rest of the schedule;
  steps beyond learning_rate_schedule_steps (when steps is larger) train at learning rate 0.
  """
  lr = config.learning_rate
  schedule_steps = config.learning_rate_schedule_steps
  warmup_steps = int(schedule_steps * config.warmup_steps_fraction)
  cos_steps = schedule_steps - warmup_steps
  final = lr * config.cosine_learning_rate_final_fraction
  pieces = [optax.linear_schedule(0.0, lr, warmup_steps)]
  boundaries = [warmup_steps]
  pieces.append(optax.cosine_decay_schedule(lr, max(cos_steps, 1), alpha=final / lr if lr else 0.0))
  if config.steps > schedule_steps:
    boundaries.append(schedule_steps)
    pieces.append(optax.constant_schedule(0.0))
  return optax.join_schedules(pieces, boundaries)


def scale_by_adam_pax(b1: float, b2: float, eps: float, eps_root: float, weight_decay: float):
  """Pax's Adam (upstream MaxText's opt_type=adam_pax) before the learning rate: the moments decay by the
  bias-corrected b(t) = b (1 - b^(t-1)) / (1 - b^t) at step t = 1, 2, ... (so step 1 takes g and g^2 whole), and
  the update is mu / (sqrt(nu + eps_root) + eps) + weight_decay * param. The state is optax's ScaleByAdamState.

  The corrected decay is Adam's bias correction folded into the moments, so the steps are AdamW's up to rounding;
  the moments it keeps are the bias-corrected ones."""

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=jax.tree.map(jnp.zeros_like, params))

  def corrected(b: float, t):
    b = jnp.asarray(b, jnp.float32)
    return b * (1.0 - b ** (t - 1.0)) / (1.0 - b**t)

  def update(grads, state, params):
    t = (state.count + 1).astype(jnp.float32)
    d1, d2 = corrected(b1, t), corrected(b2, t)
    mu = jax.tree.map(lambda g, m: ((1 - d1) * g + d1 * m).astype(m.dtype), grads, state.mu)
    nu = jax.tree.map(lambda g, v: ((1 - d2) * g * g + d2 * v).astype(v.dtype), grads, state.nu)
    updates = jax.tree.map(
      lambda m, v, p: (m / (jnp.sqrt(v + eps_root) + eps) + weight_decay * p).astype(p.dtype), mu, nu, params
    )
    return updates, optax.ScaleByAdamState(count=optax.safe_increment(state.count), mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


def create_optimizer(
  config, learning_rate_schedule: optax.Schedule, param_axes: Callable[[], object] | None = None
) -> optax.GradientTransformation:
  """opt_type's optimizer, after clip_by_global_norm(gradient_clipping_threshold) when that is > 0.

  Args:
    param_axes: () -> the params' logical axis names (a tree of PartitionSpecs); called only by opt_type=muon, which
      reads from them which axes of each param are its matrix (training/muon.py).
  """
  adam = dict(b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps, eps_root=config.adam_eps_root)
  if config.opt_type == "adam_pax":
    optimizer = optax.chain(
      scale_by_adam_pax(**adam, weight_decay=config.adam_weight_decay),
      optax.scale_by_learning_rate(learning_rate_schedule),
    )
  elif config.opt_type == "sgd":
    optimizer = optax.sgd(learning_rate_schedule)
  elif config.opt_type == "muon":
    assert param_axes is not None, "opt_type=muon needs the params' logical axes"
    optimizer = muon.create(config, learning_rate_schedule, param_axes)
  else:
    optimizer = optax.adamw(learning_rate_schedule, **adam, weight_decay=config.adam_weight_decay)
  if config.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), optimizer)
  return optimizer
