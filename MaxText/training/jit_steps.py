"""The train and eval steps jitted on the run's shardings, and max_checkify's checked step: what train.py's loop calls
and aot_compile.py lowers."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from MaxText.runtime import sharding
from MaxText.training.train_step import eval_step, train_step


def jit_train_step(model, config, features, mesh, state_shardings):
  """train_step jitted with the state donated and kept on its shardings, the batch on the data sharding.

  Call the result inside sharding.logical_context(mesh, config), which tracing needs. With max_checkify the step is
  checkified and returns (error, (new_state, metrics)), which aot_compile.throwing_step raises.
  """
  out_shardings = (state_shardings, None)
  if config.max_checkify:
    out_shardings = (None, out_shardings)
  return jax.jit(
    step_function(model, config, features),
    in_shardings=(state_shardings, sharding.data_sharding(config, mesh)),
    out_shardings=out_shardings,
    donate_argnums=0,
  )


def step_function(model, config, features):
  """train_step of this model, config and features as a function of (state, batch), checkified with max_checkify."""
  step = functools.partial(train_step, model, config, features)
  return _checkified(step, config) if config.max_checkify else step


def _checkified(step, config):
  """max_checkify: the step checks that every token id is in [0, vocab_size) (JAX clamps an out-of-bounds gather
  silently), and that no op makes a NaN or divides by zero (the error names the op and where it is)."""

  def checked_step(state, batch):
    for key in ("inputs", "targets"):
      ids = batch[key]
      in_range = jnp.all((ids >= 0) & (ids < config.vocab_size))
      checkify.check(in_range, f"a token id of the batch's {key} is outside [0, vocab_size={config.vocab_size})")
    return step(state, batch)

  # index_checks would cover every gather and scatter, but checkify cannot trace the batched scatter of
  # take_along_axis's gradient (an IndexError in jax 0.10): the token ids are what an input can put out of bounds.
  return checkify.checkify(checked_step, errors=checkify.user_checks | checkify.nan_checks | checkify.div_checks)


def jit_eval_step(model, config, features, mesh, state_shardings):
  """eval_step jitted on the train state (the features' slots live in it), not donated."""
  return jax.jit(
    functools.partial(eval_step, model, config, features),
    in_shardings=(state_shardings, sharding.data_sharding(config, mesh)),
    out_shardings=None,
  )
