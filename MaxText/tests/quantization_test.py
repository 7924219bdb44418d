"""quantization=int8|int8w|fp8 with per-layer and per-GEMM control, the fp8 state in the train state, and
quantize_kvcache: against the unquantized computation they replace."""

import functools
import signal

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax import lax

from MaxText.errors import ConfigError
from MaxText.layers import kv_cache, quantizations
from MaxText.runtime import mesh
from MaxText.tests.helpers import KILL_RESUME_STEPS, kill_resume_command, launch_run, read_metrics, tiny_config
from MaxText.tests.tiny_models import (
  DECODE_KEYS,
  DECODE_PROMPT,
  decode_with_logits,
  dense_outputs,
  full_forward_logits,
  gemm_and_grads,
  make_quantization,
  run_train_steps,
  train_on_one_batch,
)
from MaxText.training import training_setup

FIRST_LAYER_HIGH = """first_layer_high:
  enabled: true
  layers: {layer_numbers: [1]}
  transformer_engine:
    disable_fp8_layer: {enabled: true}
"""


def _write(tmp_path, text, name="numerics.yml"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


# --- one GEMM ------------------------------------------------------------------------------------------------


ONE_GEMM_HIGH = [(False, True, True), (True, False, True), (True, True, False)]


@pytest.mark.parametrize("mode, max_error", [("int8", 0.02), ("fp8", 0.1)])
@pytest.mark.parametrize("low", [(True, True, True), (False, False, False), *ONE_GEMM_HIGH], ids=str)
def test_a_gemm_in_high_precision_is_exactly_lax_dot_general(mode, max_error, low):
  quant = make_quantization(mode)
  recipe = quantizations.Recipe(low=low, current=(True,) * 3 if mode == "fp8" else (False,) * 3)
  meta = {f"{t}_scale": jnp.ones(()) for t in quantizations.FP8_TENSORS}
  meta.update({f"{t}_amax_history": jnp.zeros(16) for t in quantizations.FP8_TENSORS})
  exact = gemm_and_grads(lax.dot_general)
  got = gemm_and_grads(functools.partial(quantizations._gemm, quant, recipe, meta))  # pylint: disable=protected-access
  for gemm, in_low, a, b in zip(quantizations.GEMMS, low, got, exact):
    if in_low:  # quantized: close, not equal
      assert not np.array_equal(a, b), gemm
      assert float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) < max_error, gemm
    else:
      np.testing.assert_array_equal(a, b, err_msg=gemm)


def test_int8w_quantizes_the_kernel_of_fprop_only():
  recipe = make_quantization("int8w").recipe("decoder.layers.0.mlp.wo")
  assert recipe.low == (True, False, False)
  exact = gemm_and_grads(lax.dot_general)
  got = gemm_and_grads(functools.partial(quantizations._gemm, make_quantization("int8w"), recipe, None))  # pylint: disable=protected-access
  assert not np.array_equal(got[0], exact[0])
  np.testing.assert_array_equal(got[1], exact[1])
  np.testing.assert_array_equal(got[2], exact[2])


def test_the_yaml_selects_gemms_layers_and_scaling():
  yaml = {
    "wgrad_high": {
      "enabled": True,
      "layers": {"layer_types": ["fc2"]},
      "disable_fp8_gemm": {"enabled": True, "gemms": ["wgrad"]},
    },
    "qkv_current": {
      "enabled": True,
      "layers": {"layer_types": ["qkv"], "layer_numbers": [2]},
      "per_tensor_scaling": {"enabled": True, "gemms": ["fprop"], "margin": 2},
    },
  }
  from MaxText.diagnostics import numerics_config  # pylint: disable=import-outside-toplevel

  quant = make_quantization("fp8", numerics_config.parse(yaml, "test"), scanned_blocks=2)
  assert quant.recipe("decoder.layers.0.mlp.wo").low == (True, True, False)
  assert quant.recipe("decoder.layers.1.self_attention.query") == quantizations.Recipe(
    low=(True,) * 3, current=(True, False, False), margin=(2, 0, 0)
  )
  assert quant.recipe("decoder.logits_dense") == quantizations.HIGH  # only the decoder layers are quantized
  assert quant.recipe("decoder.layers.0.MoeBlock_0.gate") == quantizations.HIGH  # nor is the MoE router
  distinct, indices = quant.layer_recipes(("decoder", "layers", "self_attention", "query"))
  assert len(distinct) == 2 and indices[0] != indices[1]
  assert make_quantization("int8", quant.numerics).recipe("decoder.layers.1.self_attention.query") == (
    quantizations.Recipe(low=(True,) * 3)  # int8's scales are always current: no margin
  )


# --- per layer, in the model -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_a_layer_disabled_by_the_yaml_computes_bit_identically(tmp_path, mode, scan):
  plain = dense_outputs(f"scan_layers={scan}")
  quantized = dense_outputs(
    f"scan_layers={scan}", f"quantization={mode}", f"numerics_debug_config={_write(tmp_path, FIRST_LAYER_HIGH)}"
  )
  assert len(plain) == (8 if scan else 15)  # 7 dense layers (stacked by layer when scanned, else 2 x 7), the logits
  for path, expected in plain.items():
    name = jax.tree_util.keystr(path)
    if "logits_dense" in name:
      continue
    first, second = (quantized[path][0], quantized[path][1]) if scan else (quantized[path], None)
    if scan or "layers_0" in name:  # layer 1 (index 0) is in high precision: the same bits
      np.testing.assert_array_equal(first, expected[0] if scan else expected, err_msg=name)
    if scan or "layers_1" in name:  # layer 2 is quantized
      assert not np.array_equal(second if scan else quantized[path], expected[1] if scan else expected), name


# --- training ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_run():
  return train_on_one_batch("dtype=bfloat16", steps=50)


# The distance of a quantized run's loss from the bfloat16 run's at each of the 50 steps, relative to the bfloat16
# loss, or absolute (nats) once that loss is below 1: the run memorizes its batch, down to a loss of 0.004 where
# relative distances measure noise. Measured on CPU: int8 0.010, fp8 0.052 (E4M3 keeps 3 mantissa bits).
LOSS_TOLERANCE = {"int8": 0.03, "fp8": 0.08}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_quantized_run_tracks_the_bf16_run_for_50_steps(bf16_run, mode):
  reference, _ = bf16_run
  assert reference[-1] < 0.5 * reference[0]  # it learns: the comparison is not of two flat lines
  losses, state = train_on_one_batch("dtype=bfloat16", f"quantization={mode}", steps=50)
  distance = np.abs(losses - reference) / np.maximum(reference, 1.0)
  assert distance.max() < LOSS_TOLERANCE[mode], f"max relative distance {distance.max():.4f} at step {distance.argmax()}"
  assert not np.array_equal(losses, reference)  # it is quantized
  if mode == "fp8":  # the state moved: histories hold amaxes, the scales follow them
    meta = state.slots["fp8_meta"]["decoder"]["layers"]["mlp"]["wo"]
    assert meta["input_amax_history"].shape == (2, 1024) and float(jnp.min(meta["input_amax_history"][:, 0])) > 0
    assert float(jnp.max(jnp.abs(meta["kernel_scale"] - 1))) > 0


def test_fp8_state_is_not_optimized_clipped_or_decayed():
  """With weight decay and clipping on, the state after a step is exactly what the GEMMs computed from the
  tensors: a history's newest amax is that tensor's amax, and the scale is the previous history's."""
  losses, state = train_on_one_batch(
    "quantization=fp8", "gradient_clipping_threshold=1e-3", "adam_weight_decay=0.5", steps=2
  )
  assert np.isfinite(losses).all()
  meta = jax.tree.map(np.asarray, state.slots["fp8_meta"]["decoder"]["layers"]["mlp"]["wo"])
  history = meta["kernel_amax_history"]  # (layers, length), rolled as flax's: [step 1's amax, 0, ..., step 0's]
  assert (history[:, 1:-1] == 0).all() and (history[:, [0, -1]] > 0).all()
  kernel = np.asarray(state.params["decoder"]["layers"]["mlp"]["wo"]["kernel"])  # (mlp, layers, embed)
  previous_kernel_amax = history[:, 0]  # the kernel step 1 multiplied: before its update
  assert (np.abs(np.abs(kernel).max(axis=(0, 2)) - previous_kernel_amax) > 0).all()  # the update moved it
  fp8_max = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
  # the scale stored by step 1 came from the history before it, whose max was step 0's amax
  np.testing.assert_allclose(meta["kernel_scale"], history[:, -1] / fp8_max, rtol=1e-6)


ALL_LAYERS_HIGH = """all_high:
  enabled: true
  layers: {layer_types: [all]}
  disable_fp8_layer: {enabled: true}
"""


def test_gradient_accumulation_combines_the_fp8_state(tmp_path):
  """Two microbatches of the same rows leave the state of the one-batch step: the newest amax is the largest of
  the microbatches'. (Every GEMM in high precision, so that both steps compute the same tensors: in fp8 the
  microbatches' rounding differs, and so would the amaxes of later layers.)"""
  args = ("quantization=fp8", f"numerics_debug_config={_write(tmp_path, ALL_LAYERS_HIGH)}")
  _, whole = train_on_one_batch(*args, "per_device_batch_size=2", steps=1)
  # the same 2 rows, as 2 microbatches
  _, accumulated = train_on_one_batch(*args, "per_device_batch_size=1", "gradient_accumulation_steps=2", steps=1)
  leaves = jax.tree_util.tree_flatten_with_path(whole.slots["fp8_meta"])[0]
  for (path, a), b in zip(leaves, jax.tree.leaves(accumulated.slots["fp8_meta"])):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, err_msg=jax.tree_util.keystr(path))
  assert np.all(
    np.asarray(accumulated.slots["fp8_meta"]["decoder"]["layers"]["mlp"]["wo"]["output_grad_amax_history"])[:, 0] > 0
  )


@pytest.mark.slow
def test_a_killed_fp8_run_resumes_with_its_fp8_state_bitwise(tmp_path):
  fp8 = ("quantization=fp8", "fp8_amax_history_length=16")
  reference = kill_resume_command(tmp_path, "reference", 8, *fp8)
  code, stderr = launch_run(reference, 1)
  assert code == 0, stderr[-3000:]
  command = kill_resume_command(tmp_path, "killed", 8, *fp8)
  code, stderr = launch_run(command, 1, kill_at_step=15)
  assert code == -signal.SIGKILL, stderr[-2000:]
  code, stderr = launch_run(command, 1)
  assert code == 0, stderr[-3000:]
  expected, got = read_metrics(tmp_path / "reference.jsonl"), read_metrics(tmp_path / "killed.jsonl")
  assert [m["learning/loss"] for m in got] == [m["learning/loss"] for m in expected]  # bitwise
  final = KILL_RESUME_STEPS - 1
  states = [
    ocp.StandardCheckpointer().restore(tmp_path / run / "checkpoints" / str(final) / "items")
    for run in ("reference", "killed")
  ]
  meta = [jax.tree.leaves(s["fp8_meta"]) for s in states]
  assert len(meta[0]) == len(meta[1]) > 0
  for a, b in zip(*meta):
    np.testing.assert_array_equal(a, b)


# --- FP8 statistics of the quantized GEMMs ------------------------------------------------------------------------

FP8_STATS_YAML = """first_qkv:
  enabled: true
  layers: {layer_numbers: [1], layer_types: [qkv]}
  transformer_engine:
    collect_fp8_tensor_stats: {enabled: true, type: [underflows, overflows], tensors: [activation, weight], freq: 1}
"""


@pytest.mark.slow
def test_fp8_statistics_count_the_real_casts_of_the_quantized_gemms(tmp_path):
  """With fp8_scaling=current, the activation is cast as x / (amax / 448): its underflows are those of that
  cast, not of x's unscaled one (which the same statistics report without quantization)."""
  path = _write(tmp_path, FP8_STATS_YAML)
  config = tiny_config(f"numerics_debug_config={path}", "quantization=fp8", "fp8_scaling=current", "base_emb_dim=256")
  plain_config = tiny_config(f"numerics_debug_config={path}", "base_emb_dim=256")
  from MaxText.diagnostics import numerics_stats  # pylint: disable=import-outside-toplevel

  rows = {}
  for name, cfg in (("fp8", config), ("plain", plain_config)):
    _, metrics = run_train_steps(cfg, steps=1)
    plan = numerics_stats.create_plan(cfg, training_setup.build(cfg, mesh.create_device_mesh(cfg)).abstract_state.params)
    rows[name] = {
      (r["layer"], r["tensor"], r["stat"]): r["value"] for r in plan.rows(0, metrics[0][numerics_stats.METRICS_KEY])
    }
  key = ("decoder.layers.0.self_attention.query", "weight", "underflows")
  kernel = np.asarray(_initial_kernel(config), np.float32)
  smallest = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).smallest_subnormal)
  scale = np.abs(kernel).max() / float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
  expected = np.mean((kernel != 0) & (np.abs(kernel) <= scale * smallest / 2))
  unscaled = np.mean((kernel != 0) & (np.abs(kernel) <= smallest / 2))
  assert expected != unscaled
  assert rows["fp8"][key] == pytest.approx(expected, abs=1 / kernel.size)
  assert rows["plain"][key] == pytest.approx(unscaled, abs=1 / kernel.size)
  assert rows["fp8"][key[:2] + ("overflows",)] == 0.0  # current scaling maps the amax to the largest value


def _initial_kernel(config):
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  state = setup.init_state(config, device_mesh)
  return state.params["decoder"]["layers"]["self_attention"]["query"]["kernel"][:, 0]


# --- int8 KV cache -----------------------------------------------------------------------------------------------


def test_the_int8_cache_holds_int8_values_and_their_scales():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 3, 8)) * 4
  for axis, scale_shape in (("heads_and_dkv", (2, 5, 1, 1)), ("dkv", (2, 5, 3, 1))):
    q = kv_cache.quantize(x, axis)
    assert q.values.dtype == jnp.int8 and q.scale.shape == scale_shape
    np.testing.assert_allclose(kv_cache.dequantize(q, jnp.float32), x, atol=float(jnp.max(jnp.abs(x))) / 127)


# The int8 cache's logits against a forward pass without a cache (what the bfloat16 cache computes, to within
# bfloat16 rounding: decode_test), relative to the largest logit.
KV_TOLERANCE = 0.03


def _cache_logit_error(config):
  """Largest |logit| error of cached decoding against a forward pass without a cache, and that largest |logit|."""
  model, params, device_mesh, result = decode_with_logits(config)
  full = full_forward_logits(config, model, params, device_mesh, DECODE_PROMPT, result.tokens)
  return float(np.abs(result.logits - full).max()), float(np.abs(full).max())


@pytest.mark.parametrize("axis", ["heads_and_dkv", "dkv"])
def test_int8_kv_cache_decoding_stays_close_to_the_bf16_cache(axis):
  args = [*DECODE_KEYS, "dtype=bfloat16"]
  error, largest = _cache_logit_error(tiny_config(*args, "quantize_kvcache=true", f"kv_quant_axis={axis}"))
  assert error / largest < KV_TOLERANCE, error / largest
  bf16_error, _ = _cache_logit_error(tiny_config(*args))
  assert error > bf16_error  # the int8 cache does round: the test measures something


def test_the_decode_cache_is_int8_with_its_scales():
  config = tiny_config(*DECODE_KEYS, "quantize_kvcache=true")
  model = training_setup.create_model(config)
  tokens = jnp.ones((2, 8), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  params = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(0)}, tokens, positions)["params"]
  _, variables = model.apply({"params": params}, tokens, positions, mutable=["cache"])
  cache = nn.unbox(variables["cache"]["decoder"]["layers"]["self_attention"])
  assert cache["cached_key"].dtype == jnp.int8 and cache["cached_value"].dtype == jnp.int8
  assert cache["cached_key_scale"].shape == (2, 2, config.max_target_length, 1, 1)  # (layers, B, S, 1, 1)


# --- config ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "arg, message",
  [
    ("quantization=int4", "quantization=int4 is not valid; choose one of"),
    ("fp8_scaling=dynamic", "fp8_scaling=dynamic is not valid"),
    ("kv_quant_dtype=int4", "kv_quant_dtype=int4 is not valid; choose one of: int8"),
    ("kv_quant_axis=heads", "kv_quant_axis=heads is not valid"),
    ("fp8_amax_history_length=0", "fp8_amax_history_length"),
  ],
)
def test_bad_quantization_keys_are_one_config_error(arg, message):
  with pytest.raises(ConfigError, match=message):
    tiny_config(arg)


def test_unquantized_models_have_no_quantization_state():
  config = tiny_config()
  assert quantizations.from_config(config) is None
  setup = training_setup.build(config, mesh.create_device_mesh(config))
  assert not hasattr(setup.abstract_state, "fp8_meta")


def test_resuming_across_a_change_of_fp8_is_one_clear_error():
  from MaxText.errors import UserError  # pylint: disable=import-outside-toplevel
  from MaxText.training import starting_state  # pylint: disable=import-outside-toplevel

  def built(*args):
    config = tiny_config(*args)
    return training_setup.build(config, mesh.create_device_mesh(config))

  fp8, plain = built("quantization=fp8"), built()
  fp8_check, plain_check = starting_state.checks(fp8.features), starting_state.checks(plain.features)
  params = plain.abstract_state.params
  with pytest.raises(UserError, match=r"holds the train state of a feature this run does not use \(fp8_meta\): resume "):
    plain_check({"params": params, "fp8_meta": {}}, plain.abstract_state, "ck/5")
  with pytest.raises(UserError, match=r"holds no fp8 state.*\(load_parameters_path=ck/5/items\)"):
    fp8_check({"params": params}, fp8.abstract_state, "ck/5")
  fp8_check({"params": params, "fp8_meta": fp8.abstract_state.slots["fp8_meta"]}, fp8.abstract_state, "ck/5")
  plain_check({"params": params}, plain.abstract_state, "ck/5")
  shorter = built("quantization=fp8", "fp8_amax_history_length=16").abstract_state.slots["fp8_meta"]
  with pytest.raises(UserError, match=r"saved with fp8_amax_history_length=16, .*: resume with fp8_amax_history_length=16"):
    fp8_check({"params": params, "fp8_meta": shorter}, fp8.abstract_state, "ck/5")


def test_list_layers_says_how_each_layer_runs(tmp_path):
  from MaxText import list_layers  # pylint: disable=import-outside-toplevel

  config = tiny_config("quantization=fp8", f"numerics_debug_config={_write(tmp_path, FIRST_LAYER_HIGH)}")
  params = training_setup.build(config, mesh.create_device_mesh(config), params_only=True).abstract_state.params
  header, *listing = list_layers.layer_lines(config, params)
  lines = {line.split()[0]: " ".join(line.split()) for line in listing}
  column = header.index("quantization")  # the columns line up whatever the kernel shapes' widths
  assert {line[column:].split(":")[0] for line in listing} == {"high precision", "fp8"}
  assert lines["decoder.layers.0.mlp.wo"].endswith("first_layer_high high precision")
  assert lines["decoder.layers.1.mlp.wo"].endswith("- fp8: fprop dgrad wgrad")
  assert lines["decoder.logits_dense"].endswith("high precision")
  recipe = quantizations.Recipe(low=(True, True, False), current=(True, False, False), margin=(1, 0, 0))
  assert quantizations.describe("fp8", recipe) == "fp8: fprop dgrad, wgrad high; current scaling: fprop (margin 1)"
