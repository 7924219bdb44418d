"""The model and its train state, initialised directly onto their shardings (never whole on one device)."""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from flax.training import train_state

from MaxText import dpo, lora_training, memory_check, optimizers, routing_bias, sharding
from MaxText.diagnostics import numerics_taps
from MaxText.layers import lora, quantizations
from MaxText.layers.linears import Gemm
from MaxText.layers.models import Transformer


class Fp8TrainState(train_state.TrainState):
  """The train state of quantization=fp8: also each fp8 dense layer's scales and amax histories (`fp8_meta`),
  which the step replaces by their new values (quantizations) instead of optimizing them."""

  fp8_meta: dict = struct.field(default_factory=dict)


def create_model(config) -> Transformer:
  """The model, its dense layers quantized as the config says and tapped when the run collects numerics statistics."""
  tap = numerics_taps.dot_general if config.numerics_debug.collects_stats else None
  return Transformer(config, Gemm(quant=quantizations.from_config(config), tap=tap, lora=lora.from_config(config)))


def _init_boxed_state(model, tx, config, rng) -> train_state.TrainState:
  shape = (config.micro_batch_size_to_load, config.max_target_length)
  tokens = jnp.ones(shape, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
  variables = model.init({"params": rng, "dropout": rng}, tokens, positions)
  if quantizations.FP8_COLLECTION in variables:
    fp8_meta = variables[quantizations.FP8_COLLECTION]
    return Fp8TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx, fp8_meta=fp8_meta)
  if config.use_dpo and not config.enable_lora:  # the reference is a frozen copy (dpo.with_starting_reference)
    params = variables["params"]
    return dpo.DpoTrainState.create(apply_fn=model.apply, params=params, tx=tx, reference_params=params)
  return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)


def get_abstract_state(model, tx, config, mesh):
  """Shape/dtype/sharding of the train state, with no memory allocated.

  Returns:
    (abstract_state, state_shardings): a TrainState of jax.ShapeDtypeStruct (each with its sharding),
    and the matching TrainState of NamedShardings.
  """
  init = functools.partial(_init_boxed_state, model, tx, config)
  rng = jax.random.PRNGKey(0)  # outside the mesh: an AOT target's devices cannot hold arrays
  with sharding.logical_context(mesh, config):
    boxed = jax.eval_shape(init, rng)
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


def build(
  config, mesh, params_only: bool = False, memory_limit_bytes: int | None = None, check_memory: bool = True
) -> TrainSetup:
  """The model, the optimizer (with its learning-rate schedule) and the abstract, sharded train state.

  Checks, before anything is allocated, that what the caller will allocate fits a device.

  Args:
    config: the Config.
    mesh: the device mesh (or an AOT target's).
    params_only: the caller allocates only the params (decoding, checkpoint conversion), so only they must fit,
      not the optimizer state that training adds (Adam keeps two more copies).
    memory_limit_bytes: one device's memory to check against; default: what a local device has.
    check_memory: False leaves the verdict to the caller (train_compile.py reports on the compiled step instead).
  """
  model = create_model(config)
  tx = optimizers.create_optimizer(config, optimizers.create_learning_rate_schedule(config))
  if routing_bias.present(config):
    tx = routing_bias.keep_out_of_optimizer(tx)
  if config.enable_lora:
    tx = lora_training.train_adapters_only(tx)
  abstract_state, state_shardings = get_abstract_state(model, tx, config, mesh)
  if config.enable_lora:
    lora_training.check_selects_layers(config, abstract_state.params)
  if check_memory:
    check_state_fits(abstract_state, params_only, memory_limit_bytes)
  return TrainSetup(model, tx, abstract_state, state_shardings)


def check_state_fits(abstract_state, params_only: bool = False, memory_limit_bytes: int | None = None) -> None:
  """A clear error when the params (+ optimizer state unless params_only) alone exceed a device's memory.

  Args:
    abstract_state: a TrainState of sharded jax.ShapeDtypeStructs.
    params_only: count only abstract_state.params.
    memory_limit_bytes: one device's memory; default: what a local device has.
  """
  device = jax.local_devices()[0]
  limit = memory_check.device_memory_bytes(device) if memory_limit_bytes is None else memory_limit_bytes
  if params_only:
    what, advice = "the params need", "shard them over more devices (ici_fsdp_parallelism) or use a smaller model"
  else:
    what = "the train state (params and optimizer state) needs"
    advice = "shard it over more devices (ici_fsdp_parallelism), use a smaller model, or weight_dtype=bfloat16"
  needed = memory_check.bytes_per_device(abstract_state.params if params_only else abstract_state)
  memory_check.check_fits(needed, limit, what=what, device_kind=device.device_kind, advice=advice)
