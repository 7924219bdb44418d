"""Mixture of experts (decoder_block=mixtral): routing, capacity drops and the load-balancing loss against numpy
references; the loss in every layer layout; the real train.py entry point. Expert parallelism on 8 CPU devices
is in multi_device_test.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import pyconfig
from MaxText.checkpoints import layer_stacking
from MaxText.features import selection
from MaxText.layers import expert_order, models, moe, moe_experts
from MaxText.runtime import mesh, sharding
from MaxText.tests.helpers import BASE_YML, run_train, tiny_config
from MaxText.training import train_step, training_setup

E, K, D, M = 4, 2, 8, 16  # experts, experts per token, embed, mlp
MIXTRAL = ["decoder_block=mixtral", f"num_experts={E}", f"num_experts_per_tok={K}"]


def _softmax(x):
  x = np.exp(x - x.max(-1, keepdims=True))
  return x / x.sum(-1, keepdims=True)


def _silu(x):
  return x / (1 + np.exp(-x))


def _moe_block(capacity_factor=-1.0, sparse_matmul=True):
  experts = moe_experts.ExpertsConfig(capacity_factor, sparse_matmul)
  return moe.MoeBlock(E, K, M, ("silu", "linear"), experts, "float32", "float32")


def _block_and_params(capacity_factor=-1.0, shape=(2, 6), sparse_matmul=True):
  block = _moe_block(capacity_factor, sparse_matmul)
  x = jax.random.normal(jax.random.PRNGKey(0), (*shape, D))
  variables = nn.unbox(block.init(jax.random.PRNGKey(1), x, jnp.ones(shape, jnp.int32)))
  params = jax.tree.map(lambda a: np.asarray(a, np.float64), variables["params"])
  return block, variables, x, params


def _reference(x, params, capacity=None):
  """Loops over tokens in float64: softmax router, top-k, renormalised weights, SiLU-gated experts.

  With a capacity, each sequence's expert takes choices in (token, rank) order until it holds `capacity`.
  Returns the output and the (B, T, k) mask of kept choices.
  """
  x = np.asarray(x, np.float64)
  probs = _softmax(x @ params["gate"]["kernel"])
  out, kept = np.zeros_like(x), np.zeros((*x.shape[:2], K), bool)
  for b in range(x.shape[0]):
    load = np.zeros(E, int)
    for t in range(x.shape[1]):
      top = np.argsort(-probs[b, t], kind="stable")[:K]
      weights = probs[b, t, top] / probs[b, t, top].sum()
      for j, e in enumerate(top):
        if capacity is not None and load[e] >= capacity:
          continue
        load[e] += 1
        kept[b, t, j] = True
        h = _silu(x[b, t] @ params["wi_0"][e]) * (x[b, t] @ params["wi_1"][e])
        out[b, t] += weights[j] * (h @ params["wo"][e])
  return out, kept


@pytest.mark.parametrize("sparse_matmul", [True, False])  # dropless grouped matmuls | dense over every expert
def test_routing_matches_a_numpy_reference(sparse_matmul):
  block, variables, x, params = _block_and_params(sparse_matmul=sparse_matmul)
  logits = np.asarray(x, np.float64) @ params["gate"]["kernel"]
  probs = _softmax(logits)
  _, weights, experts = moe.route(jnp.asarray(logits, jnp.float32), K)
  np.testing.assert_array_equal(experts, np.argsort(-probs, axis=-1)[..., :K])
  top = np.take_along_axis(probs, np.asarray(experts), axis=-1)
  np.testing.assert_allclose(weights, top / top.sum(-1, keepdims=True), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)

  expected, _ = _reference(x, params)
  np.testing.assert_allclose(block.apply(variables, x, jnp.ones(x.shape[:2], jnp.int32)), expected, atol=1e-5)
  # The same under a (1-device) mesh, where the dropless path runs under shard_map.
  config = tiny_config(*MIXTRAL)
  with sharding.logical_context(mesh.create_device_mesh(config), config):
    on_mesh = jax.jit(lambda v, x: block.apply(v, x, jnp.ones(x.shape[:2], jnp.int32)))(variables, x)
  np.testing.assert_allclose(on_mesh, expected, atol=1e-5)


@pytest.mark.parametrize("sparse_matmul", [True, False])  # grouped matmuls | dense per-expert buffers
def test_capacity_factor_drops_exactly_the_reference_tokens(sparse_matmul):
  capacity_factor = 0.5  # C = int(8 * 2 / 4 * 0.5) = 2 choices per expert and sequence
  block, variables, x, params = _block_and_params(capacity_factor, shape=(3, 8), sparse_matmul=sparse_matmul)
  capacity = moe_experts.expert_capacity(8, K, E, capacity_factor)
  assert capacity == 2
  expected, expected_kept = _reference(x, params, capacity)
  assert 0 < expected_kept.sum() < expected_kept.size  # some choices are dropped, not all

  _, _, experts = moe.route(jnp.asarray(x) @ jnp.asarray(params["gate"]["kernel"], jnp.float32), K)
  _, kept = moe_experts.capacity_slots(experts, E, capacity)
  np.testing.assert_array_equal(kept, expected_kept)
  np.testing.assert_allclose(block.apply(variables, x, jnp.ones(x.shape[:2], jnp.int32)), expected, atol=1e-5)
  # A capacity that holds every choice is the dropless result.
  roomy = _moe_block(float(E), sparse_matmul)
  np.testing.assert_allclose(
    roomy.apply(variables, x, jnp.ones(x.shape[:2], jnp.int32)), _reference(x, params)[0], atol=1e-5
  )


def _transformers_lb_loss(gate_logits, mask):
  """transformers' load_balancing_loss_func: all layers' tokens concatenated, padding (mask 0) left out."""
  logits = np.concatenate(gate_logits)  # (L*N, E)
  mask = np.tile(mask, len(gate_logits))[:, None]  # (L*N, 1)
  probs = _softmax(logits)
  expert_mask = np.eye(E)[np.argsort(-probs, axis=-1)[:, :K]]  # (L*N, k, E)
  tokens_per_expert = (expert_mask * mask[:, :, None]).sum(0) / mask.sum()  # (k, E)
  router_prob_per_expert = (probs * mask).sum(0) / mask.sum()  # (E,)
  return E * np.sum(tokens_per_expert * router_prob_per_expert[None])


def test_load_balancing_loss_matches_the_transformers_formula():
  block, variables, x, params = _block_and_params(shape=(2, 6))
  x2 = jax.random.normal(jax.random.PRNGKey(2), x.shape)
  segments = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])  # 0: padding, left out
  sown = {}
  for name, inputs in (("layers_0", x), ("layers_1", x2)):
    _, state = block.apply(variables, inputs, segments, mutable=["intermediates"])
    sown[name] = state["intermediates"]
  gate = params["gate"]["kernel"]
  expected = _transformers_lb_loss(
    [np.asarray(v, np.float64).reshape(-1, D) @ gate for v in (x, x2)], np.asarray(segments).reshape(-1) != 0
  )
  np.testing.assert_allclose(moe.load_balancing_loss(sown, E), expected, rtol=1e-5)
  assert moe.load_balancing_loss({}, E) == 0.0


def _batch(config):
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, config.max_target_length + 1), 0, config.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(config.max_target_length), (2, config.max_target_length))
  segments = jnp.ones_like(positions).at[1, -5:].set(0)
  return {
    "inputs": tokens[:, :-1],
    "inputs_position": positions,
    "inputs_segmentation": segments,
    "targets": tokens[:, 1:],
    "targets_segmentation": segments,
  }


def test_the_loss_adds_the_load_balancing_term_in_every_layer_layout():
  """Scanned or unrolled layers, with or without remat: the routing statistics reach the loss alike."""
  results = {}
  params = None
  for scan, remat in ((False, "none"), (True, "full"), (False, "full")):
    config = tiny_config(*MIXTRAL, f"scan_layers={scan}", f"remat_policy={remat}")
    model = training_setup.create_model(config)
    batch = _batch(config)
    if params is None:
      init = model.init(jax.random.PRNGKey(0), batch["inputs"], batch["inputs_position"])
      params = nn.unbox(init["params"])
    layer_params = params
    if scan:
      decoder = layer_stacking.stack_layers(params["decoder"], config.num_decoder_layers, config.param_scan_axis)
      layer_params = {**params, "decoder": decoder}
    terms = jax.jit(
      lambda p, b, m=model, c=config: train_step.loss_fn(m, c, selection.for_config(c), p, b, jax.random.PRNGKey(0), True)
    )
    total, (weights, aux, *_) = terms(layer_params, batch)
    lb = aux["moe_lb_loss"]
    if not results:
      eval_total, (_, eval_aux, *_) = train_step.loss_fn(
        model, config, selection.for_config(config), params, batch, jax.random.PRNGKey(0), False
      )
      assert "moe_lb_loss" not in eval_aux  # eval is cross-entropy only
      np.testing.assert_allclose(total - lb, eval_total, rtol=1e-6)
    results[(scan, remat)] = (float(total), float(lb) / float(weights))
  (_, lb_weighted), *_ = results.values()
  # load_balance_loss_weight (0.01) x a loss near k=2 (balanced routing at init).
  assert 0.01 * 1.0 < lb_weighted < 0.01 * E
  for value in results.values():
    np.testing.assert_allclose(value, results[(False, "none")], rtol=1e-5)


@pytest.mark.parametrize("name, published", [("mixtral-8x7b", 46.7e9), ("mixtral-8x22b", 141e9)])
def test_preset_parameter_count_matches_the_published_count(name, published):
  """Counted from jax.eval_shape (nothing allocated); within 1% of Mistral AI's published totals."""
  config = pyconfig.initialize(
    ["test", BASE_YML, "run_name=test", f"model_name={name}", "per_device_batch_size=1", "max_target_length=8"], environ={}
  )
  tokens = jnp.ones((1, 8), jnp.int32)
  shapes = jax.eval_shape(models.Transformer(config).init, jax.random.PRNGKey(0), tokens, tokens)["params"]
  count = sum(x.size for x in jax.tree.leaves(nn.unbox(shapes)))
  assert abs(count - published) / published < 0.01, (name, count)


_RUN = [*MIXTRAL, "steps=5", "learning_rate=1e-2", "enable_checkpointing=false"]


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
  """The tiny mixtral trained by `python3 MaxText/train.py` on one device: (process, metrics lines)."""
  tmp_path = tmp_path_factory.mktemp("one")
  return run_train(tmp_path, "one", *_RUN, "per_device_batch_size=8")


def test_train_py_trains_a_tiny_mixtral_and_logs_the_load_balancing_loss(one_device_run):
  result, metrics = one_device_run
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(metrics) == 5 and metrics[-1]["learning/loss"] < metrics[0]["learning/loss"]
  assert all(0 < m["learning/moe_lb_loss"] < 0.01 * E for m in metrics)
  assert "moe_lb_loss: " in result.stdout + result.stderr


def test_sorting_pairs_by_expert_and_back_has_the_gathers_gradients_without_a_scatter():
  """expert_order's custom VJPs (gathers by the inverse order) give the plain indexing's values and gradients, and
  the backward pass has no scatter (the TPU compiler's scatter buffers are as large as the pairs)."""
  rng = np.random.default_rng(0)
  n, k, dim = 10, 3, 4
  x = jnp.asarray(rng.normal(size=(n, dim)), jnp.float32)
  experts = jnp.asarray(rng.integers(0, 5, n * k))
  scale = jnp.asarray(rng.normal(size=(n * k, dim)), jnp.float32)  # a different weight for every sorted row

  def plain(x):
    order = jnp.argsort(experts, stable=True)
    return jnp.sum(jnp.sin((x[order // k] * scale)[jnp.argsort(order)]))

  def ours(x):
    order = expert_order.Order(experts, k)
    return jnp.sum(jnp.sin(expert_order.unsorted_pairs(expert_order.sorted_pairs(x, order) * scale, order)))

  np.testing.assert_allclose(ours(x), plain(x), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(plain)(x), rtol=1e-5, atol=1e-6)
  assert "scatter" in str(jax.make_jaxpr(jax.grad(plain))(x))
  assert "scatter" not in str(jax.make_jaxpr(jax.grad(ours))(x))
