"""generate_param_only_checkpoint.py: training checkpoint -> params-only, unrolled and back, with a dtype cast."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from MaxText import generate_param_only_checkpoint
from MaxText.errors import UserError
from MaxText.runtime import memory_check, mesh
from MaxText.tests.helpers import BASE_YML, run_train, tiny_args, tiny_config
from MaxText.training import training_setup


def _generate(tmp_path, run_name, *args, memory_limit_bytes=None):
  return generate_param_only_checkpoint.generate(
    ["gen", BASE_YML, f"run_name={run_name}", *tiny_args(f"base_output_directory={tmp_path}", *args)],
    memory_limit_bytes=memory_limit_bytes,
  )


def _params(path):
  return ocp.PyTreeCheckpointer().restore(path)["params"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """A training checkpoint (params and optimizer state) of the tiny model after 3 steps."""
  tmp_path = tmp_path_factory.mktemp("source")
  result, _ = run_train(tmp_path, "src", "steps=3")
  assert result.returncode == 0, result.stderr[-2000:]
  return tmp_path / "src" / "checkpoints" / "2" / "items"


def test_unroll_cast_load_and_stack_back(tmp_path, source):

  unrolled = _generate(tmp_path, "unrolled", f"load_full_state_path={source}", "force_unroll=true", "weight_dtype=bfloat16")
  original = _params(str(source))
  per_layer = _params(unrolled)
  assert "layers" not in per_layer["decoder"] and {"layers_0", "layers_1"} <= set(per_layer["decoder"])
  wi = per_layer["decoder"]["layers_1"]["mlp"]["wi_0"]["kernel"]
  assert wi.dtype == np.dtype("bfloat16")
  np.testing.assert_array_equal(wi, original["decoder"]["layers"]["mlp"]["wi_0"]["kernel"][:, 1].astype("bfloat16"))

  # Fine-tune from it with unrolled layers.
  result, tuned = run_train(tmp_path, "tune", "steps=1", "scan_layers=false", f"load_parameters_path={unrolled}")
  assert result.returncode == 0, result.stderr[-2000:]
  assert len(tuned) == 1

  # And back to the scanned layout.
  rescanned = _params(_generate(tmp_path, "rescanned", f"load_parameters_path={unrolled}"))
  expected = jax.tree.map(lambda x: np.asarray(x).astype("bfloat16").astype("float32"), original)
  jax.tree.map(np.testing.assert_array_equal, rescanned, expected)

  with pytest.raises(UserError, match="already exists"):
    _generate(tmp_path, "unrolled", f"load_full_state_path={source}", "force_unroll=true")
  with pytest.raises(UserError, match="give the checkpoint to convert"):
    _generate(tmp_path, "nothing")


def test_needs_memory_for_the_params_only(tmp_path, source):
  config = tiny_config()
  abstract_state = training_setup.build(config, mesh.create_device_mesh(config)).abstract_state
  params = memory_check.bytes_per_device(abstract_state.params)  # float32, as the conversion reads them
  # A device with room for the params but not for params + Adam state converts; one without room for them refuses.
  assert 2 * params < memory_check.bytes_per_device(abstract_state)
  output = _generate(tmp_path, "fits", f"load_full_state_path={source}", memory_limit_bytes=2 * params)
  jax.tree.map(np.testing.assert_array_equal, _params(output), _params(str(source)))
  with pytest.raises(UserError, match="the params need"):
    _generate(tmp_path, "too_small", f"load_full_state_path={source}", memory_limit_bytes=params - 1)
