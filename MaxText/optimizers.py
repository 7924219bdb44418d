"""The optimizer: global-norm clipping -> AdamW, driven by the warmup + cosine learning-rate schedule."""

import optax

from MaxText.errors import ConfigError


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


def create_optimizer(config, learning_rate_schedule: optax.Schedule) -> optax.GradientTransformation:
  if config.opt_type != "adamw":
    raise ConfigError(f"opt_type={config.opt_type} is not supported; valid: adamw")
  adamw = optax.adamw(
    learning_rate_schedule,
    b1=config.adam_b1,
    b2=config.adam_b2,
    eps=config.adam_eps,
    eps_root=config.adam_eps_root,
    weight_decay=config.adam_weight_decay,
  )
  if config.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), adamw)
  return adamw
