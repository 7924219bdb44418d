"""Sampling strategies against simple references: what each may pick, and how often."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration import common_types
from MaxText.generation import sampling

_DRAWS = 4000


def _logits(rows=3, vocab=12, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(rows, vocab)) * 2, jnp.float32)


def _draws(logits, strategy, **options):
  """(_DRAWS, B) samples, one key per draw."""
  keys = jax.random.split(jax.random.PRNGKey(1), _DRAWS)
  return np.asarray(jax.jit(jax.vmap(lambda k: sampling.sample(logits, k, strategy, **options)))(keys))


def _frequencies(draws, vocab):
  return np.stack([np.bincount(draws[:, b], minlength=vocab) / len(draws) for b in range(draws.shape[1])])


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_strategies_match_the_config_choices():
  assert sampling.STRATEGIES == common_types.DECODE_SAMPLING_STRATEGIES


def test_greedy_is_argmax():
  logits = _logits()
  out = sampling.sample(logits, jax.random.PRNGKey(0), "greedy")
  np.testing.assert_array_equal(out, np.argmax(np.asarray(logits), -1))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_weighted_follows_softmax_of_logits_over_temperature(temperature):
  logits = _logits()
  freq = _frequencies(_draws(logits, "weighted", temperature=temperature), logits.shape[-1])
  expected = _softmax(np.asarray(logits) / temperature)
  np.testing.assert_allclose(freq, expected, atol=0.03)  # 4000 draws: the standard error is at most 0.008


def test_low_temperature_approaches_greedy():
  logits = _logits()
  draws = _draws(logits, "weighted", temperature=1e-3)
  assert (draws == np.argmax(np.asarray(logits), -1)).all()


@pytest.mark.parametrize("k", [1, 3])
def test_topk_never_leaves_the_top_k_and_renormalises(k):
  logits = _logits()
  draws = _draws(logits, "topk", top_k=k, temperature=0.7)
  reference = np.asarray(logits) / 0.7
  top = np.argsort(-reference, -1)[:, :k]
  for b in range(logits.shape[0]):
    assert set(draws[:, b]) <= set(top[b])
    expected = np.zeros(logits.shape[-1])
    expected[top[b]] = _softmax(reference[b, top[b]])
    np.testing.assert_allclose(_frequencies(draws, logits.shape[-1])[b], expected, atol=0.03)


def test_nucleus_with_p_0_keeps_the_top_token_only_as_upstream():
  logits = _logits()
  draws = _draws(logits, "nucleus", nucleus_p=0.0)
  assert (draws == np.argmax(np.asarray(logits), -1)[None, :]).all()


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_nucleus_keeps_the_smallest_set_reaching_p(p):
  logits = _logits()
  draws = _draws(logits, "nucleus", nucleus_p=p)
  probs = _softmax(np.asarray(logits))
  for b in range(logits.shape[0]):
    order = np.argsort(-probs[b])
    size = int(np.searchsorted(np.cumsum(probs[b, order]), p) + 1)  # the first prefix whose sum reaches p
    nucleus = order[:size]
    assert probs[b, order[: size - 1]].sum() < p <= probs[b, nucleus].sum() + 1e-6
    assert set(draws[:, b]) <= set(nucleus)
    expected = np.zeros(logits.shape[-1])
    expected[nucleus] = probs[b, nucleus] / probs[b, nucleus].sum()
    np.testing.assert_allclose(_frequencies(draws, logits.shape[-1])[b], expected, atol=0.03)


def test_nucleus_p_one_is_weighted_and_tiny_p_is_greedy():
  logits = _logits()
  masked = sampling.nucleus_logits(logits, 1.0)
  np.testing.assert_array_equal(masked, logits)
  draws = _draws(logits, "nucleus", nucleus_p=1e-6)
  assert (draws == np.argmax(np.asarray(logits), -1)).all()


def test_rows_are_sampled_independently():
  # Identical rows, one key: the rows must still differ (one draw per row), with the same distribution.
  logits = jnp.zeros((2, 50))
  draws = _draws(logits, "weighted")
  assert np.mean(draws[:, 0] == draws[:, 1]) < 0.1  # independent: 1/50 agree by chance
  one = sampling.sample(jnp.zeros((64, 50)), jax.random.PRNGKey(3), "weighted")
  assert len(set(np.asarray(one).tolist())) > 20


def test_unknown_strategy_is_an_error():
  with pytest.raises(ValueError, match="beam"):
    sampling.sample(_logits(), jax.random.PRNGKey(0), "beam")
