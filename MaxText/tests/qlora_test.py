"""QLoRA's quantized base (layers/qlora.py) against a numpy reference, and in a LoRA run."""

import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.layers import qlora


def _reference(w: np.ndarray, qtype: str) -> np.ndarray:
  """numpy quantize -> dequantize of a (in, out) kernel: per-column absmax (int8, fp8); NF4 blocks of 64 rows."""
  w = w.astype(np.float64)
  if qtype == "int8":
    scale = np.abs(w).max(axis=0, keepdims=True) / 127
    return np.clip(np.round(w / scale), -127, 127) * scale
  if qtype == "fp8":
    scale = np.abs(w).max(axis=0, keepdims=True) / 448
    return (w / scale).astype(jnp.float8_e4m3fn).astype(np.float64) * scale
  blocks = w.reshape(w.shape[0] // 64, 64, w.shape[1])
  absmax = np.abs(blocks).max(axis=1, keepdims=True)
  nearest = np.abs((blocks / absmax)[..., None] - qlora.NF4).argmin(-1)
  return (qlora.NF4[nearest] * absmax).reshape(w.shape)


# The worst error relative to the channel's (block's) absmax: half a step of the code.
_BOUNDS = {"int8": 0.5 / 127, "fp8": 2.0**-4, "nf4": (1.0 - 0.6961928009986877) / 2}  # the widest gap: -1 to -0.696


@pytest.mark.parametrize("qtype", qlora.QTYPES)
def test_quantize_dequantize_matches_numpy_and_its_bound(qtype):
  w = np.random.default_rng(0).normal(size=(256, 48)).astype(np.float32)
  scale_shape, _ = qlora.scale_layout(qtype, w.shape, (0,), ("embed", "mlp"))
  codes, scale = qlora.quantize(jnp.asarray(w), qtype, scale_shape)
  assert codes.dtype == qlora.code_dtype(qtype) and scale.shape == scale_shape
  back = np.asarray(qlora.dequantize(codes, scale, qtype, jnp.float32))
  np.testing.assert_allclose(back, _reference(w, qtype), rtol=0, atol=1e-5 * np.abs(w).max())
  absmax = np.abs(w).max(axis=0) if qtype != "nf4" else np.abs(w.reshape(4, 64, 48)).max(axis=1).repeat(64, 0)
  assert np.all(np.abs(back - w) <= _BOUNDS[qtype] * absmax + 1e-6)


@pytest.mark.parametrize("qtype", qlora.QTYPES)
def test_a_scanned_stack_quantizes_as_each_layer(qtype):
  """A layers axis inserted (param_scan_axis=1) in kernel and scale: the same codes as layer by layer."""
  w = np.random.default_rng(1).normal(size=(128, 3, 4, 8)).astype(np.float32)  # (embed, layers, heads, head_dim)
  one_shape, _ = qlora.scale_layout(qtype, (128, 4, 8), (0,), ("embed", "heads", "kv"))
  stacked_shape = one_shape[:1] + (3,) + one_shape[1:]
  codes, scale = qlora.quantize(jnp.asarray(w), qtype, stacked_shape)
  for layer in range(3):
    codes_i, scale_i = qlora.quantize(jnp.asarray(w[:, layer]), qtype, one_shape)
    np.testing.assert_array_equal(np.asarray(codes[:, layer]).astype(np.float32), np.asarray(codes_i).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(scale[:, layer]), np.asarray(scale_i))


def _nf4_reference(w: np.ndarray, axis: int, block: int) -> tuple[np.ndarray, np.ndarray]:
  """(indices, dequantized) of NF4 in numpy, unpacked: blocks of `block` along `axis`, each divided by its absmax
  (float32, as the kernel's dtype) and rounded to the nearest code."""
  moved = np.moveaxis(w, axis, 0)
  blocks = moved.reshape((moved.shape[0] // block, block) + moved.shape[1:])
  absmax = np.abs(blocks).max(axis=1, keepdims=True)
  nearest = np.abs((blocks / absmax).astype(np.float64)[..., None] - qlora.NF4).argmin(-1)
  back = qlora.NF4[nearest] * absmax  # float32, as the layer computes it
  return (np.moveaxis(nearest.reshape(moved.shape), 0, axis), np.moveaxis(back.reshape(moved.shape), 0, axis))


@pytest.mark.parametrize(
  "shape, in_axes, axis, block",
  [((256, 48), (0,), 0, 64), ((4, 128, 6), (0, 1), 1, 64), ((3, 40, 5), (0, 1), 1, 8), ((12, 2, 7), (0,), 0, 4)],
)
def test_nf4_packs_two_indices_a_byte_and_round_trips_as_numpy(shape, in_axes, axis, block):
  """The codes are uint8 with the block axis halved (half the float kernel's elements in bytes), each byte the
  high (first) and low (second) nibble of two neighbours; dequantize gives numpy's NF4 exactly."""
  w = np.random.default_rng(2).normal(size=shape).astype(np.float32)
  scale_shape, _ = qlora.scale_layout("nf4", shape, in_axes, tuple(f"a{i}" for i in range(len(shape))))
  codes, scale = qlora.quantize(jnp.asarray(w), "nf4", scale_shape)
  packed = tuple(n // 2 if i == axis else n for i, n in enumerate(shape))
  assert codes.dtype == jnp.uint8 and codes.shape == packed == qlora.code_shape("nf4", shape, in_axes)
  assert codes.nbytes * 2 == w.size
  assert qlora.float_shape(codes.shape, scale.shape, "nf4") == shape
  index, reference = _nf4_reference(w, axis, block)
  pairs = np.moveaxis(index, axis, 0).reshape((shape[axis] // 2, 2) + np.moveaxis(index, axis, 0).shape[1:])
  np.testing.assert_array_equal(np.moveaxis(np.asarray(codes), axis, 0), pairs[:, 0] * 16 + pairs[:, 1])
  np.testing.assert_array_equal(np.asarray(qlora.dequantize(codes, scale, "nf4", jnp.float32)), reference)


@pytest.mark.parametrize("shape", [(33, 48), (6, 48)])
def test_nf4_refuses_a_kernel_without_an_input_dim_divisible_by_4(shape):
  """Blocks of 1 cannot be packed two a byte; with blocks of 2 the codes and the scale would share one shape."""
  from MaxText.errors import ConfigError  # pylint: disable=import-outside-toplevel

  with pytest.raises(ConfigError) as error:
    qlora.scale_layout("nf4", shape, (0,), ("embed", "mlp"))
  message = str(error.value)
  assert "\n" not in message and message.startswith("lora_weight_qtype=nf4 packs two 4-bit codes per byte")
  assert f"shape {shape} has input dims [{shape[0]}]; use int8 or fp8" in message


def test_nf4_blocks_along_the_input_axis_with_the_largest_factor_of_64():
  assert qlora.scale_layout("nf4", (32, 128, 4096), (0, 1), ("heads", "kv", "embed"))[0] == (32, 2, 4096)
  assert qlora.scale_layout("int8", (32, 128, 4096), (0, 1), ("heads", "kv", "embed")) == (
    (1, 1, 4096),
    (None, None, "embed"),
  )


def _setup(*args):
  from MaxText.runtime.mesh import create_device_mesh  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import tiny_config  # pylint: disable=import-outside-toplevel
  from MaxText.training import training_setup  # pylint: disable=import-outside-toplevel

  config = tiny_config("enable_lora=true", "lora_module_path=decoder/layers/self_attention/(query|value)", *args)
  mesh = create_device_mesh(config)
  return config, mesh, training_setup.build(config, mesh)


@pytest.mark.parametrize("qtype", qlora.QTYPES)
def test_a_qlora_state_holds_every_dense_kernel_quantized_and_adam_only_the_adapters(qtype):
  from MaxText.layers import layer_names  # pylint: disable=import-outside-toplevel

  _, _, setup = _setup(f"lora_weight_qtype={qtype}")
  leaves = {"/".join(k): v for k, v in layer_names.flatten(setup.abstract_state.params)}
  kernels = {p: v.dtype for p, v in leaves.items() if p.startswith("decoder/layers/") and p.endswith("/kernel")}
  assert kernels and all(d == qlora.code_dtype(qtype) for d in kernels.values()), kernels  # adapted or not
  assert all(p[: -len("kernel")] + "kernel_scale" in leaves for p in kernels)
  floats = {"/".join(k): v for k, v in layer_names.flatten(qlora.float_layout(setup.abstract_state.params, "float32"))}
  bytes_per_value = 0.5 if qtype == "nf4" else 1  # nf4: two indices a byte
  assert all(leaves[p].size * leaves[p].dtype.itemsize == bytes_per_value * floats[p].size for p in kernels)
  assert all(v.dtype == jnp.float32 for p, v in leaves.items() if "embed" in p or "norm" in p), leaves.keys()
  moments = ["/".join(k) for k, _ in layer_names.flatten(setup.abstract_state.opt_state)]
  assert all(p.endswith(("/lora_a", "/lora_b", "count")) for p in moments), moments


def _losses(config, mesh, setup, float_params, steps: int = 3) -> list[float]:
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.tests.helpers import token_batch  # pylint: disable=import-outside-toplevel
  from MaxText.training import train_step  # pylint: disable=import-outside-toplevel

  state = setup.init_state(config, mesh)
  held = setup.abstract_state.params  # quantized as starting_state does: codes and scales sharded as the run holds them
  quantize = jax.jit(lambda p: qlora.quantize_params(p, held), out_shardings=setup.state_shardings.params)
  state = state.replace(params=quantize(float_params))
  step = jax.jit(lambda s, b: train_step.train_step(setup.model, config, setup.features, s, b))
  losses = []
  for _ in range(steps):
    state, metrics = step(state, token_batch(rows=config.global_batch_size_to_train_on))
    losses.append(float(metrics["learning/loss"]))
  return losses


@pytest.mark.parametrize("qtype", qlora.QTYPES)
def test_lora_on_a_quantized_base_trains_like_lora_on_the_float_base(qtype):

  args = ("learning_rate=1e-2", "warmup_steps_fraction=0")
  config, mesh, setup = _setup(*args)
  float_params = setup.init_state(config, mesh).params
  reference = _losses(config, mesh, setup, float_params)
  q_config, q_mesh, q_setup = _setup(f"lora_weight_qtype={qtype}", *args)
  quantized = _losses(q_config, q_mesh, q_setup, float_params)
  assert reference[-1] < reference[0]
  np.testing.assert_allclose(quantized, reference, rtol=0.02)


def sharded_nf4_report() -> None:
  """Run with 8 CPU devices (fsdp=4, tensor=2): prints the float and nf4 losses and each nf4 kernel's codes'
  (shape, float shape, partition spec) as JSON."""
  import json  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.layers import layer_names  # pylint: disable=import-outside-toplevel

  # embed and mlp wide enough that nf4's scales (a value per 64) split too: 256 / 64 over fsdp, 128 / 64 over tensor
  args = ("base_emb_dim=256", "base_mlp_dim=128", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
  args += ("learning_rate=1e-2", "warmup_steps_fraction=0")
  config, mesh, setup = _setup(*args)
  float_params = setup.init_state(config, mesh).params
  q_config, q_mesh, q_setup = _setup("lora_weight_qtype=nf4", *args)
  floats = dict(layer_names.flatten(qlora.float_layout(q_setup.abstract_state.params, "float32")))
  kernels = {
    "/".join(k): (v.shape, floats[k].shape, [list(a) if isinstance(a, tuple) else a for a in v.sharding.spec])
    for k, v in layer_names.flatten(q_setup.abstract_state.params)
    if k[-1] == "kernel" and qlora.is_code(v)
  }
  report = {"devices": jax.device_count(), "kernels": kernels}
  report["float"] = _losses(config, mesh, setup, float_params)
  report["nf4"] = _losses(q_config, q_mesh, q_setup, float_params)
  print("REPORT " + json.dumps(report))


@pytest.mark.slow  # two tiny models compiled on 8 CPU devices in a subprocess
def test_nf4_packed_codes_shard_on_their_input_axis_over_8_devices():
  """The packed (input) axis keeps its logical name: embed's halved size still splits over fsdp=4 and mlp's over
  tensor=2; quantizing onto that layout and the step compile, and the losses are the float base's within 2%."""
  import json  # pylint: disable=import-outside-toplevel

  from MaxText.tests.helpers import cpu_env, run_python  # pylint: disable=import-outside-toplevel

  code = "from MaxText.tests.qlora_test import sharded_nf4_report; sharded_nf4_report()"
  result = run_python(["-c", code], env_extra=cpu_env(8))
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.split("REPORT ", 1)[1])
  assert report["devices"] == 8
  kernels = report["kernels"]
  query = next(v for p, v in kernels.items() if p.endswith("self_attention/query/kernel"))
  wo = next(v for p, v in kernels.items() if p.endswith("mlp/wo/kernel"))
  assert query[0][0] * 2 == query[1][0] == 256 and "fsdp" in query[2][0], query  # (embed, layers, heads, head_dim)
  assert wo[0][0] * 2 == wo[1][0] == 128 and "tensor" in wo[2][0], wo  # (mlp, layers, embed)
  assert report["float"][-1] < report["float"][0]
  np.testing.assert_allclose(report["nf4"], report["float"], rtol=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ("int8", "nf4"))
def test_qlora_starts_from_a_float_checkpoint_and_resumes(tmp_path, qtype):
  """load_parameters_path's float base (a converted tiny HF llama) is quantized as it loads; the adapters-only
  checkpoint resumes onto it, and the losses are those of the same run in one go."""
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import TRAIN_PY, read_metrics, run_python  # pylint: disable=import-outside-toplevel
  from MaxText.tests.tiny_models import hf_llama  # pylint: disable=import-outside-toplevel

  converter.to_maxtext(hf_llama(tmp_path / "hf"), str(tmp_path / "maxtext"))
  args = [
    TRAIN_PY,
    str(tmp_path / "maxtext" / converter.MODEL_YML),
    f"base_output_directory={tmp_path}",
    f"load_parameters_path={tmp_path / 'maxtext' / 'params'}",
    "enable_lora=true",
    f"lora_weight_qtype={qtype}",
    "learning_rate=1e-2",
    "dataset_type=synthetic",
    "per_device_batch_size=2",
    "max_target_length=32",
    "enable_tensorboard=false",
    "checkpoint_period=2",
    "learning_rate_schedule_steps=4",  # the same schedule for the run that stops at step 2
  ]
  for run, stops in (("whole", (4,)), ("resumed", (2, 4))):
    for steps in stops:
      result = run_python([*args, f"run_name={run}", f"steps={steps}", f"metrics_file={tmp_path / run}.jsonl"])
      assert result.returncode == 0, result.stderr[-3000:]
  assert "Restored the checkpoint of step 1" in result.stdout
  whole, resumed = (read_metrics(tmp_path / f"{run}.jsonl") for run in ("whole", "resumed"))
  assert [m["learning/loss"] for m in resumed] == [m["learning/loss"] for m in whole]


def test_the_float_base_is_quantized_one_kernel_at_a_time_as_it_loads(tmp_path, monkeypatch):
  """starting_state.load_parameters of a float checkpoint with QLoRA: the codes and scales equal those of quantizing
  the whole float base at once, and while a kernel is quantized no other float kernel is alive."""
  import gc  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  # pylint: disable=import-outside-toplevel
  from MaxText.checkpoints import checkpointing
  from MaxText.features import lora, qlora_loading
  from MaxText.training import starting_state

  config, mesh, setup = _setup()
  state = setup.init_state(config, mesh)
  path = str(tmp_path / "params")
  ocp.PyTreeCheckpointer().save(path, {"params": lora.split(state.params)[0]})
  del state
  gc.collect()
  q_config, _, q_setup = _setup("lora_weight_qtype=int8", f"load_parameters_path={path}")
  held = q_setup.abstract_state.params
  float_kernels = {a.shape for a in jax.tree.leaves(qlora.float_layout(held, "float32")) if a.ndim >= 3}
  alive = []
  quantize = qlora_loading._quantize  # pylint: disable=protected-access
  earlier = jax.live_arrays()  # held (so their ids stay theirs): other tests' arrays of the same shapes may be alive
  earlier_ids = {id(a) for a in earlier}

  def counting(kernel, held_layer):
    new = [a for a in jax.live_arrays() if id(a) not in earlier_ids]
    alive.append(sum(a.dtype == jnp.float32 and a.shape in float_kernels for a in new))
    return quantize(kernel, held_layer)

  monkeypatch.setattr(qlora_loading, "_quantize", counting)
  base, adapters = lora.split(starting_state.load_parameters(q_config, q_setup.features, held))
  assert not adapters and alive == [1] * len(alive) and len(alive) == 7  # q, k, v, o, wi_0, wi_1, wo
  whole = checkpointing.load_params(path, lora.split(qlora.float_layout(held, "float32"))[0])
  expected = qlora_loading.quantize_all(whole, held)
  for got, want in zip(jax.tree.leaves(base), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
