"""Mixture-of-experts feed-forward block (Mixtral) and its load-balancing loss.

Routing is transformers' Mixtral: softmax of the router logits in float32, the top num_experts_per_tok
experts per token, their weights renormalised to sum to 1; each expert is a gated MLP
wo(act_0(x wi_0) * act_1(x wi_1)); a token's output is the weighted sum of its experts' outputs.
DeepSeek-V3's routing (`route_sigmoid_grouped`), its sequence-wise balance loss and its bias update for
auxiliary-loss-free balancing are here too; deepseek_moe.py assembles its block from these parts.
How the experts compute (grouped or dense, dropless or with a capacity, the dispatch) is moe_experts.py's.
"""

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.layers import microbatch_combine
from MaxText.layers.linears import DenseGeneral, MlpBlock
from MaxText.layers.moe_experts import ExpertsConfig, routed_experts

# Names of the per-layer routing statistics sown into the "intermediates" collection, each per batch row (sums over
# the row's real tokens), so that the whole batch's, a sequence's and any split of the batch's (the pipeline's
# microbatches: their rows put back, microbatch_combine.rows) follow from them exactly.
ROW_CHOICES = "moe_choices_per_row"  # (B, E): routed choices of each expert (sums to k x the row's tokens)
ROW_PROBS = "moe_router_prob_per_row"  # (B, E): the router probabilities (scores) given each expert
ROW_TOKENS = "moe_real_tokens_per_row"  # (B,): the row's real tokens
for _name in (ROW_CHOICES, ROW_PROBS, ROW_TOKENS):
  microbatch_combine.register(_name, microbatch_combine.rows)


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


def route_sigmoid_grouped(
  router_logits,
  bias,
  num_experts_per_tok: int,
  num_groups: int,
  topk_groups: int,
  routed_scaling_factor: float,
  norm_topk_prob: bool,
):
  """DeepSeek-V3's routing (transformers' DeepseekV3TopkRouter): group-limited top-k of biased sigmoid scores.

  Selection uses scores + bias: the experts form num_groups contiguous groups, each scored by the sum of its
  two best biased scores; only the topk_groups best groups compete for the k experts. The weights use the
  unbiased scores of the chosen experts (renormalised to sum 1 when norm_topk_prob) x routed_scaling_factor:
  the bias steers which experts win, never how much they weigh.

  Args:
    router_logits: (..., E).
    bias: (E,) the selection-only correction bias (transformers' e_score_correction_bias); no gradient.
    num_experts_per_tok: k.
    num_groups: n_group, dividing E (1: no group limit).
    topk_groups: topk_group, the groups kept per token.
    routed_scaling_factor: multiplies the weights.
    norm_topk_prob: renormalise the k weights to sum 1 before scaling.
  Returns:
    probs (..., E) float32: the sigmoid scores normalised to sum 1 over experts (the s'_i of the balance losses);
    weights (..., k) float32; experts (..., k) int32 (in order of biased score).
  """
  num_experts = router_logits.shape[-1]
  group_size = num_experts // max(num_groups, 1)
  if num_groups < 1 or num_experts % num_groups:
    raise ValueError(f"n_routing_groups={num_groups} must divide num_experts={num_experts}")
  if not 1 <= topk_groups <= num_groups:
    raise ValueError(f"topk_routing_group={topk_groups} must be in [1, n_routing_groups={num_groups}]")
  if num_experts_per_tok > topk_groups * group_size:
    raise ValueError(
      f"num_experts_per_tok={num_experts_per_tok} exceeds the {topk_groups * group_size} experts of the kept groups"
    )
  scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))
  biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
  grouped = biased.reshape(*biased.shape[:-1], num_groups, group_size)  # (..., G, E/G)
  group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, group_size))[0], axis=-1)  # (..., G)
  _, top_groups = jax.lax.top_k(group_scores, topk_groups)  # (..., topk_groups)
  group_kept = jnp.any(top_groups[..., None] == jnp.arange(num_groups), axis=-2)  # (..., G)
  selectable = jnp.where(jnp.repeat(group_kept, group_size, axis=-1), biased, -jnp.inf)  # (..., E)
  _, experts = jax.lax.top_k(selectable, num_experts_per_tok)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)  # transformers' epsilon
  return scores / jnp.sum(scores, axis=-1, keepdims=True), weights * routed_scaling_factor, experts


def update_routing_bias(bias, tokens_per_expert, rate: float):
  """DeepSeek-V3's auxiliary-loss-free balancing, applied after the optimizer update of a step.

  bias_e += rate * sign(mean_e' load_e' - load_e): an overloaded expert's bias falls by rate, an underloaded
  one's rises by rate, one at the mean load keeps its bias.

  Args:
    bias: (..., E) the routers' gate/bias (one layer's, or layers stacked on leading axes: scanned layers
      stack it as (E, L) under param_scan_axis=1, so pass its transpose).
    tokens_per_expert: (..., E) each expert's routed choices in the step (from the sown ROW_CHOICES). Only its
      sign against the mean matters, so raw counts and fractions (any positive multiple) give the same update.
    rate: the bias update speed gamma (DeepSeek-V3: 0.001, then 0 for the last 500B tokens).
  Returns:
    The new bias, in bias's dtype.
  """
  load = tokens_per_expert.astype(jnp.float32)
  step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
  return (bias.astype(jnp.float32) + step).astype(bias.dtype)


def sow_routing_statistics(module: nn.Module, probs, experts, segment_ids, num_experts: int) -> None:
  """Sows the routing statistics of each batch row (ROW_CHOICES, ROW_PROBS, ROW_TOKENS) over its real tokens.

  Args:
    probs: (B, T, E) router probabilities (softmax, or DeepSeek's normalised scores). experts: (B, T, k).
    segment_ids: (B, T), 0 = padding (not counted).
  """
  mask = (segment_ids != 0).astype(jnp.float32)[..., None]  # (B, T, 1)
  chosen = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=-2)  # (B, T, E)
  module.sow("intermediates", ROW_CHOICES, jnp.sum(chosen * mask, axis=1))
  module.sow("intermediates", ROW_PROBS, jnp.sum(probs.astype(jnp.float32) * mask, axis=1))
  module.sow("intermediates", ROW_TOKENS, jnp.sum(mask, axis=(1, 2)))


def _sown_rows(intermediates) -> list[tuple]:
  """Every MoE block's sown (choices, probs, tokens): (..., B, E), (..., B, E), (..., B), scanned layers stacked on
  leading axes."""
  found = []
  if isinstance(intermediates, dict):
    if ROW_CHOICES in intermediates:
      found.append(tuple(intermediates[name][0] for name in (ROW_CHOICES, ROW_PROBS, ROW_TOKENS)))
    for value in intermediates.values():
      found.extend(_sown_rows(value))
  return found


def batch_routing_statistics(choices, probs, tokens):
  """A layer's per-row statistics -> per-expert fraction of routed choices (sums to k) and mean router probability,
  over the batch's real tokens: (..., E) each."""
  count = jnp.maximum(jnp.sum(tokens, axis=-1), 1.0)[..., None]
  return jnp.sum(choices, axis=-2) / count, jnp.sum(probs, axis=-2) / count


def load_balancing_loss(intermediates, num_experts: int):
  """transformers' load_balancing_loss_func from the statistics every MoE layer sowed; 0.0 without MoE layers.

  Averaging each layer's statistics over layers equals transformers' means over all layers' tokens
  concatenated: loss = num_experts * sum_e tokens_per_expert[e] * router_prob_per_expert[e]
  (num_experts_per_tok when perfectly balanced).
  """
  layers = [batch_routing_statistics(*rows) for rows in _sown_rows(intermediates)]
  if not layers:
    return jnp.zeros((), jnp.float32)
  tokens = jnp.concatenate([t.reshape(-1, num_experts) for t, _ in layers])  # (layers, E)
  probs = jnp.concatenate([p.reshape(-1, num_experts) for _, p in layers])
  return num_experts * jnp.sum(jnp.mean(tokens, axis=0) * jnp.mean(probs, axis=0))


def sequence_balance_loss(intermediates, num_experts: int, num_experts_per_tok: int):
  """DeepSeek-V3's sequence-wise balance loss (eq. 17-20) from the per-row statistics every layer sowed.

  A packed row is one sequence, as in DeepSeek-V3's training (no masking across packed documents). Per sequence
  of T real tokens: f_i = E / (k T) x (tokens choosing expert i), P_i = mean over the tokens of s_i / sum_j s_j;
  the loss sum_i f_i P_i is averaged over sequences with real tokens and over layers. 1.0 at perfect balance
  (f_i = 1, P_i = 1/E), E/k at the worst; 0.0 without such layers. The caller multiplies it by the balance factor
  alpha (load_balance_loss_weight).
  """
  layers = _sown_rows(intermediates)
  if not layers:
    return jnp.zeros((), jnp.float32)
  choices = jnp.concatenate([c.reshape(-1, num_experts) for c, _, _ in layers])  # (layers x sequences, E)
  probs = jnp.concatenate([p.reshape(-1, num_experts) for _, p, _ in layers])
  tokens = jnp.concatenate([t.reshape(-1) for _, _, t in layers])
  # f_i P_i = E / (k T) x choices_i x probs_i / T
  per_sequence = num_experts / num_experts_per_tok * jnp.sum(choices * probs, axis=-1) / jnp.maximum(tokens, 1.0) ** 2
  real = (tokens > 0).astype(jnp.float32)  # rows of padding only are left out
  return jnp.sum(per_sequence * real) / jnp.maximum(jnp.sum(real), 1.0)


def shared_experts(module: nn.Module, x):
  """The shared experts' output: a dense gated MLP of module.shared_experts x module.intermediate_dim that every token
  goes through (DeepSeek-V3's, Llama 4's), declared on `module` as shared_experts (called from its compact __call__),
  multiplying with module.gemm. x (B, T, D) -> (B, T, D)."""
  mlp = MlpBlock(
    module.shared_experts * module.intermediate_dim,
    module.activations,
    dropout_rate=0.0,
    dtype=module.dtype,
    weight_dtype=module.weight_dtype,
    fused=False,
    gemm=module.gemm,
    name="shared_experts",
  )
  return mlp(x, deterministic=True)


class MoeBlock(nn.Module):
  """Top-k routed gated-MLP experts. Params: gate/kernel (embed, E); wi_0, wi_1 (E, embed, mlp); wo (E, mlp, embed).

  GPT-OSS's options: router_bias (gate/bias (E,), added to the router's logits and trained, unlike DeepSeek's
  selection-only bias), expert_bias (wi_0_bias, wi_1_bias (E, mlp), wo_bias (E, embed)), and `activations` a callable
  gating of the wi outputs (moe_experts._gated) instead of activation names.
  """

  num_experts: int
  num_experts_per_tok: int
  intermediate_dim: int
  activations: Sequence[str] | Callable
  experts: ExpertsConfig  # how they compute: moe_experts.py
  dtype: str
  weight_dtype: str
  router_bias: bool = False
  expert_bias: bool = False

  @nn.compact
  def __call__(self, x, segment_ids):
    """x (B, T, D); segment_ids (B, T) (padding, 0, is left out of the routing statistics). Returns (B, T, D)."""
    # The router runs in float32: a bfloat16 logit can flip which experts win.
    router_logits = DenseGeneral(
      self.num_experts,
      ("embed", None),
      dtype="float32",
      weight_dtype=self.weight_dtype,
      use_bias=self.router_bias,
      name="gate",
    )(x)  # (B, T, E)
    probs, weights, experts = route(router_logits, self.num_experts_per_tok)
    sow_routing_statistics(self, probs, experts, segment_ids, self.num_experts)
    return routed_experts(
      self,
      x,
      weights,
      experts,
      self.num_experts,
      self.intermediate_dim,
      self.activations,
      self.experts,
      use_bias=self.expert_bias,
    )
