"""Expert-parallel token dispatch for the dropless MoE (moe_dispatch=all_to_all): tokens travel, weights stay.

Each device of the `expert` mesh axes keeps only its E/ep experts' weights. Its (token, expert) pairs, sorted by
expert, go to the devices holding their experts with `jax.lax.ragged_all_to_all`; each device runs its local
experts on what it received (grouped matmuls, `jax.lax.ragged_dot`), and a second ragged_all_to_all brings the
results back to the tokens' devices. Per layer a device moves its tokens x k rows (embed wide) out and back,
instead of gathering E x 3 x embed x mlp expert weights (moe_dispatch=gather).

Layouts, with ep devices on the expert axes, E_l = E / ep local experts, n tokens and P = n x k pairs per device:
- the sender sorts its P pairs by global expert g = d x E_l + e (device d, local expert e); slice g (its pairs of
  expert g) goes to device d;
- the receiver's buffer is grouped by local expert, then by source device, so the experts' grouped matmuls read it
  as it arrives: the pairs of source s for local expert e start at sum_{e' < e} recv[:, e'] + sum_{s' < s} recv[s', e].
  Both sides learn the sizes and offsets they need from two small all_to_alls of (E,) integer vectors.
"""

import jax
import jax.numpy as jnp

from MaxText.layers import expert_order


def receive_buffer_rows(tokens: int, num_experts_per_tok: int, local_experts: int, ep: int) -> int:
  """Rows of the static receive buffer that keep the dispatch dropless whatever the routing.

  A token's k experts are distinct, so at most min(k, E_l) of its pairs go to one device, and a device receives at
  most that from each of the ep devices: R = ep x n x min(k, E_l) rows, the worst case (every device's tokens
  choosing the same device's experts) that a static shape must hold to never drop a pair. Memory per device and
  layer: R x embed for the received rows and again for the experts' outputs, R x mlp/tensor per gated activation
  (kept for the backward pass unless remat drops "mlpwi"): ep x min(k, E_l) / k times the n x k rows of a
  perfectly balanced load (moe_dispatch=gather holds n x k rows, but all E experts' weights).

  Args:
    tokens: n, the tokens of one device.
    num_experts_per_tok: k.
    local_experts: E_l, the experts each device holds.
    ep: the devices on the expert axes.
  """
  return ep * tokens * min(num_experts_per_tok, local_experts)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all's semantics from all_gather and a scatter, for CPU devices in tests only.

  XLA:CPU does not implement ragged-all-to-all. This gathers every device's operand, offsets and sizes (the whole
  operand of every device on every device: memory and traffic ep times the real op's, acceptable for tests only),
  then writes into `output` the slices that other devices address to this one. Differentiable (all_gather and a
  scatter). recv_sizes is implied by the senders' send_sizes (the real op requires them to agree) and not read.
  """
  del recv_sizes
  me = jax.lax.axis_index(axis_name)
  operands, starts, sizes, targets = (
    jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes, output_offsets)
  )  # (ep, rows, ...), (ep, N) x 3
  ep, slices = starts.shape
  per_device = slices // ep  # slice i goes to device i // per_device

  def mine(a):  # (ep, per_device): the slices each device sends to this one
    return jax.lax.dynamic_slice_in_dim(a, me * per_device, per_device, axis=1)

  starts, sizes, targets = mine(starts), mine(sizes), mine(targets)
  j = jnp.arange(operand.shape[0])  # a slice is at most the operand's rows
  rows = jnp.clip(starts[..., None] + j, 0, operand.shape[0] - 1).reshape(ep, -1)  # (ep, per_device * rows)
  values = jnp.take_along_axis(operands, rows.reshape(ep, -1, *([1] * (operand.ndim - 1))), axis=1)
  # Rows past a slice's size are aimed past the end of output and dropped by the scatter.
  where = jnp.where(j < sizes[..., None], targets[..., None] + j, output.shape[0]).reshape(-1)
  return output.at[where].set(values.reshape(-1, *operand.shape[1:]), mode="drop")


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, emulate):
  """jax.lax.ragged_all_to_all, or its CPU emulation (emulated_ragged_all_to_all) when `emulate`.

  Callers set emulate from the platform of the mesh's devices: an AOT compile for a TPU topology traces on a CPU
  host with TPU devices in its mesh and gets the real op.
  """
  fn = emulated_ragged_all_to_all if emulate else jax.lax.ragged_all_to_all
  return fn(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)


def _exclusive_cumsum(a, axis=0):
  return jnp.cumsum(a, axis=axis) - a


def all_to_all_local(x, weights, experts, wi, wo, *, expert_mlp, num_experts, ep_axes, psum_axes, emulate):
  """One device's part of the all_to_all dispatch (run under shard_map over token axes that include ep_axes).

  Args:
    x: (b, t, D) this device's tokens. weights, experts: (b, t, k) their routing (global expert ids).
    wi: [(E_l, D, M)] and wo (E_l, M, D): this device's experts (M may be a tensor shard of the mlp dim).
    expert_mlp: (rows (R, D), wi, wo, group_sizes (E_l,)) -> (R, D), the grouped gated MLP.
    num_experts: E over all devices.
    ep_axes: the mesh axes the experts are sharded over (E_l = E / their size).
    psum_axes: axes the mlp dim is sharded over; partial outputs are summed over them.
    emulate: use the CPU emulation of ragged_all_to_all (tests).
  Returns:
    (b, t, D).
  """
  batch, length, dim = x.shape
  k = experts.shape[-1]
  local_experts = wo.shape[0]
  ep = num_experts // local_experts
  exchange = lambda a: jax.lax.all_to_all(a, ep_axes, 0, 0, tiled=True)  # noqa: E731  (E, ...) by device blocks

  flat_experts = experts.reshape(-1)  # (P,), P = b*t*k
  order = expert_order.Order(flat_experts, k)
  pairs = expert_order.sorted_pairs(x.reshape(-1, dim), order)  # (P, D) sorted by global expert
  group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)  # (E,) slice g -> device g // E_l
  send_offsets = _exclusive_cumsum(group_sizes)
  # recv[s, e]: pairs source s sends for local expert e; source_offsets[s, e]: where they start on s.
  received = exchange(jnp.stack([group_sizes, send_offsets], axis=-1)).reshape(ep, local_experts, 2)
  recv, source_offsets = received[..., 0], received[..., 1]
  # This device's buffer: grouped by local expert, then by source.
  local_sizes = jnp.sum(recv, axis=0)  # (E_l,)
  recv_offsets = _exclusive_cumsum(local_sizes)[None, :] + _exclusive_cumsum(recv, axis=0)  # (ep, E_l)
  target_offsets = exchange(recv_offsets.reshape(-1))  # (E,): where slice g lands on device g // E_l

  rows = receive_buffer_rows(batch * length, k, local_experts, ep)
  a2a = lambda *args: ragged_all_to_all(*args, axis_name=ep_axes, emulate=emulate)  # noqa: E731
  buffer = a2a(pairs, jnp.zeros((rows, dim), x.dtype), send_offsets, group_sizes, target_offsets, recv.reshape(-1))
  out = expert_mlp(buffer, wi, wo, local_sizes)  # (R, D); rows past sum(local_sizes) are never sent back
  back = a2a(
    out,
    jnp.zeros_like(pairs),
    recv_offsets.reshape(-1),
    recv.reshape(-1),
    source_offsets.reshape(-1),
    group_sizes,
  )  # (P, D) sorted by global expert
  back = expert_order.unsorted_pairs(back, order).reshape(batch, length, k, dim)  # (token, rank) order
  y = jnp.einsum("btkd,btk->btd", back, weights.astype(back.dtype))
  return jax.lax.psum(y, psum_axes) if psum_axes else y
