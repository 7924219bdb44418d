"""Logical axis names -> mesh shardings, through config.logical_axis_rules."""

import contextlib
import math

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec

from MaxText.errors import UserError


@contextlib.contextmanager
def logical_context(mesh, config):
  """Mesh and logical axis rules for tracing model code (its activation constraints use both)."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    yield


def logical_to_shardings(boxed_tree, mesh, config):
  """NamedShardings for a tree whose leaves carry logical axis names (nn.LogicallyPartitioned boxes).

  The result has the structure of nn.unbox(boxed_tree); unannotated leaves are replicated. A box around no array
  (optax's MaskedNode, where an optimizer that partitions the params, as Muon's, leaves one out of a part's state)
  has nothing to shard and stays as it is.
  """
  boxed_tree = jax.tree.map(_unbox_if_empty, boxed_tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
  specs = nn.get_partition_spec(boxed_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, config.logical_axis_rules)


def _unbox_if_empty(x):
  return x.unbox() if isinstance(x, nn.meta.AxisMetadata) and not jax.tree.leaves(x.unbox()) else x


def data_sharding(config, mesh) -> NamedSharding:
  """Sharding of (batch, length) input arrays: the batch over config.data_sharding's mesh axes."""
  return NamedSharding(mesh, PartitionSpec(*config.data_sharding))


def check_divisible(abstract_tree, shardings, what: str) -> None:
  """Raises a UserError for the first array dimension that its mesh axes cannot split evenly."""
  flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  for (path, leaf), named in zip(jax.tree_util.tree_flatten_with_path(abstract_tree)[0], flat_shardings):
    mesh_shape = dict(named.mesh.shape)
    for dim, axes in enumerate(named.spec):
      axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
      ways = math.prod(mesh_shape[a] for a in axes)
      if leaf.shape[dim] % ways:
        raise UserError(
          f"{what} {jax.tree_util.keystr(path)} of shape {tuple(leaf.shape)}: dimension {dim} ({leaf.shape[dim]}) cannot be "
          f"split {ways} ways over mesh axes {list(axes)}; change the ici_*/dcn_* parallelism or the model dims"
        )
