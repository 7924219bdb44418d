"""Logical axis names -> mesh shardings, through config.logical_axis_rules."""

import contextlib

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec


@contextlib.contextmanager
def logical_context(mesh, config):
  """Mesh and logical axis rules for tracing model code (its activation constraints use both)."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    yield


def logical_to_shardings(boxed_tree, mesh, config):
  """NamedShardings for a tree whose leaves carry logical axis names (nn.LogicallyPartitioned boxes).

  The result has the structure of nn.unbox(boxed_tree); unannotated leaves are replicated.
  """
  specs = nn.get_partition_spec(boxed_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, config.logical_axis_rules)


def data_sharding(config, mesh) -> NamedSharding:
  """Sharding of (batch, length) input arrays: the batch over config.data_sharding's mesh axes."""
  return NamedSharding(mesh, PartitionSpec(*config.data_sharding))
