"""Mixture-of-experts feed-forward block (Mixtral) and its load-balancing loss.

Routing is transformers' Mixtral: softmax of the router logits in float32, the top num_experts_per_tok
experts per token, their weights renormalised to sum to 1; each expert is a gated MLP
wo(act_0(x wi_0) * act_1(x wi_1)); a token's output is the weighted sum of its experts' outputs.

Two dispatch strategies, chosen by `capacity_factor`:
- dropless (capacity_factor <= 0, the default): every token reaches its k experts. The (token, expert) pairs
  of a device's tokens are sorted by expert and multiplied group by group with `jax.lax.ragged_dot`
  (a grouped matmul that XLA lowers natively on TPU): k/num_experts of the dense FLOPs, activations
  (tokens * k, mlp). It runs under shard_map over the batch (and length) mesh axes: tokens stay on their
  device, the expert weights are gathered per layer like FSDP, and the mlp dim keeps its tensor sharding
  (partial outputs are summed over those axes).
- capacity (capacity_factor > 0): each sequence sends at most C = int(T * k / num_experts * capacity_factor)
  tokens to an expert (upstream MaxText's semantics: earlier tokens first, a token's choices in rank order;
  a dropped choice contributes nothing and the kept weights are not renormalised). Tokens are gathered into
  fixed (batch, expert, C, embed) buffers and multiplied with einsums whose expert dim is sharded over the
  `expert` mesh axis (expert parallelism; GSPMD moves the tokens).
"""

import functools
import operator
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from MaxText.layers import initializers, mesh_specs
from MaxText.layers.linears import ACTIVATIONS, DenseGeneral

# Names of the per-layer routing statistics sown into the "intermediates" collection.
TOKENS_PER_EXPERT = "moe_tokens_per_expert"
ROUTER_PROB_PER_EXPERT = "moe_router_prob_per_expert"


def route(router_logits, num_experts_per_tok: int):
  """Softmax (float32) over experts, top-k, renormalised top-k weights.

  Args:
    router_logits: (..., E).
    num_experts_per_tok: k.
  Returns:
    probs (..., E) float32, weights (..., k) float32 summing to 1, experts (..., k) int32.
  """
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, num_experts_per_tok)
  return probs, weights / jnp.sum(weights, axis=-1, keepdims=True), experts


def expert_capacity(length: int, num_experts_per_tok: int, num_experts: int, capacity_factor: float) -> int:
  """Tokens of one sequence an expert accepts: int(T * k / E * capacity_factor), at least 1 and at most T."""
  return min(length, max(1, int(length * num_experts_per_tok / num_experts * capacity_factor)))


def capacity_slots(experts, num_experts: int, capacity: int):
  """Each choice's slot in its expert's buffer, and whether it fits.

  Priority is the order of (token, rank) within a sequence, as upstream MaxText's cumulative count.

  Args:
    experts: (B, T, k) chosen experts.
  Returns:
    slots (B, T, k) int32 (position among the sequence's choices of that expert), kept (B, T, k) bool.
  """
  batch, length, k = experts.shape
  onehot = jax.nn.one_hot(experts.reshape(batch, length * k), num_experts, dtype=jnp.int32)  # (B, T*k, E)
  slots = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1).reshape(batch, length, k)
  return slots, slots < capacity


def _gated(h_parts, activations):
  return functools.reduce(operator.mul, [ACTIVATIONS[a](h) for a, h in zip(activations, h_parts)])


def _dropless_local(x, weights, experts, wi, wo, activations, psum_axes):
  """Sorted grouped matmuls on one device's tokens. x (b, t, D); weights, experts (b, t, k); wi [(E, D, M)]."""
  batch, length, dim = x.shape
  k = experts.shape[-1]
  num_experts = wo.shape[0]
  flat_experts = experts.reshape(-1)  # (n*k,), n = b*t
  order = jnp.argsort(flat_experts, stable=True)
  grouped = x.reshape(-1, dim)[order // k]  # (n*k, D) grouped by expert
  group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
  h = _gated([jax.lax.ragged_dot(grouped, w, group_sizes) for w in wi], activations)  # (n*k, M)
  h = checkpoint_name(h, "mlpwi")
  out = jax.lax.ragged_dot(h, wo, group_sizes)  # (n*k, D)
  out = out[jnp.argsort(order)].reshape(batch, length, k, dim)  # back to (token, rank) order
  y = jnp.einsum("btkd,btk->btd", out, weights.astype(out.dtype))
  return jax.lax.psum(y, psum_axes) if psum_axes else y


def dropless(x, weights, experts, wi, wo, activations):
  """Dropless MoE over the current mesh (plain local computation outside a mesh). Shapes as _dropless_local."""
  mesh = jax.sharding.get_abstract_mesh()
  local = functools.partial(_dropless_local, activations=activations)
  if mesh.empty:
    return local(x, weights, experts, wi, wo, psum_axes=())
  # One name at a time: resolved together, flax would drop "mlp" for sharing fsdp_transpose with the batch.
  batch_spec, length_spec, mlp_spec = (
    nn.logical_to_mesh_axes((name,))[0] for name in ("activation_batch", "activation_length", "mlp")
  )
  shape = dict(mesh.shape)
  batch_axes = mesh_specs.dividing_axes(mesh_specs.as_tuple(batch_spec), x.shape[0], shape)
  length_axes = mesh_specs.dividing_axes(
    [a for a in mesh_specs.as_tuple(length_spec) if a not in batch_axes], x.shape[1], shape
  )
  token_axes = set(batch_axes + length_axes)
  # The mlp dim stays sharded over the axes that do not already split the tokens; outputs are summed over them.
  mlp_axes = mesh_specs.dividing_axes([a for a in mesh_specs.as_tuple(mlp_spec) if a not in token_axes], wo.shape[1], shape)
  tokens = PartitionSpec(batch_axes or None, length_axes or None)
  w_in, w_out = PartitionSpec(None, None, mlp_axes or None), PartitionSpec(None, mlp_axes or None, None)
  fn = jax.shard_map(
    functools.partial(local, psum_axes=mlp_axes),
    in_specs=(tokens, tokens, tokens, [w_in] * len(wi), w_out),
    out_specs=tokens,
  )
  return fn(x, weights, experts, list(wi), wo)


def with_capacity(x, weights, experts, wi, wo, activations, capacity_factor: float):
  """MoE with at most C tokens per expert and sequence (see the module docstring). Shapes as _dropless_local."""
  batch, length, dim = x.shape
  num_experts = wo.shape[0]
  capacity = expert_capacity(length, experts.shape[-1], num_experts, capacity_factor)
  slots, kept = capacity_slots(experts, num_experts, capacity)
  dropped = num_experts * capacity  # one spare buffer row that dropped choices write to and read from
  flat_slot = jnp.where(kept, experts * capacity + slots, dropped).reshape(batch, -1)  # (B, T*k)
  token_of_choice = jnp.broadcast_to(jnp.arange(length)[:, None], experts.shape[1:]).reshape(-1)  # (T*k,)
  # Which token fills each buffer slot; empty slots point at an all-zero padding token (index T).
  slot_token = jax.vmap(lambda s: jnp.full(dropped + 1, length).at[s].set(token_of_choice))(flat_slot)
  padded = jnp.concatenate([x, jnp.zeros((batch, 1, dim), x.dtype)], axis=1)  # (B, T+1, D)
  dispatched = jnp.take_along_axis(padded, slot_token[:, :dropped, None], axis=1)
  dispatched = dispatched.reshape(batch, num_experts, capacity, dim)  # (B, E, C, D)
  dispatched = nn.with_logical_constraint(
    dispatched, ("activation_batch_no_exp", "activation_exp", None, "activation_embed")
  )
  h = _gated([jnp.einsum("becd,edm->becm", dispatched, w) for w in wi], activations)  # (B, E, C, M)
  h = checkpoint_name(h, "mlpwi")
  out = jnp.einsum("becm,emd->becd", h, wo).reshape(batch, dropped, dim)
  out = jnp.concatenate([out, jnp.zeros((batch, 1, dim), out.dtype)], axis=1)  # (B, E*C+1, D)
  per_choice = jnp.take_along_axis(out, flat_slot[..., None], axis=1).reshape(*experts.shape, dim)  # (B, T, k, D)
  return jnp.einsum("btkd,btk->btd", per_choice, weights.astype(out.dtype))


def routing_statistics(probs, experts, segment_ids, num_experts: int):
  """Per-expert fraction of routed choices (sums to k) and mean router probability, over real tokens.

  Args:
    probs: (B, T, E) router softmax. experts: (B, T, k). segment_ids: (B, T), 0 = padding (not counted).
  Returns:
    tokens_per_expert (E,), router_prob_per_expert (E,), both float32.
  """
  mask = (segment_ids != 0).astype(jnp.float32)[..., None]  # (B, T, 1)
  count = jnp.maximum(jnp.sum(mask), 1.0)
  chosen = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=-2)  # (B, T, E)
  return jnp.sum(chosen * mask, axis=(0, 1)) / count, jnp.sum(probs * mask, axis=(0, 1)) / count


def load_balancing_loss(intermediates, num_experts: int):
  """transformers' load_balancing_loss_func from the statistics every MoE layer sowed; 0.0 without MoE layers.

  Averaging each layer's statistics over layers equals transformers' means over all layers' tokens
  concatenated: loss = num_experts * sum_e tokens_per_expert[e] * router_prob_per_expert[e]
  (num_experts_per_tok when perfectly balanced).
  """
  found = {TOKENS_PER_EXPERT: [], ROUTER_PROB_PER_EXPERT: []}
  for path, leaf in jax.tree_util.tree_flatten_with_path(intermediates)[0]:
    names = [getattr(p, "key", None) for p in path]
    for name, values in found.items():
      if name in names:
        values.append(leaf.reshape(-1, num_experts))  # scanned layers stack theirs: (L, E)
  if not found[TOKENS_PER_EXPERT]:
    return jnp.zeros((), jnp.float32)
  tokens = jnp.mean(jnp.concatenate(found[TOKENS_PER_EXPERT]), axis=0)
  probs = jnp.mean(jnp.concatenate(found[ROUTER_PROB_PER_EXPERT]), axis=0)
  return num_experts * jnp.sum(tokens * probs)


class MoeBlock(nn.Module):
  """Top-k routed gated-MLP experts. Params: gate/kernel (embed, E); wi_0, wi_1 (E, embed, mlp); wo (E, mlp, embed)."""

  num_experts: int
  num_experts_per_tok: int
  intermediate_dim: int
  activations: Sequence[str]
  capacity_factor: float
  dtype: str
  weight_dtype: str

  @nn.compact
  def __call__(self, x, segment_ids):
    """x (B, T, D); segment_ids (B, T) (padding, 0, is left out of the routing statistics). Returns (B, T, D)."""
    dim = x.shape[-1]
    # The router runs in float32: a bfloat16 logit can flip which experts win.
    router_logits = DenseGeneral(
      self.num_experts, ("embed", None), dtype="float32", weight_dtype=self.weight_dtype, name="gate"
    )(x)  # (B, T, E)
    probs, weights, experts = route(router_logits, self.num_experts_per_tok)
    tokens_per_expert, prob_per_expert = routing_statistics(probs, experts, segment_ids, self.num_experts)
    self.sow("intermediates", TOKENS_PER_EXPERT, tokens_per_expert)
    self.sow("intermediates", ROUTER_PROB_PER_EXPERT, prob_per_expert)

    init = functools.partial(initializers.default_kernel_init, in_axis=1, out_axis=2)
    wi_shape, wo_shape = (self.num_experts, dim, self.intermediate_dim), (self.num_experts, self.intermediate_dim, dim)
    wi = [
      self.param(
        f"wi_{i}", nn.with_logical_partitioning(init, ("exp", "embed_no_exp", "mlp")), wi_shape, self.weight_dtype
      ).astype(self.dtype)
      for i in range(len(self.activations))
    ]
    wo = self.param(
      "wo", nn.with_logical_partitioning(init, ("exp", "mlp", "embed_no_exp")), wo_shape, self.weight_dtype
    ).astype(self.dtype)
    x = x.astype(self.dtype)
    if self.capacity_factor > 0:
      y = with_capacity(x, weights, experts, wi, wo, self.activations, self.capacity_factor)
    else:
      y = dropless(x, weights, experts, wi, wo, self.activations)
    return checkpoint_name(y, "mlpwo")
