"""The routed experts' computation: each token's k chosen gated MLPs, weighted by its routing weights.

`routed_experts` declares the experts' kernels and picks one of four ways to compute them, by `sparse_matmul` and
`capacity_factor` (upstream MaxText's table):

| | capacity_factor <= 0 | capacity_factor > 0 |
|---|---|---|
| sparse_matmul=true | dropless grouped matmuls | grouped matmuls, choices past capacity dropped |
| sparse_matmul=false | dense einsum over every expert, dropless | dense per-expert buffers of C tokens |

- grouped (`grouped`): the (token, expert) pairs of a device's tokens are sorted by expert and multiplied group by
  group (grouped_matmul.py: megablox's kernels, ragged_dot, or padded tiles on GPU): k/num_experts of the dense
  FLOPs, activations (tokens x k, mlp). It runs under shard_map over the batch (and length) mesh axes, and the mlp
  dim keeps its tensor sharding (partial outputs are summed over those axes). `dispatch` says what moves:
  gather (the default): tokens stay on their device, the expert weights are gathered per layer like FSDP;
  all_to_all: the expert weights stay sharded over the `expert` axis and the pairs travel to their experts' devices
  and back (moe_dispatch.py). With a capacity, a dropped choice is sorted past every group: it is multiplied by
  nothing and contributes 0.
- capacity: each sequence sends at most C = int(T * k / num_experts * capacity_factor) tokens to an expert
  (upstream MaxText's semantics: earlier tokens first, a token's choices in rank order; a dropped choice
  contributes nothing and the kept weights are not renormalised). Dense buffers: tokens are gathered into fixed
  (batch, expert, C, embed) buffers and multiplied with einsums whose expert dim is sharded over the `expert` mesh
  axis (expert parallelism; GSPMD moves the tokens).
- dense dropless: every token through every expert, the outputs weighted by the routing weights (0 for the experts
  it did not choose): num_experts/k times the grouped FLOPs, no sorting.
"""

import dataclasses
import functools
import operator

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from MaxText.layers import expert_order, initializers, mesh_specs, moe_dispatch
from MaxText.layers.grouped_matmul import GroupedMatmul
from MaxText.layers.linears import ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
  """How the routed experts compute (hashable: a Flax module field).

  Attributes:
    capacity_factor: <= 0 dropless, else the per-sequence expert capacity factor.
    sparse_matmul: grouped matmuls over the routed pairs (true) or dense einsums over every expert.
    dispatch: the grouped experts' dispatch, gather | all_to_all (config.moe_dispatch).
    matmul: the grouped matmul (grouped_matmul.from_config).
    whole_batch: sort the whole batch's pairs without shard_map (max_checkify: JAX's checkify cannot carry its
      error state into a shard_map, jax-ml/jax#40907); the same numbers, on the layout GSPMD picks.
  """

  capacity_factor: float = -1.0
  sparse_matmul: bool = True
  dispatch: str = "gather"
  matmul: GroupedMatmul = GroupedMatmul()
  whole_batch: bool = False


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


def _named(h_parts):
  """The experts' wi_0, wi_1, ... outputs named moe_mlpwi_0, moe_mlpwi_1, ... for remat_policy=custom."""
  return [checkpoint_name(h, f"moe_mlpwi_{i}") for i, h in enumerate(h_parts)]


def _gated(h_parts, activations):
  """The product of the named activations of the wi outputs, or `activations(h_parts)` where a family's gating is not
  such a product (GPT-OSS's clamped SwiGLU)."""
  if callable(activations):
    return activations(h_parts)
  return functools.reduce(operator.mul, [ACTIVATIONS[a](h) for a, h in zip(activations, h_parts)])


def num_projections(activations) -> int:
  """The wi kernels: one per named activation, or the gating's `projections`."""
  return activations.projections if callable(activations) else len(activations)


def _row_bias(bias, group_sizes, rows: int):
  """bias (E, M) of the expert of each of `rows` rows grouped by expert -> (rows, M); 0 past sum(group_sizes)."""
  expert_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")  # E past the groups
  return jnp.take(bias, expert_of_row, axis=0, mode="fill", fill_value=0)


def _project_in(matmul: GroupedMatmul, grouped, w, group_sizes):
  """One wi's grouped matmul; w is its (E, D, M) kernel, or (kernel, (E, M) bias) for experts with biases."""
  if isinstance(w, tuple):
    kernel, bias = w
    return matmul(grouped, kernel, group_sizes, "wi") + _row_bias(bias, group_sizes, grouped.shape[0])
  return matmul(grouped, w, group_sizes, "wi")


def _expert_mlp(grouped, wi, wo, group_sizes, activations, matmul: GroupedMatmul):
  """The gated MLPs of experts on rows grouped by expert: grouped (R, D), wi [(E, D, M) or (kernel, (E, M) bias)],
  wo (E, M, D) -> (R, D). wo's bias is added outside (routed_experts): it does not depend on the rows' values.

  Rows past sum(group_sizes) give 0.
  """
  h = _gated(_named([_project_in(matmul, grouped, w, group_sizes) for w in wi]), activations)  # (R, M)
  h = checkpoint_name(h, "mlpwi")
  return checkpoint_name(matmul(h, wo, group_sizes, "wo"), "moe_mlpwo")


def _grouped_local(x, weights, experts, wi, wo, expert_mlp, psum_axes):
  """Sorted grouped matmuls on one device's tokens. x (b, t, D); weights, experts (b, t, k); wi [(E, D, M)].

  An expert id of E (a dropped choice) sorts past every group and contributes 0.
  """
  batch, length, dim = x.shape
  k = experts.shape[-1]
  num_experts = wo.shape[0]
  flat_experts = experts.reshape(-1)  # (n*k,), n = b*t
  order = expert_order.Order(flat_experts, k)
  grouped = expert_order.sorted_pairs(x.reshape(-1, dim), order)  # (n*k, D) grouped by expert
  group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
  out = expert_mlp(grouped, wi, wo, group_sizes)  # (n*k, D)
  out = expert_order.unsorted_pairs(out, order).reshape(batch, length, k, dim)  # back to (token, rank) order
  y = jnp.einsum("btkd,btk->btd", out, weights.astype(out.dtype))
  return jax.lax.psum(y, psum_axes) if psum_axes else y


def grouped(x, weights, experts, wi, wo, activations, dispatch: str, matmul: GroupedMatmul, whole_batch: bool = False):
  """Grouped-matmul MoE over the current mesh (plain local computation outside a mesh). Shapes as _grouped_local.

  dispatch: "gather" (each device gathers all experts' weights) or "all_to_all" (the tokens travel to the experts'
  devices over the expert axes that split both the experts and the tokens; "gather" where there are none).
  """
  mesh = jax.sharding.get_abstract_mesh()
  expert_mlp = functools.partial(_expert_mlp, activations=activations, matmul=matmul)
  local = functools.partial(_grouped_local, expert_mlp=expert_mlp)
  if mesh.empty or whole_batch:
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
  num_experts = wo.shape[0]
  exp_axes = mesh_specs.as_tuple(nn.logical_to_mesh_axes(("exp",))[0])
  ep_axes = mesh_specs.dividing_axes([a for a in exp_axes if a in token_axes], num_experts, shape)
  if dispatch == "all_to_all" and ep_axes:
    local = functools.partial(
      moe_dispatch.all_to_all_local,
      expert_mlp=expert_mlp,
      num_experts=num_experts,
      ep_axes=ep_axes,
      # XLA:CPU lacks ragged-all-to-all (CPU meshes are tests); an AOT compile for TPU has TPU devices here.
      emulate=mesh.abstract_device is not None and mesh.abstract_device.platform == "cpu",
    )
  else:
    ep_axes = ()
  w_in, w_out = (
    PartitionSpec(ep_axes or None, None, mlp_axes or None),
    PartitionSpec(ep_axes or None, mlp_axes or None, None),
  )
  bias_in = PartitionSpec(ep_axes or None, mlp_axes or None)
  fn = jax.shard_map(
    functools.partial(local, psum_axes=mlp_axes),
    in_specs=(tokens, tokens, tokens, [(w_in, bias_in) if isinstance(w, tuple) else w_in for w in wi], w_out),
    out_specs=tokens,
    # A pallas_call's outputs carry no varying-axes type, which check_vma requires; nor, under the pipeline's vmap over
    # stage, does the biases' row lookup (_row_bias: its searchsorted compares values varying over other axes).
    check_vma=matmul.kernel != "megablox" and not any(isinstance(w, tuple) for w in wi),
  )
  return fn(x, weights, experts, list(wi), wo)


def _dense_in(equation: str, x, w, expert_axis: int):
  """One wi's einsum over every expert; w as _project_in's, its (E, M) bias broadcast with E on expert_axis."""
  if not isinstance(w, tuple):
    return jnp.einsum(equation, x, w)
  kernel, bias = w
  h = jnp.einsum(equation, x, kernel)
  return h + bias.reshape((1,) * expert_axis + (bias.shape[0],) + (1,) * (h.ndim - expert_axis - 2) + (bias.shape[1],))


def with_capacity(x, weights, experts, wi, wo, activations, capacity_factor: float):
  """MoE with at most C tokens per expert and sequence in dense buffers (module docstring). Shapes as _grouped_local."""
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
  h = _gated(_named([_dense_in("becd,edm->becm", dispatched, w, 1) for w in wi]), activations)  # (B, E, C, M)
  h = checkpoint_name(h, "mlpwi")
  out = checkpoint_name(jnp.einsum("becm,emd->becd", h, wo), "moe_mlpwo").reshape(batch, dropped, dim)
  out = jnp.concatenate([out, jnp.zeros((batch, 1, dim), out.dtype)], axis=1)  # (B, E*C+1, D)
  per_choice = jnp.take_along_axis(out, flat_slot[..., None], axis=1).reshape(*experts.shape, dim)  # (B, T, k, D)
  return jnp.einsum("btkd,btk->btd", per_choice, weights.astype(out.dtype))


def dense(x, weights, experts, wi, wo, activations):
  """Dropless MoE as dense einsums over every expert (sparse_matmul=false). Shapes as _grouped_local."""
  num_experts = wo.shape[0]
  # (B, T, E): a token's routing weight for each expert, 0 for those it did not choose.
  combine = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=x.dtype) * weights[..., None].astype(x.dtype), axis=-2)
  h = _gated(_named([_dense_in("btd,edm->btem", x, w, 2) for w in wi]), activations)  # (B, T, E, M)
  h = checkpoint_name(h, "mlpwi")
  return checkpoint_name(jnp.einsum("btem,emd->btd", h * combine[..., None], wo), "moe_mlpwo")


def routed_experts(
  module,
  x,
  weights,
  experts,
  num_experts: int,
  intermediate_dim: int,
  activations,
  cfg: ExpertsConfig,
  use_bias: bool = False,
):
  """The routed gated-MLP experts' output, declaring their kernels on `module` (called from its compact __call__).

  Params: wi_0.. (E, embed, mlp) one per activation, wo (E, mlp, embed), in `module.weight_dtype`, computed in
  `module.dtype`, as the module docstring's table of `cfg` says; use_bias adds wi_0_bias.. (E, mlp) and wo_bias
  (E, embed), trained (GPT-OSS's experts).

  Args:
    x: (B, T, D). weights, experts: (B, T, k) from a routing function.
    activations: the activation names (their product gates), or a callable gating (_gated).
  Returns:
    (B, T, D).
  """
  dim = x.shape[-1]
  init = functools.partial(initializers.default_kernel_init, in_axis=1, out_axis=2)
  wi_shape, wo_shape = (num_experts, dim, intermediate_dim), (num_experts, intermediate_dim, dim)
  wi = [
    module.param(
      f"wi_{i}", nn.with_logical_partitioning(init, ("exp", "embed_no_exp", "mlp")), wi_shape, module.weight_dtype
    ).astype(module.dtype)
    for i in range(num_projections(activations))
  ]
  wo = module.param(
    "wo", nn.with_logical_partitioning(init, ("exp", "mlp", "embed_no_exp")), wo_shape, module.weight_dtype
  ).astype(module.dtype)
  bias = functools.partial(_expert_bias, module, num_experts)
  if use_bias:
    wi = [(w, bias(f"wi_{i}_bias", intermediate_dim, "mlp")) for i, w in enumerate(wi)]
  x = x.astype(module.dtype)
  kept = _kept(experts, num_experts, cfg, x.shape[1])  # E: a choice past capacity, dropped
  if not cfg.sparse_matmul:
    if cfg.capacity_factor > 0:
      y = with_capacity(x, weights, experts, wi, wo, activations, cfg.capacity_factor)
    else:
      y = dense(x, weights, experts, wi, wo, activations)
  else:
    y = grouped(x, weights, kept, wi, wo, activations, cfg.dispatch, cfg.matmul, cfg.whole_batch)
  if use_bias:  # sum_k weight_k (out_k + wo_bias[e_k]): the bias term is the weights' combination of the biases
    combine = _combine(weights, kept, num_experts)  # (B, T, E)
    y = y + (combine.astype(y.dtype) @ bias("wo_bias", dim, "embed_no_exp")).astype(y.dtype)
  return checkpoint_name(y, "mlpwo")


def _expert_bias(module, num_experts: int, name: str, width: int, axis: str):
  """An (E, width) trained bias of the experts, zeros at init, in module.dtype."""
  init = nn.with_logical_partitioning(nn.initializers.zeros, ("exp", axis))
  return module.param(name, init, (num_experts, width), module.weight_dtype).astype(module.dtype)


def _kept(experts, num_experts: int, cfg: ExpertsConfig, length: int):
  """experts (B, T, k) with the choices past capacity (capacity_factor > 0) replaced by num_experts."""
  if cfg.capacity_factor <= 0:
    return experts
  capacity = expert_capacity(length, experts.shape[-1], num_experts, cfg.capacity_factor)
  return jnp.where(capacity_slots(experts, num_experts, capacity)[1], experts, num_experts)


def _combine(weights, experts, num_experts: int):
  """(B, T, E): each token's routing weight of each expert (0 for the others and for an id of num_experts)."""
  return jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=weights.dtype) * weights[..., None], axis=-2)
