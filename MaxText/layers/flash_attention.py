"""attention=flash: the Pallas splash-attention kernel for TPU, run per shard under shard_map.

The batch and head axes are split as the logical axis rules say (activation_batch, activation_heads);
the sequence must not be sharded. `interpret=True` runs the same kernel on the CPU (slowly), for tests.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

_MAX_BLOCK = 512


def _kernel(num_heads: int, length: int, sliding_window: int, logits_soft_cap: float, interpret: bool):
  block = min(_MAX_BLOCK, length)
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
  if sliding_window > 0:  # causal, and t - s < sliding_window
    head_mask = splash_mask.LocalMask((length, length), window_size=(sliding_window - 1, 0), offset=0)
  else:
    head_mask = splash_mask.CausalMask((length, length))
  mask = splash_mask.MultiHeadMask([head_mask for _ in range(num_heads)])
  return splash.make_splash_mha(
    mask,
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=1,
    attn_logits_soft_cap=logits_soft_cap or None,
    interpret=interpret,
  )


def _local_attention(query, key, value, segment_ids, sliding_window: int, logits_soft_cap: float, interpret: bool):
  """One shard: (b, T, nq, D) queries, (b, T, nkv, D) keys/values -> (b, T, nq, D)."""
  kernel = _kernel(query.shape[2], query.shape[1], sliding_window, logits_soft_cap, interpret)
  to_heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # (b, T, n, D) <-> (b, n, T, D)

  def one_example(q, k, v, seg):
    return kernel(q, k, v, segment_ids=splash.SegmentIds(q=seg, kv=seg))

  out = jax.vmap(one_example)(to_heads_first(query), to_heads_first(key), to_heads_first(value), segment_ids)
  return to_heads_first(out)


def _compiles_for_cpu(mesh) -> bool:
  """Whether the program is compiled for CPU devices: then the kernel runs in the Pallas interpreter (tests).

  The mesh's devices decide, not the local backend: an AOT compile on a CPU host for a TPU target
  (train_compile.py) must compile the real TPU kernel.
  """
  platform = jax.default_backend() if mesh.empty else mesh.abstract_device.platform
  return platform == "cpu"


def flash_attention(
  query, key, value, segment_ids, sliding_window: int = 0, logits_soft_cap: float = 0.0, interpret: bool | None = None
):
  """Causal, segment-masked attention with the splash kernel. Shapes and options as dot_product_attention.

  Args:
    interpret: run the Pallas interpreter; default: only when compiling for CPU devices.
  """
  mesh = jax.sharding.get_abstract_mesh()
  interpret = _compiles_for_cpu(mesh) if interpret is None else interpret
  local = functools.partial(
    _local_attention, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, interpret=interpret
  )
  if mesh.empty:
    return local(query, key, value, segment_ids)
  q_spec = nn.logical_to_mesh_axes(("activation_batch", "activation_length", "activation_heads", None))
  kv_spec = nn.logical_to_mesh_axes(("activation_kv_batch", "activation_length", "activation_kv_heads", None))
  if q_spec[1] is not None:
    raise ValueError("attention=flash cannot shard the sequence (activation_length); use attention=dot_product")
  seg_spec = P(q_spec[0], None)
  return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec, check_vma=False)(
    query, key, value, segment_ids
  )
