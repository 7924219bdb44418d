"""What every entry point builds from the config: the run's features, the model, the optimizer and the train state's
layout. This is where the features (features/selection.py) meet the core, which takes them as an argument."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText import feature_protocol
from MaxText.features import selection
from MaxText.layers import remat
from MaxText.layers.linears import Gemm
from MaxText.layers.models import Transformer
from MaxText.runtime import memory_check
from MaxText.training import optimizers, train_state


def create_model(config, features=None) -> Transformer:
  """The model, its dense layers multiplying as the features say (quantized, tapped, adapted)."""
  features = selection.for_config(config) if features is None else features
  return Transformer(config, feature_protocol.apply_all(features, "gemm", Gemm()))


class TrainSetup(NamedTuple):
  """The run's parts."""

  model: Transformer
  tx: object  # optax.GradientTransformation
  features: tuple  # of features.protocol.Feature
  abstract_state: train_state.TrainState  # of jax.ShapeDtypeStruct
  state_shardings: train_state.TrainState  # of NamedSharding

  def init_state(self, config, mesh) -> train_state.TrainState:
    """A fresh train state (config.init_weights_seed) on its shardings."""
    return train_state.init_train_state(self.model, self.tx, self.features, config, mesh, self.state_shardings)


def build(
  config, mesh, params_only: bool = False, memory_limit_bytes: int | None = None, check_memory: bool = True
) -> TrainSetup:
  """The features, the model, the optimizer (with its learning-rate schedule) and the abstract, sharded train state.

  Checks, before anything is allocated, that what the caller will allocate fits a device.

  Args:
    config: the Config.
    mesh: the device mesh (or an AOT target's).
    params_only: the caller allocates only the params (decoding, checkpoint conversion), so only they must fit,
      not the optimizer state that training adds (Adam keeps two more copies).
    memory_limit_bytes: one device's memory to check against; default: what a local device has.
    check_memory: False leaves the verdict to the caller (train_compile.py reports on the compiled step instead).
  """
  features = selection.for_config(config)
  model = create_model(config, features)
  schedule = optimizers.create_learning_rate_schedule(config)
  tx = optimizers.create_optimizer(config, schedule, lambda: train_state.logical_param_axes(model, config, mesh))
  tx = feature_protocol.apply_all(features, "optimizer", tx)
  abstract_state, state_shardings = train_state.get_abstract_state(model, tx, features, config, mesh)
  if config.remat_policy == "custom":
    tokens = jax.ShapeDtypeStruct((1, config.max_target_length), jnp.int32)
    forward = lambda params, t: model.apply({"params": params}, t, t, t)  # noqa: E731  (tokens, positions, segments)
    remat.check_names(config, remat.produced_names(forward, abstract_state.params, tokens))
  for feature in features:
    feature.bind_params(abstract_state.params)
    feature.bind_state(abstract_state)
  if check_memory:
    check_state_fits(abstract_state, params_only, memory_limit_bytes)
  return TrainSetup(model, tx, features, abstract_state, state_shardings)


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
