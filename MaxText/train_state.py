"""The model and its train state, initialised directly onto their shardings (never whole on one device)."""

import functools
import math
import os
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.training import train_state

from MaxText import optimizers, sharding
from MaxText.errors import UserError
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
  check_state_fits(abstract_state)
  return TrainSetup(model, tx, abstract_state, state_shardings)


def _device_memory_bytes(device) -> int | None:
  stats = device.memory_stats()
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  if device.platform == "cpu":  # CPU devices share the host's memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(jax.local_device_count(), 1)
  return None


def check_state_fits(abstract_state) -> None:
  """A clear error, before anything is allocated, when params + optimizer state alone exceed a device's memory."""
  per_device = sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for x in jax.tree.leaves(abstract_state)
    if hasattr(x, "sharding")
  )
  device = jax.local_devices()[0]
  limit = _device_memory_bytes(device)
  if limit is not None and per_device > limit:
    raise UserError(
      f"the train state (params and optimizer state) needs {per_device / 2**30:.1f} GiB per device but a "
      f"{device.device_kind} device has {limit / 2**30:.1f} GiB: shard it over more devices (ici_fsdp_parallelism), "
      "use a smaller model, or weight_dtype=bfloat16"
    )
