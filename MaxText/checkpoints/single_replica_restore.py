"""enable_single_replica_ckpt_restoring: each array of a persistent checkpoint is read by one data-parallel replica
(the devices at index 0 of mesh axis `data`) and broadcast to the other replicas over the interconnect, instead of
every replica reading the whole checkpoint from storage. Orbax's SingleReplicaArrayHandler reads and broadcasts.

The checkpoint format does not change: the run saves as always, and only its restore reads through this handler.
"""

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers

from MaxText import max_logging

REPLICA_AXIS = "data"


def replicas(mesh) -> int:
  return mesh.shape.get(REPLICA_AXIS, 1)


def handler(mesh) -> ocp.PyTreeCheckpointHandler:
  """A PyTree handler whose jax.Arrays are read by the first replica and broadcast to the others."""
  array_handler = type_handlers.SingleReplicaArrayHandler(
    replica_axis_index=list(mesh.axis_names).index(REPLICA_AXIS), broadcast_memory_limit_bytes=1 << 30
  )
  registry = type_handlers.create_type_handler_registry((jax.Array, array_handler))
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _first_replica(sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
  """The same PartitionSpec over the devices of replica 0 only (index 0 of the replica axis, kept as size 1)."""
  mesh = sharding.mesh
  axis = list(mesh.axis_names).index(REPLICA_AXIS)
  devices = np.take(np.asarray(mesh.devices), [0], axis=axis)
  return jax.sharding.NamedSharding(jax.sharding.Mesh(devices, mesh.axis_names), sharding.spec)


def restore_args(abstract_state):
  """Per-array SingleReplicaArrayRestoreArgs for an abstract state whose leaves carry their NamedShardings."""

  def one(leaf):
    if not isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding):
      return ocp.RestoreArgs()
    return type_handlers.SingleReplicaArrayRestoreArgs(
      sharding=leaf.sharding,
      single_replica_sharding=_first_replica(leaf.sharding),
      global_shape=leaf.shape,
      dtype=leaf.dtype,
    )

  return jax.tree.map(one, abstract_state)


def reader(config, abstract_state, state_item: str, other_handlers: dict):
  """A read-only CheckpointManager over the run's checkpoints whose `state_item` is read once per replica set, or None
  when enable_single_replica_ckpt_restoring is off or there is one replica."""
  if not config.enable_single_replica_ckpt_restoring:
    return None
  shardings = [leaf.sharding for leaf in jax.tree.leaves(abstract_state) if hasattr(leaf, "sharding")]
  mesh = shardings[0].mesh
  if replicas(mesh) == 1:
    max_logging.log("enable_single_replica_ckpt_restoring: one data-parallel replica, so every array is read once anyway")
    return None
  max_logging.log(
    f"enable_single_replica_ckpt_restoring: reading each array once per replica set ({replicas(mesh)} data-parallel "
    "replicas; the first reads, the others receive it)"
  )
  handlers = {state_item: handler(mesh), **other_handlers}
  options = ocp.CheckpointManagerOptions(read_only=True, create=False)
  return ocp.CheckpointManager(config.checkpoint_dir, item_handlers=handlers, options=options)
