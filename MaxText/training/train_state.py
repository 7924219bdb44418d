"""The train state (one type for every run) and its initialisation, directly onto its shardings.

The state is the params, the optimizer state, the step, and the features' slots (MaxText/feature_protocol.py: a feature's
own state, such as a frozen copy of the model or scales that no optimizer moves). A checkpoint holds it as one tree
whose top level names step, params, opt_state and each slot, so a run restores whatever features wrote it, and
checkpoints of the former per-feature state classes (which had the same top-level names) restore unchanged.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.tree_util import GetAttrKey

from MaxText import feature_protocol
from MaxText.runtime import sharding

_CORE = ("step", "params", "opt_state")


@jax.tree_util.register_pytree_with_keys_class
class TrainState:
  """params, opt_state, step and slots ({name: pytree}, which no optimizer touches); tx is static."""

  def __init__(self, step, params, opt_state, tx: optax.GradientTransformation, slots: dict | None = None):
    self.step, self.params, self.opt_state, self.tx = step, params, opt_state, tx
    self.slots = dict(slots or {})
    clash = set(self.slots) & set(_CORE)
    assert not clash, f"a feature's slot may not be named {clash}"

  @classmethod
  def create(cls, params, tx: optax.GradientTransformation, slots: dict | None = None) -> "TrainState":
    return cls(jnp.asarray(0, jnp.int32), params, tx.init(params), tx, slots)

  def replace(self, **changes) -> "TrainState":
    fields = {"step": self.step, "params": self.params, "opt_state": self.opt_state, "tx": self.tx, "slots": self.slots}
    unknown = set(changes) - set(fields)
    assert not unknown, f"TrainState has no field {unknown}"
    return TrainState(**(fields | changes))

  def with_slot(self, name: str, value) -> "TrainState":
    return self.replace(slots=self.slots | {name: value})

  def apply_gradients(self, grads) -> "TrainState":
    """One optimizer update: the params move by tx's updates, the step counts one more."""
    updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
    return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates), opt_state=opt_state)

  def tree_flatten_with_keys(self):
    names = tuple(sorted(self.slots))
    children = [(GetAttrKey(n), getattr(self, n)) for n in _CORE] + [(GetAttrKey(n), self.slots[n]) for n in names]
    return children, (self.tx, names)

  @classmethod
  def tree_unflatten(cls, aux, children) -> "TrainState":
    tx, names = aux
    step, params, opt_state, *slots = children
    return cls(step, params, opt_state, tx, dict(zip(names, slots)))

  def __eq__(self, other) -> bool:
    fields = lambda s: (s.step, s.params, s.opt_state, s.tx, s.slots)  # pylint: disable=unnecessary-lambda-assignment
    return isinstance(other, TrainState) and fields(self) == fields(other)

  __hash__ = None  # mutable-looking: equal states need not hash alike

  def __repr__(self) -> str:
    return f"TrainState(step={self.step!r}, slots={sorted(self.slots)})"


def _init_variables(model, config, rng) -> dict:
  """model.init's variables, boxed with their logical axis names."""
  shape = (config.micro_batch_size_to_load, config.max_target_length)
  tokens = jnp.ones(shape, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
  return model.init({"params": rng, "dropout": rng}, tokens, positions)


def logical_param_axes(model, config, mesh):
  """The params' logical axis names (a tree of PartitionSpecs; None where a dim has no name), from an abstract init:
  nothing is allocated."""
  with sharding.logical_context(mesh, config):
    boxed = jax.eval_shape(functools.partial(_init_variables, model, config), jax.random.PRNGKey(0))
  return nn.get_partition_spec(boxed["params"])


def _init_boxed_state(model, tx, features, config, rng) -> TrainState:
  variables = _init_variables(model, config, rng)
  slots = {}
  for feature in features:
    slots.update(feature.slots(variables))
  return TrainState.create(variables["params"], tx, slots)


def get_abstract_state(model, tx, features, config, mesh):
  """Shape/dtype/sharding of the train state, with no memory allocated.

  Returns:
    (abstract_state, state_shardings): a TrainState of jax.ShapeDtypeStruct (each with its sharding),
    and the matching TrainState of NamedShardings.
  """
  init = functools.partial(_init_boxed_state, model, tx, features, config)
  rng = jax.random.PRNGKey(0)  # outside the mesh: an AOT target's devices cannot hold arrays
  with sharding.logical_context(mesh, config):
    boxed = jax.eval_shape(init, rng)
  shardings = sharding.logical_to_shardings(boxed, mesh, config)
  sharding.check_divisible(nn.unbox(boxed).params, shardings.params, "parameter")
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings)
  return abstract, shardings


def init_train_state(model, tx, features, config, mesh, state_shardings) -> TrainState:
  """A fresh train state from config.init_weights_seed, created shard by shard on the devices."""

  def init(rng):
    return nn.unbox(_init_boxed_state(model, tx, features, config, rng))

  with sharding.logical_context(mesh, config):
    return jax.jit(init, out_shardings=state_shardings)(jax.random.PRNGKey(config.init_weights_seed))


def saved(features, state: Any):
  """The part of a state (or its abstract shape) that checkpoints hold: each feature's `saved` applied."""
  return feature_protocol.apply_all(features, "saved", state)


def logical(features, state: Any):
  """A state in the order the model and checkpoints see it, from the run's own (each feature's `logical`)."""
  return feature_protocol.apply_all_reversed(features, "logical", state)
