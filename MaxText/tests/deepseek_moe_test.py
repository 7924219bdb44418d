"""DeepSeek-V3's MoE feed-forward (deepseek_moe.DeepSeekMoeBlock): the block against transformers' DeepseekV3MoE,
group-limited and bias-steered routing, the routing-bias update and the sequence-wise balance loss."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from MaxText.layers import deepseek_moe, moe, moe_experts

E, K, D, M = 8, 2, 16, 8  # experts, experts per token, embed, mlp per expert
GROUPS, TOPK_GROUPS, SHARED, SCALE = 4, 2, 1, 2.5


def _block(capacity_factor=-1.0):
  return deepseek_moe.DeepSeekMoeBlock(
    num_experts=E,
    num_experts_per_tok=K,
    intermediate_dim=M,
    shared_experts=SHARED,
    n_routing_groups=GROUPS,
    topk_routing_group=TOPK_GROUPS,
    routed_scaling_factor=SCALE,
    norm_topk_prob=True,
    experts=moe_experts.ExpertsConfig(capacity_factor),
    activations=("silu", "linear"),
    dtype="float32",
    weight_dtype="float32",
  )


def _variables(shape=(2, 6)):
  """The block's variables with a nonzero routing bias, and an input."""
  x = jax.random.normal(jax.random.PRNGKey(0), (*shape, D))
  variables = nn.unbox(_block().init(jax.random.PRNGKey(1), x, jnp.ones(shape, jnp.int32)))
  bias = 0.2 * jax.random.normal(jax.random.PRNGKey(2), (E,))
  params = {**variables["params"], "gate": {**variables["params"]["gate"], "bias": bias}}
  return {"params": params}, x


def _transformers_moe(params):
  """transformers' DeepseekV3MoE holding the Flax params (the HF <- Flax table, transposes included)."""
  config = DeepseekV3Config(
    hidden_size=D,
    n_routed_experts=E,
    num_experts_per_tok=K,
    n_group=GROUPS,
    topk_group=TOPK_GROUPS,
    moe_intermediate_size=M,
    n_shared_experts=SHARED,
    routed_scaling_factor=SCALE,
    norm_topk_prob=True,
    hidden_act="silu",
  )
  config._experts_implementation = "eager"
  hf = DeepseekV3MoE(config).eval()

  def t(a, *perm):
    return torch.tensor(np.asarray(a, np.float32)).permute(*perm).contiguous()

  shared = params["shared_experts"]
  with torch.no_grad():
    hf.gate.weight.copy_(t(params["gate"]["kernel"], 1, 0))  # (E, D) <- (D, E)
    hf.gate.e_score_correction_bias.copy_(t(params["gate"]["bias"], 0))
    # gate_up_proj (E, 2M, D): the gate (wi_0) rows, then the up (wi_1) rows.
    hf.experts.gate_up_proj.copy_(torch.cat([t(params["wi_0"], 0, 2, 1), t(params["wi_1"], 0, 2, 1)], dim=1))
    hf.experts.down_proj.copy_(t(params["wo"], 0, 2, 1))  # (E, D, M) <- (E, M, D)
    hf.shared_experts.gate_proj.weight.copy_(t(shared["wi_0"]["kernel"], 1, 0))
    hf.shared_experts.up_proj.weight.copy_(t(shared["wi_1"]["kernel"], 1, 0))
    hf.shared_experts.down_proj.weight.copy_(t(shared["wo"]["kernel"], 1, 0))
  return hf


def test_params_and_their_logical_axes():
  x = jnp.zeros((1, 4, D))
  boxed = _block().init(jax.random.PRNGKey(0), x, jnp.ones((1, 4), jnp.int32))["params"]
  names = jax.tree.map(lambda b: b.names, boxed, is_leaf=lambda b: isinstance(b, nn.Partitioned))
  assert names == {
    "gate": {"kernel": ("embed", None), "bias": (None,)},
    "wi_0": ("exp", "embed_no_exp", "mlp"),
    "wi_1": ("exp", "embed_no_exp", "mlp"),
    "wo": ("exp", "mlp", "embed_no_exp"),
    "shared_experts": {
      "wi_0": {"kernel": ("embed", "mlp")},
      "wi_1": {"kernel": ("embed", "mlp")},
      "wo": {"kernel": ("mlp", "embed")},
    },
  }
  params = nn.unbox(boxed)
  assert params["shared_experts"]["wi_0"]["kernel"].shape == (D, SHARED * M)
  assert params["gate"]["bias"].dtype == jnp.float32 and not params["gate"]["bias"].any()


def test_block_matches_transformers_deepseek_v3_moe():
  variables, x = _variables()
  params = variables["params"]
  hf = _transformers_moe(params)
  x_torch = torch.tensor(np.asarray(x))
  with torch.no_grad():
    expected = hf(x_torch).numpy()
    _, hf_weights, hf_experts = hf.gate(x_torch)
  segments = jnp.ones(x.shape[:2], jnp.int32)
  np.testing.assert_allclose(_block().apply(variables, x, segments), expected, rtol=1e-5, atol=1e-5)

  logits = jnp.einsum("btd,de->bte", x, params["gate"]["kernel"])
  _, weights, experts = moe.route_sigmoid_grouped(logits, params["gate"]["bias"], K, GROUPS, TOPK_GROUPS, SCALE, True)
  # transformers' topk(sorted=False) has no promised order: compare each token's choices as sets.
  order = np.argsort(np.asarray(experts).reshape(-1, K), axis=-1)
  hf_order = np.argsort(hf_experts.numpy(), axis=-1)
  np.testing.assert_array_equal(
    np.take_along_axis(np.asarray(experts).reshape(-1, K), order, -1), np.take_along_axis(hf_experts.numpy(), hf_order, -1)
  )
  np.testing.assert_allclose(
    np.take_along_axis(np.asarray(weights).reshape(-1, K), order, -1),
    np.take_along_axis(hf_weights.numpy(), hf_order, -1),
    rtol=1e-6,
  )
  # The data exercise both: the bias and the group limit each change some token's experts.
  _, _, unbiased = moe.route_sigmoid_grouped(logits, jnp.zeros(E), K, GROUPS, TOPK_GROUPS, SCALE, True)
  _, _, ungrouped = moe.route_sigmoid_grouped(logits, params["gate"]["bias"], K, 1, 1, SCALE, True)
  assert (np.sort(unbiased, -1) != np.sort(experts, -1)).any()
  assert (np.sort(ungrouped, -1) != np.sort(experts, -1)).any()

  # A capacity that holds every choice is the dropless result.
  roomy = _block(capacity_factor=float(E)).apply(variables, x, segments)
  np.testing.assert_allclose(roomy, expected, rtol=1e-5, atol=1e-5)


def _logits(scores):
  scores = np.asarray(scores, np.float64)
  return jnp.asarray(np.log(scores / (1 - scores)), jnp.float32)  # sigmoid(logits) = scores


def test_group_limit_picks_experts_from_the_best_groups_only():
  # Groups of 2 scored by their two scores' sum: 1.0, 1.22, 1.15, 0.4. Plain top-2: experts 0 (0.9) and 2 (0.62);
  # with the two best groups (1, 2) only: experts 2 (0.62) and 3 (0.6).
  scores = [0.9, 0.1, 0.62, 0.6, 0.58, 0.57, 0.2, 0.2]
  _, weights, experts = moe.route_sigmoid_grouped(_logits(scores), jnp.zeros(E), K, GROUPS, TOPK_GROUPS, SCALE, True)
  assert sorted(np.asarray(experts).tolist()) == [2, 3]
  np.testing.assert_allclose(weights, SCALE * np.array([0.62, 0.6]) / 1.22, rtol=1e-6)
  _, _, plain = moe.route_sigmoid_grouped(_logits(scores), jnp.zeros(E), K, 1, 1, SCALE, True)
  assert sorted(np.asarray(plain).tolist()) == [0, 2]


def test_bias_changes_the_selection_but_weights_use_the_unbiased_scores():
  scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
  bias = jnp.zeros(E).at[6].set(0.7)  # expert 6: 0.3 + 0.7 = 1.0 beats expert 0's 0.9
  probs, weights, experts = moe.route_sigmoid_grouped(_logits(scores), bias, K, 1, 1, SCALE, True)
  assert np.asarray(experts).tolist() == [6, 0]
  np.testing.assert_allclose(weights, SCALE * np.array([0.3, 0.9]) / 1.2, rtol=1e-6)
  np.testing.assert_allclose(probs, scores / scores.sum(), rtol=1e-6)
  _, unnormalised, _ = moe.route_sigmoid_grouped(_logits(scores), bias, K, 1, 1, SCALE, False)
  np.testing.assert_allclose(unnormalised, SCALE * np.array([0.3, 0.9]), rtol=1e-6)
  # No gradient reaches the bias: the optimizer has nothing to learn there, the bias update moves it.
  grad = jax.grad(lambda b: jnp.sum(moe.route_sigmoid_grouped(_logits(scores), b, K, 1, 1, SCALE, True)[1]))(bias)
  assert not np.asarray(grad).any()


def test_update_routing_bias_moves_by_exactly_the_rate():
  rate = 0.125  # a power of 2, so every sum below is exact
  bias = jnp.array([0.5, -0.25, 0.0, 1.0])
  load = jnp.array([0.9, 0.3, 0.4, 0.4])  # mean 0.5: expert 0 overloaded, 1-3 underloaded
  np.testing.assert_array_equal(moe.update_routing_bias(bias, load, rate), [0.375, -0.125, 0.125, 1.125])
  balanced = jnp.full(4, 0.5)
  np.testing.assert_array_equal(moe.update_routing_bias(bias, balanced, rate), bias)
  # Layers stacked on a leading axis update independently; raw counts act as fractions.
  stacked = moe.update_routing_bias(jnp.zeros((2, 4)), jnp.array([[9, 3, 4, 4], [1, 1, 1, 5]]), rate)
  np.testing.assert_array_equal(stacked, [[-rate, rate, rate, rate], [rate, rate, rate, -rate]])

  # From the block's sown statistics: the most loaded expert's bias falls, the least loaded one's rises.
  variables, x = _variables()
  _, state = _block().apply(variables, x, jnp.ones(x.shape[:2], jnp.int32), mutable=["intermediates"])
  sown = state["intermediates"]
  tokens = sown[moe.ROW_CHOICES][0].sum(0) / sown[moe.ROW_TOKENS][0].sum()  # each expert's choices per real token
  np.testing.assert_allclose(tokens.sum(), K, rtol=1e-6)
  bias = variables["params"]["gate"]["bias"]
  step = np.asarray(moe.update_routing_bias(bias, tokens, 1e-3) - bias)
  assert step[np.argmax(tokens)] < 0 < step[np.argmin(tokens)]


def _sequence_loss_reference(scores, experts, segments):
  """DeepSeek-V3 eq. 17-20 by loops, averaged over (layer, sequence) pairs with real tokens."""
  losses = []
  for layer_scores, layer_experts in zip(scores, experts):
    for b in range(segments.shape[0]):
      real = np.flatnonzero(segments[b])
      if not len(real):
        continue
      counts = np.bincount(layer_experts[b, real].reshape(-1), minlength=E)
      f = E / (K * len(real)) * counts
      normalised = layer_scores[b, real] / layer_scores[b, real].sum(-1, keepdims=True)
      losses.append(np.sum(f * normalised.mean(0)))
  return np.mean(losses)


def test_sequence_balance_loss_matches_the_paper_and_leaves_out_padding():
  variables, x = _variables(shape=(3, 6))
  x2 = jax.random.normal(jax.random.PRNGKey(5), x.shape)
  segments = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0], [0] * 6])  # 0: padding; row 3 is padding only
  params = variables["params"]
  sown, scores, experts = {}, [], []
  for name, inputs in (("layers_0", x), ("layers_1", x2)):
    _, state = _block().apply(variables, inputs, jnp.asarray(segments), mutable=["intermediates"])
    sown[name] = state["intermediates"]
    logits = np.asarray(inputs, np.float64) @ np.asarray(params["gate"]["kernel"], np.float64)
    scores.append(1 / (1 + np.exp(-logits)))
    chosen = moe.route_sigmoid_grouped(
      jnp.asarray(logits, jnp.float32), params["gate"]["bias"], K, GROUPS, TOPK_GROUPS, SCALE, True
    )
    experts.append(np.asarray(chosen[2]))
  loss = moe.sequence_balance_loss(sown, E, K)
  np.testing.assert_allclose(loss, _sequence_loss_reference(scores, experts, segments), rtol=1e-5)

  # Padding tokens do not count: changing them leaves the loss as it was.
  noisy = jnp.where(jnp.asarray(segments)[..., None] == 0, 100.0, x)
  _, state = _block().apply(variables, noisy, jnp.asarray(segments), mutable=["intermediates"])
  np.testing.assert_allclose(moe.sequence_balance_loss({**sown, "layers_0": state["intermediates"]}, E, K), loss, rtol=1e-6)

  # Perfect balance (f_i = 1, P_i = 1/E) gives 1.0; every token on the same k experts with all its score there, E/k.
  tokens = (jnp.full((2,), 6.0),)  # two rows of 6 real tokens
  balanced = {moe.ROW_CHOICES: (jnp.full((2, E), 6 * K / E),), moe.ROW_PROBS: (jnp.full((2, E), 6 / E),)}
  np.testing.assert_allclose(
    moe.sequence_balance_loss({"layers_0": {**balanced, moe.ROW_TOKENS: tokens}}, E, K), 1.0, rtol=1e-6
  )
  worst = {
    moe.ROW_CHOICES: (jnp.zeros((2, E)).at[:, :K].set(6.0),),
    moe.ROW_PROBS: (jnp.zeros((2, E)).at[:, :K].set(6 / K),),
    moe.ROW_TOKENS: tokens,
  }
  np.testing.assert_allclose(moe.sequence_balance_loss({"layers_0": worst}, E, K), E / K, rtol=1e-6)
  assert moe.sequence_balance_loss({}, E, K) == 0.0
