"""The model and its train state, initialised directly onto their shardings (never whole on one device)."""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.training import train_state

from MaxText import optimizers, sharding
from MaxText.layers.models import Transformer


def create_model(config) -> Transformer:
  return Transformer(config)


def _init_boxed_state(model, tx, config, rng) -> train_state.TrainState:
  shape = (config.micro_batch_size_to_load, config.max_target_length)
  tokens = jnp.ones(shape, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
  variables = model.init({"params": rng, "dropout": rng}, tokens, positions)
  return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)


def get_abstract_state(model, tx, config, mesh):
  """Shape/dtype/sharding of the train state, with no memory allocated.

  Returns:
    (abstract_state, state_shardings): a TrainState of jax.ShapeDtypeStruct (each with its sharding),
    and the matching TrainState of NamedShardings.
  """
  init = functools.partial(_init_boxed_state, model, tx, config)
  with sharding.logical_context(mesh, config):
    boxed = jax.eval_shape(init, jax.random.PRNGKey(0))
  shardings = sharding.logical_to_shardings(boxed, mesh, config)
  sharding.check_divisible(nn.unbox(boxed).params, shardings.params, "parameter")
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings)
  return abstract, shardings


def init_train_state(model, tx, config, mesh, state_shardings) -> train_state.TrainState:
  """A fresh train state from config.init_weights_seed, created shard by shard on the devices."""

  def init(rng):
    return nn.unbox(_init_boxed_state(model, tx, config, rng))

  with sharding.logical_context(mesh, config):
    return jax.jit(init, out_shardings=state_shardings)(jax.random.PRNGKey(config.init_weights_seed))


class TrainSetup(NamedTuple):
  """What every entry point builds from the config: the model, the optimizer and the state's layout."""

  model: Transformer
  tx: object  # optax.GradientTransformation
  abstract_state: train_state.TrainState  # of jax.ShapeDtypeStruct
  state_shardings: train_state.TrainState  # of NamedSharding


def build(config, mesh) -> TrainSetup:
  """The model, the optimizer (with its learning-rate schedule) and the abstract, sharded train state."""
  model = create_model(config)
  tx = optimizers.create_optimizer(config, optimizers.create_learning_rate_schedule(config))
  abstract_state, state_shardings = get_abstract_state(model, tx, config, mesh)
  return TrainSetup(model, tx, abstract_state, state_shardings)
