"""Ring attention: exact attention over a sequence sharded on a mesh axis (context parallelism), pure JAX.

Each device holds a chunk of the queries, keys and values. The key/value block, with its segment ids and the
original token indices, travels around the ring (ppermute i -> i+1 over `axis_name`); at each of the N steps
the local queries attend to the block they hold and fold it into an online softmax (running max, running
sum, unnormalised output). The mask uses the original token indices, so a load-balanced reordering of the
sequence before sharding (device d holding chunks d and 2N-1-d) gives the same result as the plain order.

The backward (custom_vjp) saves only the local q, k, v, out and the log-sum-exp, and runs the ring again:
the key/value block travels with its dk, dv accumulators; each step recomputes the block's probabilities
p = exp(s - lse), adds its part of dq locally and of dk, dv to the travelling accumulators, which are back
home after N hops. No device ever holds more than one remote key/value block: memory is O(local chunk).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.layers import context_parallel, mesh_specs
from MaxText.layers.attention_masks import MASK_VALUE, soft_cap


def sharded_ring_attention(
  query,
  key,
  value,
  segment_ids,
  sliding_window: int = 0,
  logits_soft_cap: float = 0.0,
  *,
  layout: context_parallel.ContextParallel,
):
  """context_parallel_strategy=ring for global arrays (shapes as dot_product_attention), laid out as `layout` says.

  Runs ring_attention under shard_map over the mesh axes of the logical rules: the queries' length over `context`
  (config: sequence parallelism is 1 with ring), the batch and heads as the rules split them.
  """
  mesh = jax.sharding.get_abstract_mesh()
  rows, shape = query.shape[0], dict(mesh.shape)
  q_spec = nn.logical_to_mesh_axes(("activation_batch", "activation_length", "activation_heads", None))
  kv_spec = nn.logical_to_mesh_axes(("activation_kv_batch", "activation_length", "activation_kv_heads", None))
  q_spec, kv_spec = mesh_specs.fit_batch(q_spec, rows, shape), mesh_specs.fit_batch(kv_spec, rows, shape)
  rows_spec = P(q_spec[0], q_spec[1])
  token_index = jnp.broadcast_to(layout.token_order(query.shape[1]), segment_ids.shape)
  local = functools.partial(
    ring_attention, axis_name=context_parallel.AXIS, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap
  )
  # check_vma off: a kv head replicated over an axis that splits the query heads (see ring_attention's Args).
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(q_spec, kv_spec, kv_spec, rows_spec, rows_spec),
    out_specs=q_spec,
    check_vma=False,
  )(query, key, value, segment_ids, token_index)


def ring_attention(
  query, key, value, segment_ids, token_index, *, axis_name, sliding_window=0, logits_soft_cap=0.0, float32_logits=True
):
  """dot_product_attention on the whole sequence, for the local chunk of it; call inside shard_map.

  Args:
    query: (b, c, Nq, D) local queries, already scaled by 1/sqrt(D).
    key, value: (b, c, Nkv, D) and (b, c, Nkv, Dv) local keys/values, Nq a multiple of Nkv (grouped-query
      attention); Dv may differ from D (multi-head latent attention).
    segment_ids: (b, c) packed-segment ids of the local tokens (0 = padding).
    token_index: (b, c) int, the original position of each local token in the whole sequence.
    axis_name: the mesh axis the sequence is sharded over (manual in the enclosing shard_map). Other manual axes
      are local dims; under check_vma, keys and values must vary over them as the queries do (kv heads split
      with the query heads; a replicated kv head needs check_vma=False, whose transpose sums its gradient).
    sliding_window: > 0 limits each query to that many most recent keys (itself included).
    logits_soft_cap: > 0 caps the logits with soft_cap before masking.
    float32_logits: logits and softmax statistics in float32.
  Returns:
    (b, c, Nq, Dv) in query's dtype.
  """
  options = (axis_name, sliding_window, logits_soft_cap, float32_logits)
  return _ring_attention(query, key, value, segment_ids, token_index, options)


def _block_logits(q, k, q_seg, k_seg, q_idx, k_idx, options):
  """Masked logits of the local queries against one key block, and the soft cap's tanh (for the backward).

  q: (b, t, Nkv, G, D); k: (b, s, Nkv, D). Returns (b, Nkv, G, t, s) logits, tanh or None, mask.
  """
  _, sliding_window, cap, float32_logits = options
  logits = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32 if float32_logits else None)
  tanh = None
  if cap > 0:
    logits = soft_cap(logits, cap)
    tanh = logits / cap
  mask = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_idx[:, None, :] <= q_idx[:, :, None])  # (b, t, s)
  if sliding_window > 0:
    mask &= q_idx[:, :, None] - k_idx[:, None, :] < sliding_window
  mask = mask[:, None, None]  # (b, 1, 1, t, s)
  return jnp.where(mask, logits, MASK_VALUE), tanh, mask


def _shift(axis_name, *xs):
  """Sends each array to the next device of the ring."""
  size = jax.lax.axis_size(axis_name)
  return jax.lax.ppermute(xs, axis_name, perm=[(i, (i + 1) % size) for i in range(size)])


def _grouped(query, num_kv):
  b, c, num_q, d = query.shape
  return query.reshape(b, c, num_kv, num_q // num_kv, d)  # (b, c, Nkv, G, D)


def _forward(query, key, value, segment_ids, token_index, options):
  axis_name, float32_logits = options[0], options[3]
  q = _grouped(query, key.shape[2])
  stat_dtype = jnp.float32 if float32_logits else query.dtype
  # Derived from q so that the loop carries are varying over the same manual axes as the blocks.
  acc = jnp.zeros_like(q[..., :1], jnp.float32).transpose(0, 2, 3, 1, 4) * jnp.zeros(value.shape[-1:])  # (.., t, Dv)
  row_max = jnp.full_like(acc[..., 0], MASK_VALUE, stat_dtype)  # (b, Nkv, G, t)
  row_sum = jnp.zeros_like(row_max)

  def step(block, stats):
    k, v, k_seg, k_idx = block
    row_max, row_sum, acc = stats
    logits, _, _ = _block_logits(q, k, segment_ids, k_seg, token_index, k_idx, options)
    new_max = jnp.maximum(row_max, logits.max(-1).astype(stat_dtype))
    # A block with nothing visible to a row adds exp(0) per key at row_max = MASK_VALUE; the first visible key
    # (a token always sees itself) rescales that to exactly 0, as in the reference's softmax.
    p = jnp.exp(logits - new_max[..., None].astype(logits.dtype))
    alpha = jnp.exp(row_max - new_max)
    row_sum = alpha * row_sum + p.sum(-1).astype(stat_dtype)
    pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return new_max, row_sum, alpha[..., None].astype(jnp.float32) * acc + pv

  def body(_, carry):
    block, stats = carry
    return _shift(axis_name, *block), step(block, stats)

  block = (key, value, segment_ids, token_index)
  block, stats = jax.lax.fori_loop(0, jax.lax.axis_size(axis_name) - 1, body, (block, (row_max, row_sum, acc)))
  row_max, row_sum, acc = step(block, stats)  # the last block needs no send
  out = acc / row_sum[..., None].astype(jnp.float32)  # (b, Nkv, G, t, Dv)
  out = out.transpose(0, 3, 1, 2, 4).reshape(*query.shape[:-1], value.shape[-1]).astype(query.dtype)
  lse = row_max.astype(jnp.float32) + jnp.log(row_sum.astype(jnp.float32))
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring_attention(query, key, value, segment_ids, token_index, options):
  return _forward(query, key, value, segment_ids, token_index, options)[0]


def _ring_attention_fwd(query, key, value, segment_ids, token_index, options):
  out, lse = _forward(query, key, value, segment_ids, token_index, options)
  return out, (query, key, value, segment_ids, token_index, out, lse)


def _ring_attention_bwd(options, residuals, dout):
  query, key, value, segment_ids, token_index, out, lse = residuals
  axis_name = options[0]
  num_kv = key.shape[2]
  q, do = _grouped(query, num_kv), _grouped(dout, num_kv)
  # delta_t = sum_d dout * out = sum_s p_ts dp_ts, the softmax's correction term.
  delta = jnp.einsum("btkgd,btkgd->bkgt", do.astype(jnp.float32), _grouped(out, num_kv).astype(jnp.float32))

  def step(block, dq):
    k, v, k_seg, k_idx, dk, dv = block
    logits, tanh, mask = _block_logits(q, k, segment_ids, k_seg, token_index, k_idx, options)
    p = jnp.exp(logits.astype(jnp.float32) - lse[..., None])  # (b, Nkv, G, t, s)
    dv += jnp.einsum("bkgts,btkgd->bskd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("btkgd,bskd->bkgts", do, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None])
    if tanh is not None:
      ds *= 1 - jnp.square(tanh.astype(jnp.float32))  # d soft_cap(x) / dx
    ds = jnp.where(mask, ds, 0.0).astype(q.dtype)  # masked logits are constants in the reference
    dq += jnp.einsum("bkgts,bskd->btkgd", ds, k, preferred_element_type=jnp.float32)
    dk += jnp.einsum("bkgts,btkgd->bskd", ds, q, preferred_element_type=jnp.float32)
    return (k, v, k_seg, k_idx, dk, dv), dq

  def body(_, carry):
    block, dq = carry
    block, dq = step(block, dq)
    return _shift(axis_name, *block), dq

  block = (key, value, segment_ids, token_index, jnp.zeros_like(key, jnp.float32), jnp.zeros_like(value, jnp.float32))
  block, dq = jax.lax.fori_loop(0, jax.lax.axis_size(axis_name) - 1, body, (block, jnp.zeros_like(q, jnp.float32)))
  (*_, dk, dv), dq = step(block, dq)
  dk, dv = _shift(axis_name, dk, dv)  # N hops in all: each block's gradients are back on its device
  return dq.reshape(query.shape).astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), None, None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)
