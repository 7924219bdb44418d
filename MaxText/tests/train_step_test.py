"""train_step: remat/scan invariance and memory, donation, gradient accumulation, padding, clipping, the LR schedule."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText.aot import aot_compile
from MaxText.checkpoints import layer_stacking
from MaxText.configuration import common_types
from MaxText.features import selection
from MaxText.runtime import mesh, sharding
from MaxText.tests.helpers import tiny_config, token_batch
from MaxText.training import jit_steps, optimizers, train_step, training_setup


def _batch(rows, length=32, seed=0, pad_from=None):
  segmentation = jnp.ones((rows, length), jnp.int32)
  if pad_from is not None:
    segmentation = segmentation.at[:, pad_from:].set(0)
  return token_batch(rows, length, seed, segmentation)


def _loss_and_grads(config, params, batch):
  model = training_setup.create_model(config)

  def loss(p):
    total, (weights, *_) = train_step.loss_fn(
      model, config, selection.for_config(config), p, batch, jax.random.PRNGKey(0), True
    )
    return total / weights

  return jax.jit(jax.value_and_grad(loss))(params)


def _state(config):
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  return setup.model, setup.init_state(config, device_mesh)


@pytest.fixture(scope="module")
def reference():
  """Loss and grads with no remat and unrolled layers: the baseline every layout must reproduce."""
  config = tiny_config("scan_layers=false", "remat_policy=none")
  _, state = _state(tiny_config())
  params = dict(state.params)
  params["decoder"] = layer_stacking.unstack_layers(params["decoder"], config.num_decoder_layers, config.param_scan_axis)
  batch = _batch(2)
  return state.params, batch, _loss_and_grads(config, params, batch)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("policy", common_types.REMAT_POLICIES)
def test_remat_and_scan_give_the_same_loss_and_grads(reference, scan, policy):
  scanned_params, batch, (ref_loss, ref_grads) = reference
  config = tiny_config(f"scan_layers={scan}", f"remat_policy={policy}")
  params = dict(scanned_params)
  if not scan:
    params["decoder"] = layer_stacking.unstack_layers(params["decoder"], config.num_decoder_layers, config.param_scan_axis)
  loss, grads = _loss_and_grads(config, params, batch)
  if scan:
    grads = dict(grads)
    grads["decoder"] = layer_stacking.unstack_layers(grads["decoder"], config.num_decoder_layers, config.param_scan_axis)
  # Tolerance: float32 round-off from different fusion/recompute orders; never loosened to pass.
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), grads, ref_grads)


def _compiled_temp_bytes(*args):
  config = tiny_config(*args)
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  compiled = aot_compile.compile_train_step(setup, config, device_mesh)
  return compiled.memory_analysis().temp_size_in_bytes


def test_remat_policies_change_what_is_saved():
  # Activations dominate here (small vocab, 8x64 tokens, 4 layers), so a policy that keeps more of them for the
  # backward pass must need more temporary memory: full keeps each layer's input, minimal also the weight matmuls'
  # outputs, none everything.
  dims = ("vocab_size=256", "base_emb_dim=64", "base_mlp_dim=256", "base_num_decoder_layers=4", "max_target_length=64")
  temp = {
    policy: _compiled_temp_bytes(*dims, "per_device_batch_size=8", f"remat_policy={policy}")
    for policy in ("full", "minimal", "none")
  }
  assert temp["full"] < temp["minimal"] < temp["none"], temp


@pytest.mark.parametrize("compiled_ahead", [False, True])
def test_the_train_state_is_donated(compiled_ahead):
  config = tiny_config()
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  state = setup.init_state(config, device_mesh)
  batch = jax.device_put(_batch(2), sharding.data_sharding(config, device_mesh))
  if compiled_ahead:  # what train.py calls
    step = aot_compile.compile_train_step(setup, config, device_mesh)
  else:
    step = jit_steps.jit_train_step(setup.model, config, setup.features, device_mesh, setup.state_shardings)
  with sharding.logical_context(device_mesh, config):
    new_state, _ = step(state, batch)
  assert all(x.is_deleted() for x in jax.tree.leaves(state)), "the step kept a second copy of the train state"
  assert int(new_state.step) == 1


def test_gradient_accumulation_equals_one_large_batch():
  batch = _batch(8, pad_from=None)
  batch["targets_segmentation"] = batch["targets_segmentation"].at[1, 20:].set(0)  # uneven weights per microbatch
  big = tiny_config("per_device_batch_size=8", "gradient_accumulation_steps=1")
  accumulated = tiny_config("per_device_batch_size=2", "gradient_accumulation_steps=4")
  model, state = _state(big)
  new_big, m_big = jax.jit(functools.partial(train_step.train_step, model, big, ()))(state, batch)
  new_acc, m_acc = jax.jit(functools.partial(train_step.train_step, model, accumulated, ()))(state, batch)
  for key in ("learning/loss", "learning/total_weights", "learning/raw_grad_norm"):
    np.testing.assert_allclose(m_acc[key], m_big[key], rtol=1e-5)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), new_acc.params, new_big.params)


@pytest.mark.parametrize("nonfinite_action", ["abort", "none"])
def test_bfloat16_weights_keep_their_dtype_through_the_step(nonfinite_action):
  config = tiny_config("weight_dtype=bfloat16", f"nonfinite_action={nonfinite_action}")
  model, state = _state(config)
  new_state, metrics = jax.jit(functools.partial(train_step.train_step, model, config, ()))(state, _batch(2))
  dtypes = jax.tree.map(lambda x: x.dtype, state)
  assert jax.tree.map(lambda x: x.dtype, new_state) == dtypes
  assert {d for d in jax.tree.leaves(dtypes.params)} == {jnp.dtype(jnp.bfloat16)}
  assert np.isfinite(float(metrics["learning/loss"])) and int(new_state.step) == 1


def test_padding_carries_no_loss():
  config = tiny_config()
  model, state = _state(config)
  batch = _batch(2, pad_from=10)
  _, metrics = jax.jit(functools.partial(train_step.train_step, model, config, ()))(state, batch)
  assert float(metrics["learning/total_weights"]) == 2 * 10
  # Changing the padded targets changes nothing.
  other = dict(batch, targets=batch["targets"].at[:, 10:].set(7))
  _, metrics2 = jax.jit(functools.partial(train_step.train_step, model, config, ()))(state, other)
  assert float(metrics2["learning/loss"]) == float(metrics["learning/loss"])


def test_metrics_are_consistent():
  config = tiny_config("gradient_clipping_threshold=0.01")
  model, state = _state(config)
  new_state, m = jax.jit(functools.partial(train_step.train_step, model, config, ()))(state, _batch(2))
  assert float(m["learning/grad_norm"]) == pytest.approx(0.01)
  assert float(m["learning/raw_grad_norm"]) > 0.01
  assert float(m["learning/param_norm"]) == pytest.approx(float(optax.tree.norm(new_state.params)), rel=1e-6)
  assert int(new_state.step) == 1
  assert float(m["learning/loss"]) == pytest.approx(np.log(4096), rel=0.1)


def test_learning_rate_schedule_warmup_cosine_then_zero():
  config = tiny_config("learning_rate=1.0", "steps=120", "learning_rate_schedule_steps=100", "warmup_steps_fraction=0.1")
  schedule = optimizers.create_learning_rate_schedule(config)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(0.5)
  assert float(schedule(10)) == pytest.approx(1.0)
  assert float(schedule(55)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)  # halfway down the cosine
  assert float(schedule(99)) == pytest.approx(0.1, rel=1e-2)
  assert float(schedule(100)) == 0.0 and float(schedule(119)) == 0.0
