"""attention=flash: the Pallas splash-attention kernel for TPU, run per shard under shard_map.

The batch and head axes are split as the logical axis rules say (activation_batch, activation_heads). When the
sequence is split too (mesh axes sequence and context), each device keeps its queries and gathers every key and
value (all_gather context parallelism); the kernel's mask is then cut into the query shards (splash's q_seq_shards),
and with load balancing it masks by each query's original index (context_parallel.token_order).
`interpret=True` runs the same kernel on the CPU (slowly), for tests.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from MaxText.layers import context_parallel, mesh_specs

_MAX_BLOCK = 512


class _OrderedCausalMask(splash_mask._ComputableMask):  # pylint: disable=protected-access
  """Causal (and local, with a window) over keys in the original order, for queries laid out in `order`: the query
  at row r is the token order[r] of the sequence (load-balanced context parallelism)."""

  def __init__(self, order: np.ndarray, sliding_window: int, chunk: int = 0):
    self.order, self.sliding_window, self.chunk = order, sliding_window, chunk

    def visible(q_ids, kv_ids):  # q_ids: original indices (from q_sequence); runs on numpy and in the kernel
      allowed = q_ids >= kv_ids
      if sliding_window > 0:
        allowed &= q_ids - kv_ids < sliding_window
      if chunk > 0:
        allowed &= q_ids // chunk == kv_ids // chunk
      return allowed

    super().__init__(shape=(len(order), len(order)), mask_function=visible)
    self.q_sequence = order

  def __eq__(self, other):
    return isinstance(other, _OrderedCausalMask) and (self.sliding_window, self.chunk, self.order.tobytes()) == (
      other.sliding_window,
      other.chunk,
      other.order.tobytes(),
    )

  def __hash__(self):
    return hash((type(self), self.sliding_window, self.chunk, self.order.tobytes()))


def _kernel(
  num_heads: int,
  length: int,
  sliding_window: int,
  logits_soft_cap: float,
  interpret: bool,
  order: np.ndarray | None = None,
  q_shards: int = 1,
  chunk: int = 0,
):
  """The splash kernel for `length` tokens whose queries are split into q_shards; `order`: the queries' original
  indices when they are reordered (else None)."""
  block = min(_MAX_BLOCK, length // q_shards)
  sizes = splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  if order is not None:
    head_mask = _OrderedCausalMask(order, sliding_window, chunk)
  elif chunk > 0:  # causal within chunks of `chunk` tokens (Llama 4)
    head_mask = splash_mask.ChunkedCausalMask((length, length), chunk_size=chunk)
  elif sliding_window > 0:  # causal, and t - s < sliding_window
    head_mask = splash_mask.LocalMask((length, length), window_size=(sliding_window - 1, 0), offset=0)
  else:
    head_mask = splash_mask.CausalMask((length, length))
  mask = splash_mask.MultiHeadMask([head_mask for _ in range(num_heads)])
  return splash.make_splash_mha(
    mask,
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=q_shards,
    attn_logits_soft_cap=logits_soft_cap or None,
    interpret=interpret,
  )


def _local_attention(kernel, query, key, value, q_segment_ids, kv_segment_ids, sinks=None):
  """One shard: (b, Tq, nq, D) queries, (b, T, nkv, D) keys/values, sinks None or (nq,) -> (b, Tq, nq, D)."""
  to_heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # (b, T, n, D) <-> (b, n, T, D)

  def one_example(q, k, v, q_seg, kv_seg):
    return kernel(q, k, v, segment_ids=splash.SegmentIds(q=q_seg, kv=kv_seg), sinks=sinks)

  out = jax.vmap(one_example)(
    to_heads_first(query), to_heads_first(key), to_heads_first(value), q_segment_ids, kv_segment_ids
  )
  return to_heads_first(out)


def _compiles_for_cpu(mesh) -> bool:
  """Whether the program is compiled for CPU devices: then the kernel runs in the Pallas interpreter (tests).

  The mesh's devices decide, not the local backend: an AOT compile on a CPU host for a TPU target
  (train_compile.py) must compile the real TPU kernel.
  """
  platform = jax.default_backend() if mesh.empty else mesh.abstract_device.platform
  return platform == "cpu"


def _mesh_ways(mesh, axes) -> int:
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return int(np.prod([mesh.shape[a] for a in axes]))


def flash_attention(
  query,
  key,
  value,
  segment_ids,
  sliding_window: int = 0,
  logits_soft_cap: float = 0.0,
  interpret: bool | None = None,
  layout: context_parallel.ContextParallel = context_parallel.NONE,
  chunk: int = 0,
  sinks=None,
):
  """Causal, segment-masked attention with the splash kernel. Shapes and options as dot_product_attention.

  Args:
    sinks: None, or (Nq,) attention sinks, which splash takes (split over the heads as the queries).
    interpret: run the Pallas interpreter; default: only when compiling for CPU devices.
    layout: how the sequence is laid out (context_parallel); its token order when load-balanced.
  """
  mesh = jax.sharding.get_abstract_mesh()
  interpret = _compiles_for_cpu(mesh) if interpret is None else interpret
  length, num_heads = query.shape[1], query.shape[2]
  make = functools.partial(
    _kernel, length=length, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, chunk=chunk
  )
  make = functools.partial(make, interpret=interpret)
  if mesh.empty:
    return _local_attention(make(num_heads), query, key, value, segment_ids, segment_ids, sinks)
  rows, shape = query.shape[0], dict(mesh.shape)
  q_spec = nn.logical_to_mesh_axes(("activation_batch", "activation_length", "activation_heads", None))
  q_spec = mesh_specs.fit_batch(q_spec, rows, shape)
  # Keys and values whole along the length (gathered), their heads split as the queries' (resolved with the length
  # named, so that a rule like activation_kv_heads: [tensor, sequence] does not take the sequence axis for heads).
  kv_spec = nn.logical_to_mesh_axes(("activation_kv_batch", "activation_length", "activation_kv_heads", None))
  kv_spec = mesh_specs.fit_batch(P(kv_spec[0], None, *kv_spec[2:]), rows, shape)
  local_heads = num_heads // _mesh_ways(mesh, q_spec[2])
  q_shards = _mesh_ways(mesh, q_spec[1])
  if q_shards == 1:  # the sequence is whole on every device: the kernel is made per shard

    def whole(q, k, v, seg, *sink):
      return _local_attention(make(local_heads), q, k, v, seg, seg, *sink)

    sink_args, sink_specs = ((sinks,), (P(q_spec[2]),)) if sinks is not None else ((), ())
    in_specs = (q_spec, kv_spec, kv_spec, P(q_spec[0], None), *sink_specs)
    return jax.shard_map(whole, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(
      query, key, value, segment_ids, *sink_args
    )
  # The queries stay split over the length; keys, values and their segment ids are gathered (kv_spec), and put back
  # in the original order, which the mask's key indices are.
  order = layout.token_order(length) if layout.load_balance else None
  kernel = make(local_heads, order=order, q_shards=q_shards)
  kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(None, q_spec[1])))
  to_original = np.argsort(order) if order is not None else None

  def local(kernel, q, k, v, q_seg, kv_seg, *sink):
    if to_original is not None:
      k, v, kv_seg = (jnp.take(x, to_original, axis=1) for x in (k, v, kv_seg))
    return _local_attention(kernel, q, k, v, q_seg, kv_seg, *sink)

  sink_args, sink_specs = ((sinks,), (P(q_spec[2]),)) if sinks is not None else ((), ())
  in_specs = (kernel_spec, q_spec, kv_spec, kv_spec, P(q_spec[0], q_spec[1]), P(kv_spec[0], None), *sink_specs)
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(
    kernel, query, key, value, segment_ids, segment_ids, *sink_args
  )
