"""opt_type: Pax's Adam (adam_pax) against its formulas in numpy, SGD, and the gpt3 presets' choice, as upstream's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText.tests.helpers import tiny_config
from MaxText.training import optimizers

STEPS = 4


def _grads(step):
  rng = np.random.default_rng(step)
  return {"w": rng.normal(size=(3, 2)).astype(np.float32), "b": rng.normal(size=(2,)).astype(np.float32)}


def _run(config):
  schedule = optimizers.create_learning_rate_schedule(config)
  tx = optimizers.create_optimizer(config, schedule)
  params = {"w": jnp.ones((3, 2)), "b": jnp.full((2,), 0.5)}
  state = tx.init(params)
  for step in range(STEPS):
    updates, state = tx.update(jax.tree.map(jnp.asarray, _grads(step)), state, params)
    params = optax.apply_updates(params, updates)
  return jax.tree.map(np.asarray, params), schedule


def _adam_pax_reference(config, schedule):
  """Upstream's adam_pax update, written from its formulas in float64."""
  b1, b2, eps, eps_root, wd = (
    config.adam_b1,
    config.adam_b2,
    config.adam_eps,
    config.adam_eps_root,
    config.adam_weight_decay,
  )
  params = {"w": np.ones((3, 2)), "b": np.full((2,), 0.5)}
  mu = {k: np.zeros_like(v) for k, v in params.items()}
  nu = {k: np.zeros_like(v) for k, v in params.items()}
  for step in range(STEPS):
    t = step + 1
    d1, d2 = (b * (1 - b ** (t - 1)) / (1 - b**t) for b in (b1, b2))
    for k, g in _grads(step).items():
      mu[k] = (1 - d1) * g + d1 * mu[k]
      nu[k] = (1 - d2) * g * g + d2 * nu[k]
      params[k] = params[k] - float(schedule(step)) * (mu[k] / (np.sqrt(nu[k] + eps_root) + eps) + wd * params[k])
  return params


def test_adam_pax_follows_upstreams_formulas():
  config = tiny_config(
    "opt_type=adam_pax",
    "learning_rate=1e-2",
    "warmup_steps_fraction=0",
    "steps=10",
    "gradient_clipping_threshold=0",
    "adam_eps_root=1e-6",
  )
  got, schedule = _run(config)
  expected = _adam_pax_reference(config, schedule)
  for key in expected:
    np.testing.assert_allclose(got[key], expected[key], rtol=1e-5)
  # Pax's corrected decay is Adam's bias correction folded into the moments: AdamW takes the same steps, up to
  # float32 rounding (upstream's choice of adam_pax for gpt3 is about its state and rounding, not another method).
  adamw, _ = _run(config.replace(opt_type="adamw"))
  np.testing.assert_allclose(adamw["w"], got["w"], rtol=1e-5)


def test_sgd_steps_against_the_gradient():
  config = tiny_config(
    "opt_type=sgd", "learning_rate=1e-1", "warmup_steps_fraction=0", "steps=10", "gradient_clipping_threshold=0"
  )
  got, schedule = _run(config)
  expected = np.ones((3, 2)) - sum(float(schedule(s)) * _grads(s)["w"] for s in range(STEPS))
  np.testing.assert_allclose(got["w"], expected, rtol=1e-6)


@pytest.mark.parametrize("preset", ["gpt3-52k", "gpt3-6b", "gpt3-22b", "gpt3-175b"])
def test_gpt3_presets_train_with_adam_pax_as_upstream(preset):
  config = tiny_config(f"model_name={preset}", "override_model_config=true", "base_num_kv_heads=4")
  assert config.opt_type == "adam_pax"
