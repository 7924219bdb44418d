"""PartitionSpecs for shard_map that fit the arrays: a dim keeps only the mesh axes whose product divides it.

A fractional per_device_batch_size trains on fewer rows than there are batch shards (the first rows of the loaded
batch), which the SPMD partitioner pads but shard_map cannot split: the kernels run under shard_map (flash, ring,
dropless MoE) shard the batch over the axes that divide it, and each row is then computed on the devices of the
axes left out.
"""

from jax.sharding import PartitionSpec


def as_tuple(spec_entry) -> tuple[str, ...]:
  """A PartitionSpec entry (None, an axis, or axes) as a tuple of axes."""
  if spec_entry is None:
    return ()
  return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def dividing_axes(axes, size: int, mesh_shape) -> tuple[str, ...]:
  """The mesh axes (of size > 1), in order, whose product divides `size`: how an array dim can be shard_mapped."""
  out, ways = [], 1
  for axis in axes:
    n = mesh_shape[axis]
    if n > 1 and size % (ways * n) == 0:
      out.append(axis)
      ways *= n
  return tuple(out)


def fit_batch(spec: PartitionSpec, rows: int, mesh_shape) -> PartitionSpec:
  """spec with its first (batch) entry cut to the axes that divide `rows`."""
  batch = dividing_axes(as_tuple(spec[0]), rows, mesh_shape)
  return PartitionSpec(batch or None, *spec[1:])
