"""Context parallelism: how the sequence is laid out when the mesh axes `sequence` and `context` shard it.

Both axes split every activation along the length. They differ inside attention:
- `sequence` splits the heads there (base.yml's rules give activation_heads the axis first), so each device attends
  over the whole sequence for its heads, and the tokens are never reordered;
- `context` keeps splitting the queries, with the strategy context_parallel_strategy: `all_gather` gathers the keys
  and values of the whole sequence for the local queries; `ring` passes key/value blocks around the axis
  (ring_attention.py), so that no device ever holds every key.

Load balance (context_parallel_load_balance, with context > 1): causal attention gives the last tokens the most work,
so before the model the sequence is cut into 2N chunks (N: the context size) and laid out as chunks 0, 2N-1, 1,
2N-2, ...: the shard d of N holds chunks d and 2N-1-d. The train step reorders every (batch, length) input with
`reorder`; the loss is a sum over tokens, which the order does not change. Attention masks by each token's original
index (`token_order`), so causality and sliding windows hold in the original order.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

AXIS = "context"  # the mesh axis that splits the queries inside attention


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """The sequence's layout under sharding.

  Attributes:
    context: the size of mesh axis context, which splits the queries inside attention (sequence splits the heads
      there, as activation_heads says in base.yml's rules).
    strategy: common_types.CONTEXT_PARALLEL_STRATEGIES; what attention does with other shards' keys.
    load_balance: the sequence is reordered into 2 x context chunks (context > 1 only).
  """

  context: int = 1
  strategy: str = "all_gather"
  load_balance: bool = False

  def token_order(self, length: int) -> np.ndarray:
    """(length,) int32: the original index of the token at each position of the layout the model sees."""
    if not self.load_balance:
      return np.arange(length, dtype=np.int32)
    chunks = np.arange(length, dtype=np.int32).reshape(2 * self.context, -1)
    order = [c for d in range(self.context) for c in (d, 2 * self.context - 1 - d)]
    return chunks[order].reshape(-1)

  @property
  def ring(self) -> bool:
    return self.context > 1 and self.strategy == "ring"


NONE = ContextParallel()


def mesh_size(config, axis: str) -> int:
  """The size of a mesh axis (ici x dcn) from the config; 1 for an axis the config's mesh_axes leaves out."""
  if axis not in config.mesh_axes:
    return 1
  i = config.mesh_axes.index(axis)
  return config.ici_parallelism[i] * config.dcn_parallelism[i]


def from_config(config) -> ContextParallel:
  context = mesh_size(config, AXIS)
  return ContextParallel(
    context=context,
    strategy=config.context_parallel_strategy,
    load_balance=context > 1 and config.context_parallel_load_balance,
  )


def roll(layout: ContextParallel, x, shift: int):
  """jnp.roll of x (B, T, ...) along the sequence in the data's order, for x in the layout the model sees."""
  if not layout.load_balance:
    return jnp.roll(x, shift, axis=1)
  order = layout.token_order(x.shape[1])
  in_data_order = jnp.take(x, np.argsort(order), axis=1)
  return jnp.take(jnp.roll(in_data_order, shift, axis=1), order, axis=1)


def in_data_order(layout: ContextParallel, x):
  """x (B, T, ...) in the layout the model sees -> in the data's order (the inverse of reorder)."""
  return x if not layout.load_balance else jnp.take(x, np.argsort(layout.token_order(x.shape[1])), axis=1)


def reorder(layout: ContextParallel, batch: dict) -> dict:
  """The batch's (batch, length) arrays in the layout the model sees (unchanged without load balancing)."""
  if not layout.load_balance:
    return batch
  return {name: jnp.take(x, layout.token_order(x.shape[1]), axis=1) for name, x in batch.items()}
