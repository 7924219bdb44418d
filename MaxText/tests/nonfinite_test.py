"""nonfinite_action: a NaN injected into one layer's weights is found and named, the step keeps the state, and the
loop aborts (saving nothing) or skips the step and goes on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.aot import aot_compile
from MaxText.diagnostics import nonfinite
from MaxText.layers import layer_names
from MaxText.runtime import mesh, sharding
from MaxText.tests.helpers import run_train, tiny_config, token_batch
from MaxText.training import step_loop, training_setup

NAN_PARAM = "decoder.layers.1.mlp.wi_0.kernel"


def _with_nan_in_layer_1(params, config):
  """decoder/layers/mlp/wi_0/kernel stacks layers on param_scan_axis: one NaN in layer 1 (decoder.layers.1)."""
  kernel = params["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
  index = [0] * kernel.ndim
  index[config.param_scan_axis] = 1
  kernel = kernel.at[tuple(index)].set(jnp.nan)
  mlp = dict(params["decoder"]["layers"]["mlp"], wi_0={"kernel": kernel})
  layers = dict(params["decoder"]["layers"], mlp=mlp)
  return dict(params, decoder=dict(params["decoder"], layers=layers))


@pytest.fixture(scope="module")
def setup():
  """The real compiled step (nonfinite_action=abort) and a fresh state whose layer 1 has a NaN weight."""
  config = tiny_config("nonfinite_action=abort")
  device_mesh = mesh.create_device_mesh(config)
  built = training_setup.build(config, device_mesh)
  step = aot_compile.compile_train_step(built, config, device_mesh)

  def poisoned_state():
    state = built.init_state(config, device_mesh)
    params = jax.device_put(_with_nan_in_layer_1(state.params, config), built.state_shardings.params)
    return state.replace(params=params)

  return config, device_mesh, built, step, poisoned_state


def test_the_step_keeps_the_state_and_locates_the_nan_layer(setup):
  config, device_mesh, _, step, poisoned_state = setup
  state = poisoned_state()
  before = jax.device_get((state.params, state.opt_state))
  with sharding.logical_context(device_mesh, config):
    new_state, metrics = step(state, jax.device_put(token_batch(), sharding.data_sharding(config, device_mesh)))
  metrics = jax.device_get(metrics)
  assert metrics[nonfinite.SKIPPED] == 1.0 and not np.isfinite(metrics["learning/loss"])
  report = metrics[nonfinite.REPORT]
  names = layer_names.param_names(new_state.params, config)
  assert int(report["params"]) == 1 and names[int(report["first_param"])] == NAN_PARAM
  assert int(new_state.step) == 1  # counted as a step, but nothing else moved
  after = jax.device_get((new_state.params, new_state.opt_state))
  jax.tree.map(np.testing.assert_array_equal, after, before)
  line = nonfinite.describe(0, float(metrics["learning/loss"]), report, names)
  assert line.startswith(f"step 0: non-finite values (loss=nan), first in the params: {NAN_PARAM} (1 of ")


def test_a_finite_step_reports_nothing_and_updates(setup):
  config, device_mesh, built, step, _ = setup
  state = built.init_state(config, device_mesh)
  with sharding.logical_context(device_mesh, config):
    new_state, metrics = step(state, jax.device_put(token_batch(), sharding.data_sharding(config, device_mesh)))
  assert float(metrics[nonfinite.SKIPPED]) == 0.0 and int(metrics[nonfinite.REPORT]["first_param"]) == -1
  assert float(metrics["learning/update_norm"]) >= 0 and int(new_state.step) == 1


def test_gradients_are_named_nearest_the_loss_first():
  names = [
    "decoder.decoder_norm.scale",
    "decoder.layers.0.mlp.wo.kernel",
    "decoder.layers.1.mlp.wo.kernel",
    "token_embedder.embedding",
  ]
  bad = jnp.array([False, True, True, True])
  order = nonfinite._backward_order(names)  # pylint: disable=protected-access
  assert names[int(nonfinite._first(bad, order))] == "decoder.layers.1.mlp.wo.kernel"  # pylint: disable=protected-access
  assert int(nonfinite._first(bad)) == 1  # pylint: disable=protected-access
  forward = order[::-1]  # the params' first: the one the forward pass meets first
  assert names[int(nonfinite._first(jnp.array([True, False, True, False]), forward))] == names[2]  # pylint: disable=protected-access
  assert names[int(nonfinite._first(jnp.ones(4, bool), forward))] == "token_embedder.embedding"  # pylint: disable=protected-access
  line = nonfinite.describe(7, 2.5, {"params": 0, "first_param": -1, "gradients": 3, "first_gradient": 2}, names)
  assert "step 7" in line and "first in the gradients: decoder.layers.1.mlp.wo.kernel" in line and "loss is finite" in line


@pytest.mark.parametrize("action", ["abort", "skip"])
def test_the_loop_aborts_or_skips_naming_the_layer(setup, action, capsys):
  config, device_mesh, built, step, poisoned_state = setup
  config = config.replace(nonfinite_action=action, steps=3)  # abort and skip compile to the same step
  batches = iter([jax.device_put(token_batch(), sharding.data_sharding(config, device_mesh))] * 3)
  run = lambda: step_loop.run_steps(
    config, device_mesh, built.model, built.features, poisoned_state(), built.state_shardings, step, batches, None
  )  # pylint: disable=protected-access,unnecessary-lambda-assignment
  if action == "abort":
    with pytest.raises(nonfinite.NonFiniteError) as error:
      run()
    message = str(error.value)
    assert message.startswith(f"step 0: non-finite values (loss=nan), first in the params: {NAN_PARAM}")
    assert "nothing was saved" in message and "\n" not in message
    assert "completed step: 1" not in capsys.readouterr().out  # the error is the last line, not the step after
  else:
    state = run()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "non-finite" in line]
    assert len(warnings) == 3 and all(NAN_PARAM in line for line in warnings)
    assert warnings[0].startswith("WARNING: step 0: non-finite values") and "3 step(s) skipped so far" in warnings[-1]
    assert int(state.step) == 3


@pytest.mark.slow
@pytest.mark.parametrize("action", ["abort", "skip"])
def test_train_py_with_a_nan_in_the_loaded_params(tmp_path, action):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  config = tiny_config()
  device_mesh = mesh.create_device_mesh(config)
  built = training_setup.build(config, device_mesh)
  params = built.init_state(config, device_mesh).params
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "nan_params", {"params": jax.device_get(_with_nan_in_layer_1(params, config))})
  checkpointer.wait_until_finished()
  result, metrics = run_train(
    tmp_path, action, "steps=3", f"nonfinite_action={action}", f"load_parameters_path={tmp_path / 'nan_params'}"
  )
  if action == "abort":
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(
      f"Error: step 0: non-finite values (loss=nan), first in the params: {NAN_PARAM}"
    )
    assert not (tmp_path / action / "checkpoints").exists() or not list((tmp_path / action / "checkpoints").iterdir())
  else:
    assert result.returncode == 0, result.stderr[-2000:]
    assert sum("non-finite" in line and NAN_PARAM in line for line in result.stderr.splitlines()) == 3
    assert [m[nonfinite.SKIPPED] for m in metrics] == [1.0, 1.0, 1.0]
