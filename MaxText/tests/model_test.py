"""Decoder numerics against an independent float64 NumPy reference, and layout/masking invariants."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.checkpoints import layer_stacking
from MaxText.configuration import common_types
from MaxText.layers import embeddings, linears, models
from MaxText.layers.attentions import dot_product_attention
from MaxText.tests import numpy_reference
from MaxText.tests.helpers import tiny_config

BATCH, LENGTH = 2, 16


def _inputs(vocab=4096, seed=1):
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (BATCH, LENGTH), 0, vocab)
  positions = jnp.broadcast_to(jnp.arange(LENGTH), (BATCH, LENGTH))
  return tokens, positions, jnp.ones((BATCH, LENGTH), jnp.int32)


def _init(config, tokens, positions):
  model = models.Transformer(config)
  params = nn.unbox(model.init(jax.random.PRNGKey(0), tokens, positions))["params"]
  return model, params


def _unrolled(params, config):
  dec = layer_stacking.unstack_layers(params["decoder"], config.num_decoder_layers, config.param_scan_axis)
  return {"token_embedder": params["token_embedder"], "decoder": dec}


@pytest.mark.parametrize("block", ["llama2", "default"])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_float64_reference(block, tied):
  config = tiny_config(f"decoder_block={block}", f"logits_via_embedding={tied}")
  tokens, positions, segments = _inputs()
  model, params = _init(config, tokens, positions)
  logits = model.apply({"params": params}, tokens, positions, segments)
  expected = numpy_reference.forward(
    _unrolled(params, config), np.asarray(tokens), np.asarray(positions), np.asarray(segments), config
  )
  np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-5, atol=1e-5)


def test_tied_logits_dot_runs_in_float32_with_logits_dot_in_fp32():
  config = tiny_config("dtype=bfloat16", "logits_via_embedding=true", "logits_dot_in_fp32=true")
  tokens, positions, segments = _inputs()
  model, params = _init(config, tokens, positions)
  logits, captured = model.apply(
    {"params": params}, tokens, positions, segments, capture_intermediates=True, mutable=["intermediates"]
  )
  (hidden,) = captured["intermediates"]["decoder"]["decoder_norm"]["__call__"]  # (B, T, E) bfloat16, the dot's input
  table = np.asarray(params["token_embedder"]["embedding"], np.float64)  # (V, E)
  scale = np.sqrt(config.emb_dim)
  expected = np.asarray(hidden, np.float64) @ table.T / scale
  in_bf16 = np.asarray(jnp.einsum("bte,ve->btv", hidden, table.astype(jnp.bfloat16)), np.float64) / scale
  np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-5, atol=1e-5)
  assert np.abs(in_bf16 - expected).max() > 100 * np.abs(np.asarray(logits) - expected).max()


def test_scanned_and_unrolled_layers_give_identical_logits():
  tokens, positions, _ = _inputs()
  scanned = tiny_config("scan_layers=true")
  model, params = _init(scanned, tokens, positions)
  unrolled_model = models.Transformer(tiny_config("scan_layers=false"))
  a = model.apply({"params": params}, tokens, positions)
  b = unrolled_model.apply({"params": _unrolled(params, scanned)}, tokens, positions)
  # Same math, different XLA fusion: float32 round-off only.
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_dropout_masks_are_each_layers_own_whether_scanned_or_unrolled():
  """A layer's masks come from its index (layers/dropout.py), not from Flax's module paths; the pipeline relies on it."""
  tokens, positions, _ = _inputs()
  scanned = tiny_config("scan_layers=true", "dropout_rate=0.5")
  model, params = _init(scanned, tokens, positions)
  unrolled_model = models.Transformer(tiny_config("scan_layers=false", "dropout_rate=0.5"))
  rngs = {"dropout": jax.random.PRNGKey(3)}
  a = model.apply({"params": params}, tokens, positions, deterministic=False, rngs=rngs)
  b = unrolled_model.apply({"params": _unrolled(params, scanned)}, tokens, positions, deterministic=False, rngs=rngs)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  other = model.apply({"params": params}, tokens, positions, deterministic=False, rngs={"dropout": jax.random.PRNGKey(4)})
  assert np.abs(np.asarray(a) - np.asarray(other)).max() > 1e-2  # the masks act, and follow the key


def test_unstack_then_stack_is_identity():
  config = tiny_config()
  _, params = _init(config, *_inputs()[:2])
  restacked = layer_stacking.stack_layers(_unrolled(params, config)["decoder"], config.num_decoder_layers, 1)
  jax.tree.map(np.testing.assert_array_equal, restacked, params["decoder"])


def test_packed_segments_give_the_same_logits_as_separate_rows():
  config = tiny_config()
  doc_a = jax.random.randint(jax.random.PRNGKey(3), (6,), 0, 4096)
  doc_b = jax.random.randint(jax.random.PRNGKey(4), (10,), 0, 4096)
  packed = jnp.concatenate([doc_a, doc_b])[None]
  packed_pos = jnp.concatenate([jnp.arange(6), jnp.arange(10)])[None]
  packed_seg = jnp.concatenate([jnp.ones(6, jnp.int32), 2 * jnp.ones(10, jnp.int32)])[None]
  model, params = _init(config, packed, packed_pos)
  packed_logits = model.apply({"params": params}, packed, packed_pos, packed_seg)
  alone_a = model.apply({"params": params}, doc_a[None], jnp.arange(6)[None])
  alone_b = model.apply({"params": params}, doc_b[None], jnp.arange(10)[None])
  np.testing.assert_allclose(packed_logits[0, :6], alone_a[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed_logits[0, 6:], alone_b[0], rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_equals_repeated_kv_heads():
  q = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 6, 4))
  k = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 2, 4))
  v = jax.random.normal(jax.random.PRNGKey(2), (2, 8, 2, 4))
  seg = jnp.ones((2, 8), jnp.int32)
  gqa = dot_product_attention(q, k, v, seg)
  mha = dot_product_attention(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2), seg)
  np.testing.assert_allclose(gqa, mha, rtol=1e-6, atol=1e-6)
  # Causality: the first output position only sees the first key.
  np.testing.assert_allclose(gqa[:, 0], jnp.repeat(v, 3, axis=2)[:, 0], rtol=1e-6, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
  q = jax.random.normal(jax.random.PRNGKey(0), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.PRNGKey(1), (1, 1, 1, 16))

  def score(pq, pk):
    rq = embeddings.apply_rotary_embedding(q, jnp.array([[pq]]), 1, 10_000)
    rk = embeddings.apply_rotary_embedding(k, jnp.array([[pk]]), 1, 10_000)
    return float(jnp.sum(rq * rk))

  assert score(5, 2) == pytest.approx(score(103, 100), rel=1e-5)
  assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


def test_weights_and_activations_use_their_dtypes():
  config = tiny_config("dtype=bfloat16", "weight_dtype=bfloat16")
  tokens, positions, _ = _inputs()
  model, params = _init(config, tokens, positions)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  assert model.apply({"params": params}, tokens, positions).dtype == jnp.float32  # logits are float32
  _, f32_params = _init(tiny_config(), tokens, positions)
  assert {x.dtype for x in jax.tree.leaves(f32_params)} == {jnp.dtype(jnp.float32)}


def test_every_logical_axis_of_params_has_a_rule():
  config = tiny_config()
  tokens, positions, _ = _inputs()
  boxed = jax.eval_shape(models.Transformer(config).init, jax.random.PRNGKey(0), tokens, positions)
  names = {n for spec in jax.tree.leaves(nn.get_partition_spec(boxed)) for n in spec if n}
  assert names <= {rule[0] for rule in config.logical_axis_rules}


def test_tables_cover_the_validated_names():
  assert set(models.DECODER_BLOCKS) == set(common_types.DECODER_BLOCKS)
  assert set(models.REMAT_POLICIES) | {"custom"} == set(common_types.REMAT_POLICIES)  # custom: from the config (remat.py)
  assert set(linears.ACTIVATIONS) == set(common_types.MLP_ACTIVATIONS)
