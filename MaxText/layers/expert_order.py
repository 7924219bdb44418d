"""Sorting a device's (token, choice) pairs by expert and back, with gradients that gather instead of scatter.

A gather's gradient is a scatter-add, for which the TPU compiler keeps buffers as large as the pairs: on DeepSeek-V3
(6 rows of 8192 tokens a device, 8 choices a token) each one is 5.25 GiB. Both moves here are permutations (the
first one of each token repeated k times), so their gradients are gathers by the inverse permutation (upstream
MaxText's `use_custom_sort_vjp`).
"""

import functools

import jax
import jax.numpy as jnp


class Order:
  """The pairs' order: `order[r]` is the flat (token * k + choice) index of sorted row r; `inverse` undoes it."""

  def __init__(self, flat_experts, k: int):
    # Unsigned, so that indexing adds no negative-index check: under the pipeline's vmap over stage, inside shard_map,
    # that comparison of a stage-varying index with a constant fails the custom VJP's varying-axes check.
    self.order = jnp.argsort(flat_experts, stable=True).astype(jnp.uint32)
    self.inverse = jnp.argsort(self.order).astype(jnp.uint32)
    self.k = k


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _repeat_sorted(x, order, inverse, k: int):
  return x[order // k]


def _repeat_sorted_fwd(x, order, inverse, k):
  return x[order // k], inverse


def _repeat_sorted_bwd(k, inverse, g):
  per_choice = g[inverse].reshape(-1, k, g.shape[-1])  # (token, choice, D)
  return per_choice.sum(axis=1), None, None


_repeat_sorted.defvjp(_repeat_sorted_fwd, _repeat_sorted_bwd)


@jax.custom_vjp
def _permuted(x, perm, inverse):
  return x[perm]


def _permuted_fwd(x, perm, inverse):
  return x[perm], inverse


def _permuted_bwd(inverse, g):
  return g[inverse], None, None


_permuted.defvjp(_permuted_fwd, _permuted_bwd)


def sorted_pairs(x, order: Order):
  """x (n, D), one row per token -> (n * k, D): each token once per choice, sorted by expert."""
  return _repeat_sorted(x, order.order, order.inverse, order.k)


def unsorted_pairs(rows, order: Order):
  """(n * k, D) rows sorted by expert -> (n * k, D) in (token, choice) order."""
  return _permuted(rows, order.inverse, order.order)
