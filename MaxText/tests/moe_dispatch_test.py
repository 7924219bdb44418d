"""moe_dispatch=all_to_all (expert parallelism by token dispatch) against moe_dispatch=gather and one device, and
the experts' kernels against each other.

- The CPU emulation of jax.lax.ragged_all_to_all against a NumPy model of the op's documented semantics.
- On 8 forced CPU devices (expert 4 x tensor 2), float32: a few training steps of mixtral, qwen3_moe and deepseek
  give the 1-device losses in both modes, and the compiled forward of all_to_all never holds an expert weight of
  all E experts (gather's all-gathers them). One child process (this file run as a script) runs them all.
- The dropless cells of sparse_matmul x capacity_factor train the same losses: megablox's kernels (in the Pallas
  interpreter) as ragged_dot in both modes, and the dense einsums over every expert (sparse_matmul=false) as the
  grouped matmuls on one device.
- The real op compiles for a TPU topology from this CPU host (libtpu's AOT compile).
"""

import contextlib
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import pyconfig
from MaxText.aot import aot_compile
from MaxText.layers import grouped_matmul, moe_dispatch
from MaxText.runtime import mesh, sharding
from MaxText.tests.helpers import BASE_YML, TEST_JAX_CACHE_DIR, run_python, tiny_args
from MaxText.tests.tiny_models import DEEPSEEK
from MaxText.training import training_setup

E, K = 8, 2  # experts (2 on each of 4 expert shards), experts per token
# The experts' mlp dim: 48, 24 per tensor shard (no other dim of the tiny model is 24).
QWEN3_MOE = ["decoder_block=qwen3_moe", f"num_experts={E}", f"num_experts_per_tok={K}", "base_mlp_dim=48"]
MIXTRAL = ["decoder_block=mixtral", *QWEN3_MOE[1:]]
FAMILIES = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE, "deepseek": DEEPSEEK}
PARALLEL = ["ici_expert_parallelism=4", "ici_tensor_parallelism=2"]
MODES = ("gather", "all_to_all")
STEPS = 3
AOT = ["compile_topology=v5e-8", "attention=dot_product", "dataset_type=synthetic", "scan_layers=false"]


def numpy_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
  """help(jax.lax.ragged_all_to_all)'s pseudo-code, one list entry per device: slice i of a sender goes to device
  i // (N / devices), written at that slice's output_offsets on the receiver."""
  devices, slices = len(operands), len(input_offsets[0])
  per_device = slices // devices
  results = [np.array(o) for o in outputs]
  for src in range(devices):
    for i in range(slices):
      dst, start, size = i // per_device, input_offsets[src][i], send_sizes[src][i]
      # The receiver's recv_sizes[src's block] name the same sizes (the op requires it).
      assert recv_sizes[dst][src * per_device + i % per_device] == size
      results[dst][output_offsets[src][i] : output_offsets[src][i] + size] = operands[src][start : start + size]
  return results


def _random_case(rng, devices, per_device, rows_in, rows_out):
  """Operands and offsets of a valid call: slices at random non-overlapping places, with gaps, on both sides."""
  slices = devices * per_device
  sizes = rng.integers(0, 4, size=(devices, slices))  # sizes[src, i]

  def place(lengths, rows):  # offsets of slices laid out in a random order, with random gaps, within rows
    offsets, at = np.zeros(len(lengths), np.int32), 0
    for i in rng.permutation(len(lengths)):
      at += int(rng.integers(0, 2))
      offsets[i], at = at, at + lengths[i]
    assert at <= rows
    return offsets

  input_offsets = np.stack([place(sizes[src], rows_in) for src in range(devices)])
  output_offsets, recv_sizes = np.zeros_like(input_offsets), np.zeros_like(sizes)
  for dst in range(devices):
    mine = [(src, dst * per_device + s) for src in range(devices) for s in range(per_device)]  # received, in order
    at = place([sizes[src, i] for src, i in mine], rows_out)
    for m, (src, i) in enumerate(mine):
      output_offsets[src, i], recv_sizes[dst, m] = at[m], sizes[src, i]
  operand = rng.normal(size=(devices, rows_in, 3)).astype(np.float32)
  output = rng.normal(size=(devices, rows_out, 3)).astype(np.float32)  # untouched rows keep these
  return operand, output, input_offsets, sizes.astype(np.int32), output_offsets, recv_sizes.astype(np.int32)


def _emulated(*args):
  fn = lambda *a: moe_dispatch.emulated_ragged_all_to_all(*a, axis_name="x")  # noqa: E731
  return np.asarray(jax.jit(jax.vmap(fn, axis_name="x"))(*args))


def test_emulated_ragged_all_to_all_has_the_ops_semantics():
  # The op's documented example (axis size 2).
  example = (
    np.array([[1, 2, 2], [3, 4, 0]], np.float32),
    np.zeros((2, 4), np.float32),
    np.array([[0, 1], [0, 1]]),
    np.array([[1, 2], [1, 1]]),
    np.array([[0, 0], [1, 2]]),
    np.array([[1, 1], [2, 1]]),
  )
  np.testing.assert_array_equal(_emulated(*example), [[1, 3, 0, 0], [2, 2, 4, 0]])
  np.testing.assert_array_equal(_emulated(*example), numpy_ragged_all_to_all(*example))
  # Random layouts, one and several slices per destination.
  rng = np.random.default_rng(0)
  for devices, per_device in ((4, 1), (4, 2), (3, 3)):
    case = _random_case(rng, devices, per_device, rows_in=40, rows_out=60)
    np.testing.assert_array_equal(_emulated(*case), numpy_ragged_all_to_all(*case), err_msg=f"{devices}x{per_device}")


def test_receive_buffer_holds_the_worst_case():
  # 4 devices of 64 tokens, k 2, 2 experts each: every device's tokens may choose both experts of one device.
  assert moe_dispatch.receive_buffer_rows(64, 2, 2, 4) == 4 * 64 * 2
  # k 8 of 2 local experts: at most 2 of a token's pairs land on one device.
  assert moe_dispatch.receive_buffer_rows(64, 8, 2, 4) == 4 * 64 * 2


@pytest.mark.slow  # a TPU compile
def test_the_real_op_compiles_for_a_tpu_topology():
  """An AOT compile for TPU traces on this CPU host: the mesh's TPU devices get ragged-all-to-all, not the
  emulation (whose all-gathers would hold every device's pairs)."""
  config = pyconfig.initialize(
    ["test", BASE_YML, *tiny_args(*QWEN3_MOE, *PARALLEL, *AOT, "moe_dispatch=all_to_all")],
    environ={},
    for_compile_topology=True,
  )
  hlo = aot_compile.compile_for_target(config).compiled.as_text()
  assert hlo.count("ragged-all-to-all(") >= 4  # to the experts and back, forward and backward
  # megablox=true (the default) on TPU: the experts' matmuls are its Pallas kernels, gmm and tgmm.
  assert "tpu_custom_call" in hlo and "ragged-dot" not in hlo


def _expert_weight_shapes(config, device_mesh) -> list[str]:
  """The f32 array shapes in the compiled forward pass of the model (params sharded as in training)."""
  setup = training_setup.build(config, device_mesh, check_memory=False)
  params = setup.abstract_state.params
  params = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, setup.state_shardings.params
  )
  tokens = jax.ShapeDtypeStruct(
    (config.global_batch_size_to_load, config.max_target_length),
    jnp.int32,
    sharding=sharding.data_sharding(config, device_mesh),
  )
  with sharding.logical_context(device_mesh, config):
    hlo = jax.jit(setup.model.apply).lower({"params": params}, tokens, tokens).compile().as_text()
  return sorted(set(re.findall(r"f32\[([\d,]+)\]", hlo)))


def _child(out_dir):
  """Trains every family on 1 and on 8 devices in both modes, with ragged_dot (megablox=false) and megablox's
  kernels (interpreted), and densely on 1 device; compiles qwen3_moe's forward in both modes."""
  from MaxText.runtime.jax_runtime import enable_compilation_cache  # pylint: disable=import-outside-toplevel
  from MaxText.tests.sharded_runs import train_run  # pylint: disable=import-outside-toplevel

  enable_compilation_cache(TEST_JAX_CACHE_DIR)
  report = {"device_count": jax.device_count(), "runs": {}, "kernels": {}, "shapes": {}, "seconds": {}}
  for family, args in FAMILIES.items():
    one = ["per_device_batch_size=8"]
    layouts = {"one": (1, [*one, "megablox=false"]), "one_dense": (1, [*one, "sparse_matmul=false"])}
    if family == "mixtral":  # its experts are qwen3_moe's MoeBlock: on 8 devices only qwen3_moe and deepseek
      layouts["one_megablox"] = (1, [*one, "megablox=true"])
    else:
      for mode in MODES:
        parallel = ["per_device_batch_size=1", *PARALLEL, f"moe_dispatch={mode}"]
        layouts[mode] = (8, [*parallel, "megablox=false"])
        layouts[f"{mode}_megablox"] = (8, [*parallel, "megablox=true"])
      # A capacity (1.0 drops choices here): the dropped ones are sorted past every group and never sent.
      layouts["one_capacity"] = (1, [*one, "megablox=false", "capacity_factor=1.0"])
      a2a = ["per_device_batch_size=1", *PARALLEL, "moe_dispatch=all_to_all"]
      layouts["all_to_all_capacity"] = (8, [*a2a, "megablox=false", "capacity_factor=1.0"])
      # max_checkify: the experts sort the whole batch without shard_map (checkify cannot enter one).
      layouts["all_to_all_checkify"] = (8, [*a2a, "megablox=true", "max_checkify=true"])
    for layout, (devices, extra) in layouts.items():
      name = f"{family}_{layout}"
      common = [f"base_output_directory={out_dir}", f"run_name={name}", f"metrics_file={out_dir}/{name}.jsonl"]
      common += [f"steps={STEPS}", "learning_rate=1e-2", "enable_checkpointing=false"]
      config = pyconfig.initialize(
        ["moe_dispatch_test", BASE_YML, *tiny_args(*common, *args, *extra)], environ={}, devices=jax.devices()[:devices]
      )
      start = time.perf_counter()
      with grouped_matmul.interpreted() if layout.endswith("_megablox") else contextlib.nullcontext():
        report["kernels"][name] = grouped_matmul.from_config(config).kernel
        report["runs"][name] = train_run(config, probes=())
      if family == "qwen3_moe" and layout in MODES:
        report["shapes"][layout] = _expert_weight_shapes(config, mesh.create_device_mesh(config))
      report["seconds"][name] = round(time.perf_counter() - start, 1)
  with open(f"{out_dir}/report.json", "w", encoding="utf-8") as f:
    json.dump(report, f)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  out_dir = tmp_path_factory.mktemp("moe_dispatch")
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0", "JAX_PLATFORMS": "cpu"}
  result = run_python(["-m", "MaxText.tests.moe_dispatch_test", str(out_dir)], env_extra=env)
  assert result.returncode == 0, result.stderr[-5000:]
  out = json.loads((out_dir / "report.json").read_text())
  assert out["device_count"] == 8
  print(out["seconds"])
  return out


@pytest.mark.slow  # one child process: about 2.5 minutes cold, 1 with the compilation cache
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek"])
def test_expert_parallel_losses_equal_one_device(report, family, mode):
  run, one = report["runs"][f"{family}_{mode}"], report["runs"][f"{family}_one"]
  assert run["mesh"]["expert"] == 4 and run["mesh"]["tensor"] == 2
  for key in ("learning/loss", "learning/moe_lb_loss"):
    np.testing.assert_allclose(run["metrics"][key], one["metrics"][key], rtol=1e-5, err_msg=key)
  assert one["metrics"]["learning/loss"][-1] < one["metrics"]["learning/loss"][0]
  # The stored expert weights are sharded over `expert` in both modes: (E, layers, embed, mlp) per device.
  wi = [shape for path, (shape, _) in run["params"].items() if path.endswith("['MoeBlock_0']['wi_0']")]
  assert wi and wi[0][0] == E // 4


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_dropless_cells_train_the_same_losses_with_each_kernel(report, family):
  runs = report["runs"]
  pairs = [(name, name.removesuffix("_megablox")) for name in runs if name.startswith(f"{family}_")]
  pairs = [(name, reference) for name, reference in pairs if name != reference] + [(f"{family}_one_dense", f"{family}_one")]
  assert len(pairs) == (2 if family == "mixtral" else 3)
  for name, reference in pairs:
    assert report["kernels"][name] == ("megablox" if name.endswith("_megablox") else "ragged_dot")
    for key in ("learning/loss", "learning/moe_lb_loss"):
      np.testing.assert_allclose(runs[name]["metrics"][key], runs[reference]["metrics"][key], rtol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek"])
def test_all_to_all_with_a_capacity_drops_the_choices_one_device_drops(report, family):
  losses = {
    n: report["runs"][f"{family}_{n}"]["metrics"]["learning/loss"] for n in ("all_to_all_capacity", "one_capacity", "one")
  }
  np.testing.assert_allclose(losses["all_to_all_capacity"], losses["one_capacity"], rtol=1e-5)
  assert abs(losses["one_capacity"][0] - losses["one"][0]) > 1e-4  # choices were dropped


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek"])
def test_max_checkify_checks_the_dropless_experts_as_one_device_trains_them(report, family):
  runs = report["runs"]
  np.testing.assert_allclose(
    runs[f"{family}_all_to_all_checkify"]["metrics"]["learning/loss"],
    runs[f"{family}_one"]["metrics"]["learning/loss"],
    rtol=1e-5,
  )
  assert report["kernels"][f"{family}_all_to_all_checkify"] == "ragged_dot"  # megablox=true, but no shard_map


@pytest.mark.slow
def test_all_to_all_never_holds_all_experts_weights(report):
  # An expert weight of all 8 experts, (E, embed, mlp/tensor) or (E, mlp/tensor, embed), exists only when gathered.
  whole = {"8,32,24", "8,24,32"}
  assert whole <= set(report["shapes"]["gather"])
  assert not whole & set(report["shapes"]["all_to_all"])
  assert {"2,32,24", "2,24,32"} <= set(report["shapes"]["all_to_all"])  # its E/ep = 2 local experts


if __name__ == "__main__":
  _child(sys.argv[1])
