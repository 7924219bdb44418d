"""DeepSeek-V3's MoE feed-forward (transformers' DeepseekV3MoE), assembled from moe.py's parts.

A sigmoid router with group-limited top-k (moe.route_sigmoid_grouped) picks k routed experts per token; their
gated MLPs run through MoeBlock's dispatch (dropless or with capacity); a dense gated MLP of
shared_experts x intermediate_dim, the shared experts, sees every token and is added to the routed output.

Load balancing, per DeepSeek-V3: the router's gate/bias shifts only which experts are chosen. It is a param (so
checkpoints hold it) that the optimizer must not update; the train step moves it with moe.update_routing_bias
from the sown per-row routing statistics (moe.sow_routing_statistics), which the sequence-wise balance loss
(moe.sequence_balance_loss) reads too.
"""

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from MaxText.layers import initializers, moe
from MaxText.layers.linears import PLAIN, Gemm
from MaxText.layers.moe_experts import ExpertsConfig, routed_experts


class GroupLimitedRouter(nn.Module):
  """transformers' DeepseekV3TopkRouter. Params: kernel (embed, E); bias (E,) float32, the selection-only
  e_score_correction_bias (zeros at init; it is never added to the logits). Returns moe.route_sigmoid_grouped's
  (probs, weights, experts)."""

  num_experts: int
  num_experts_per_tok: int
  num_groups: int
  topk_groups: int
  routed_scaling_factor: float
  norm_topk_prob: bool
  weight_dtype: str

  @nn.compact
  def __call__(self, x):
    init = functools.partial(initializers.default_kernel_init, in_axis=0, out_axis=1)
    kernel = self.param(
      "kernel", nn.with_logical_partitioning(init, ("embed", None)), (x.shape[-1], self.num_experts), self.weight_dtype
    )
    # float32 whatever weight_dtype: updates of rate ~1e-3 would round away in bfloat16.
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (self.num_experts,), jnp.float32)
    # The router runs in float32: a bfloat16 logit can flip which experts win.
    logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), kernel.astype(jnp.float32))  # (B, T, E)
    return moe.route_sigmoid_grouped(
      logits,
      bias,
      self.num_experts_per_tok,
      self.num_groups,
      self.topk_groups,
      self.routed_scaling_factor,
      self.norm_topk_prob,
    )


class DeepSeekMoeBlock(nn.Module):
  """Routed experts + shared experts. Params: gate/kernel (embed, E), gate/bias (E,); wi_0, wi_1 (E, embed, mlp),
  wo (E, mlp, embed); shared_experts/{wi_0, wi_1}/kernel (embed, S x mlp), shared_experts/wo/kernel (S x mlp, embed).

  Attributes:
    intermediate_dim: each expert's mlp width (moe_intermediate_size).
    shared_experts: S, the shared experts fused into one MLP (n_shared_experts); 0 for none.
    n_routing_groups, topk_routing_group: n_group and topk_group of the group-limited routing.
    experts: how the routed experts compute, as MoeBlock's (moe_experts.py).
  """

  num_experts: int
  num_experts_per_tok: int
  intermediate_dim: int
  shared_experts: int
  n_routing_groups: int
  topk_routing_group: int
  routed_scaling_factor: float
  norm_topk_prob: bool
  experts: ExpertsConfig
  activations: Sequence[str]
  dtype: str
  weight_dtype: str
  gemm: Gemm = PLAIN  # the shared experts' (the decoder layers': quantized, tapped, adapted as the run asks)

  @nn.compact
  def __call__(self, x, segment_ids):
    """x (B, T, D); segment_ids (B, T) (padding, 0, is left out of the routing statistics). Returns (B, T, D)."""
    probs, weights, experts = GroupLimitedRouter(
      self.num_experts,
      self.num_experts_per_tok,
      self.n_routing_groups,
      self.topk_routing_group,
      self.routed_scaling_factor,
      self.norm_topk_prob,
      self.weight_dtype,
      name="gate",
    )(x)  # (B, T, E), (B, T, k), (B, T, k)
    moe.sow_routing_statistics(self, probs, experts, segment_ids, self.num_experts)  # the loads, the sequence loss

    y = routed_experts(self, x, weights, experts, self.num_experts, self.intermediate_dim, self.activations, self.experts)
    if self.shared_experts > 0:
      y = y + moe.shared_experts(self, x)
    return y
