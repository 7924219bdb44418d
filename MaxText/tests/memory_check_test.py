"""The memory verdict: compiled memory with donation, the params-only and train-state checks, train.py's pre-flight."""

import jax
import jax.numpy as jnp
import pytest

from MaxText.aot import aot_compile
from MaxText.errors import UserError
from MaxText.runtime import memory_check, mesh
from MaxText.tests.helpers import run_train, tiny_config
from MaxText.training import training_setup

MIB = 2**20


@pytest.mark.parametrize("donate", [False, True])
def test_outputs_written_into_donated_arguments_are_counted_once(donate):
  x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)  # 4 MiB
  compiled = jax.jit(lambda a: a * 2, donate_argnums=0 if donate else ()).lower(x).compile()
  memory = memory_check.CompiledMemory.from_analysis(compiled.memory_analysis())
  assert memory.argument_bytes == memory.output_bytes == 4 * MIB
  # Donated, the result reuses the argument's buffer: one 4 MiB array is live, not two.
  assert memory.peak_bytes - memory.temp_bytes - memory.code_bytes == (4 if donate else 8) * MIB


def test_the_verdict_names_both_numbers_and_the_advice():
  memory_check.check_fits(10 * MIB, 10 * MIB, what="x needs", device_kind="cpu", advice="a")  # exactly full fits
  memory_check.check_fits(10 * MIB, None, what="x needs", device_kind="cpu", advice="a")  # an unknown limit is not checked
  with pytest.raises(UserError) as error:
    memory_check.check_fits(
      3 * memory_check.GIB,
      memory_check.GIB,
      what="one step needs",
      device_kind="TPU v5 lite",
      advice="lower b",
      breakdown="b",
    )
  assert str(error.value) == "one step needs 3.00 GiB per device (b) but a TPU v5 lite device has 1.00 GiB: lower b"


def test_params_only_callers_need_only_the_params_to_fit():
  config = tiny_config()
  device_mesh = mesh.create_device_mesh(config)
  abstract_state = training_setup.build(config, device_mesh).abstract_state
  params = memory_check.bytes_per_device(abstract_state.params)
  assert memory_check.bytes_per_device(abstract_state) > 3 * params  # Adam's two moments, in float32 too
  limit = 2 * params  # room for the params, not for params + optimizer state
  training_setup.build(config, device_mesh, params_only=True, memory_limit_bytes=limit)
  with pytest.raises(UserError, match=r"the train state \(params and optimizer state\) needs .* MiB per device"):
    training_setup.build(config, device_mesh, memory_limit_bytes=limit)
  with pytest.raises(UserError, match=r"^the params need .* MiB per device but a .*ici_fsdp_parallelism"):
    training_setup.build(config, device_mesh, params_only=True, memory_limit_bytes=params - 1)


def test_the_train_step_preflight_names_the_numbers_and_the_keys():
  config = tiny_config("remat_policy=minimal")
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  compiled = aot_compile.compile_train_step(setup, config, device_mesh)
  peak = memory_check.CompiledMemory.from_analysis(compiled.memory_analysis()).peak_bytes
  assert peak > memory_check.bytes_per_device(setup.abstract_state)  # the step needs more than its arguments
  aot_compile.compile_train_step(setup, config, device_mesh, memory_limit_bytes=peak)
  with pytest.raises(UserError) as error:
    aot_compile.compile_train_step(setup, config, device_mesh, memory_limit_bytes=peak - 1)
  message = str(error.value)
  assert message.startswith(f"one train step needs {memory_check.format_bytes(peak)} per device (")
  for hint in ("per_device_batch_size (now 2", "max_target_length (now 32)", "remat_policy=full (now minimal)"):
    assert hint in message
  assert "ici_fsdp_parallelism" in message and "smaller model" in message


def test_train_py_stops_before_allocating_with_one_line(tmp_path):
  # 2**24 rows: the logits alone need terabytes, so no machine fits it. (Synthetic data: were the check broken, the
  # step would fail at once on allocation rather than after packing 2**24 rows of text.)
  result, metrics = run_train(tmp_path, "too_big", "per_device_batch_size=16777216", "dataset_type=synthetic")
  assert result.returncode == 2, result.stderr[-2000:]
  assert "Traceback" not in result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
  assert len(errors) == 1 and errors[0].startswith("Error: one train step needs "), result.stderr[-2000:]
  assert "temporaries" in errors[0] and "per_device_batch_size (now 16777216;" in errors[0]
  assert not metrics and not (tmp_path / "too_big" / "checkpoints").exists()
