"""numerics_debug_config: layer selection, the YAML's errors, statistics computed in the step against the same
tensors taken outside it (scanned and unrolled layers), freq gating, and the same compiled step when off."""

import functools
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from MaxText.aot import aot_compile, compiled_step_file
from MaxText.checkpoints import layer_stacking
from MaxText.diagnostics import numerics_config, numerics_log, numerics_stats, numerics_taps
from MaxText.errors import ConfigError
from MaxText.features import selection
from MaxText.layers import layer_names, linears, models
from MaxText.list_layers import layer_lines
from MaxText.runtime import mesh
from MaxText.tests.helpers import TRAIN_PY, run_python, tiny_args, tiny_config
from MaxText.tests.tiny_models import padded_token_batch, run_train_steps
from MaxText.training import train_step, training_setup

ALL_STATS = (*numerics_config.STATS, *numerics_config.FP8_STATS)

# Layer 2 (decoder.layers.1) of the tiny model: its attention output projection and its MLP's second GEMM.
STATS_YAML = """
fc2_and_attention_out:
  enabled: true
  layers:
    layer_numbers: [2]
    layer_types: [attention_out, fc2]
  collect_tensor_stats:
    enabled: true
    type: [min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range]
    tensors: [activation, gradient, weight]
    freq: 2
  transformer_engine:
    collect_fp8_tensor_stats:
      enabled: true
      type: [underflows, overflows]
      tensors: [activation, gradient, weight]
      freq: 2
"""
TARGETS = ("self_attention", "out"), ("mlp", "wo")


def _write(tmp_path, text, name="numerics.yml"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


# --- selection -------------------------------------------------------------------------------------------------

NAMES = [
  *(
    f"decoder.layers.{i}.{m}" for i in range(4) for m in ("self_attention.query", "self_attention.out", "mlp.wi_0", "mlp.wo")
  ),
  "decoder.logits_dense",
]


def _selected(layers_yaml: str) -> list[str]:
  section = numerics_config.parse({"s": {"enabled": True, "layers": layers_yaml}}, "test").sections[0]
  return [name for name in NAMES if section.layers.matches(name)]


def test_regex_selects_by_the_whole_name():
  assert _selected({"layer_name_regex_pattern": r".*\.mlp\.(wi_0|wo)"}) == [n for n in NAMES if ".mlp." in n]
  assert _selected({"layer_name_regex_pattern": r"decoder\.layers\.3\..*"}) == [n for n in NAMES if ".layers.3." in n]
  assert _selected({"layer_name_regex_pattern": "mlp"}) == []  # a part of the name does not match
  assert _selected({"layer_name_regex_pattern": r".*logits.*"}) == ["decoder.logits_dense"]


def test_layer_numbers_count_from_one():
  assert _selected({"layer_numbers": [1]}) == [n for n in NAMES if ".layers.0." in n]
  assert _selected({"layer_numbers": ["2-3"]}) == [n for n in NAMES if ".layers.1." in n or ".layers.2." in n]
  assert _selected({"layer_numbers": [1, 4]}) == [n for n in NAMES if ".layers.0." in n or ".layers.3." in n]
  assert _selected({"layer_numbers": ["all"]}) == NAMES[:-1]  # logits_dense is in no layer


def test_layer_types_and_their_combination_with_numbers():
  assert _selected({"layer_types": ["qkv"]}) == [n for n in NAMES if n.endswith("query")]
  assert _selected({"layer_types": ["mlp"]}) == [n for n in NAMES if ".mlp." in n]
  assert _selected({"layer_types": ["fc1", "attention_out"]}) == [n for n in NAMES if n.endswith(("wi_0", ".out"))]
  assert _selected({"layer_types": ["all"]}) == NAMES
  assert _selected({"layer_numbers": [4], "layer_types": ["fc2"]}) == ["decoder.layers.3.mlp.wo"]


def test_layer_names_of_scanned_and_unrolled_params_agree(tmp_path):
  names = {}
  for scan in (True, False):
    config = tiny_config(f"scan_layers={scan}")
    params = training_setup.build(config, mesh.create_device_mesh(config), check_memory=False).abstract_state.params
    names[scan] = [
      (layer.name, layer.type, layer.number, layer.kernel_shape) for layer in layer_names.dense_layers(params, config)
    ]
  assert names[True] == names[False]
  assert ("decoder.layers.1.self_attention.out", "attention_out", 2, (4, 8, 32)) in names[True]
  assert names[True][-1][0] == "decoder.logits_dense"
  listing = "\n".join(layer_lines(tiny_config(f"numerics_debug_config={_write(tmp_path, STATS_YAML)}"), params))
  assert re.search(r"^decoder\.layers\.1\.mlp\.wo +2 +fc2 +\[64, 32\] +fc2_and_attention_out$", listing, re.M)
  assert re.search(r"^decoder\.layers\.0\.mlp\.wo +1 +fc2 +\[64, 32\] +-$", listing, re.M)


def test_low_precision_controls_are_parsed_for_the_quantized_layers():
  numerics = numerics_config.parse(
    {
      "fc2_high": {"enabled": True, "layers": {"layer_types": ["fc2"]}, "disable_fp8_layer": {"enabled": True}},
      "qkv": {
        "enabled": True,
        "layers": {"layer_types": ["qkv"], "layer_numbers": [1]},
        "transformer_engine": {
          "disable_fp8_gemm": {"enabled": True, "gemms": ["wgrad"]},
          "per_tensor_scaling": {"enabled": True, "gemms": ["fprop", "dgrad"], "margin": 2},
        },
      },
    },
    "test",
  )
  high = numerics_config.GemmPrecision(low_precision=False)
  assert numerics.gemm_precision("decoder.layers.2.mlp.wo", "fprop") == high
  assert numerics.gemm_precision("decoder.layers.0.self_attention.query", "wgrad") == high
  assert numerics.gemm_precision("decoder.layers.0.self_attention.query", "dgrad") == numerics_config.GemmPrecision(
    per_tensor_scaling=True, margin=2
  )
  assert numerics.gemm_precision("decoder.layers.1.self_attention.query", "fprop") == numerics_config.GemmPrecision()
  assert not numerics.collects_stats
  assert numerics_config.parse(numerics.to_plain(), "again") == numerics


def test_low_precision_controls_that_do_nothing_are_warned_about(tmp_path, capsys):
  scaling = QKV + "  per_tensor_scaling: {enabled: true, gemms: [fprop], margin: 1}\n"
  tiny_config(f"numerics_debug_config={_write(tmp_path, scaling)}", "quantization=fp8")
  tiny_config(f"numerics_debug_config={_write(tmp_path, STATS_YAML, 'stats.yml')}")  # statistics only
  assert "WARNING" not in capsys.readouterr().err
  tiny_config(f"numerics_debug_config={_write(tmp_path, scaling)}")
  assert "apply with a quantization (int8, fp8, ...); ignored in this run" in capsys.readouterr().err
  tiny_config(f"numerics_debug_config={_write(tmp_path, scaling)}", "quantization=int8")
  assert "per_tensor_scaling applies to quantization=fp8 (quantization=int8 scales each channel)" in capsys.readouterr().err
  tiny_config("fp8_scaling=current")
  assert "fp8_scaling=current: acts only with quantization=fp8; ignored in this run" in capsys.readouterr().err


# --- malformed files -------------------------------------------------------------------------------------------

QKV = "s1:\n  enabled: true\n  layers: {layer_types: [qkv]}\n"  # a valid section, which the cases below extend
ALL_OF_STATS = "min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range"
BAD_FILES = [
  (
    "s1:\n  enabled: true\n  layers: {layer_types: [qkvv]}\n",
    f"section 's1' layers.layer_types: 'qkvv' is not one of {', '.join(numerics_config.SELECTABLE_TYPES)}",
  ),
  (
    "s1:\n  enabled: true\n  layers: {}\n",
    "section 's1' layers: needs at least one of layer_name_regex_pattern, layer_numbers, layer_types",
  ),
  (
    "s1:\n  enabled: true\n  layers: {layer_name_regex_pattern: '.*', layer_numbers: [1]}\n",
    "cannot be combined with layer_numbers",
  ),
  (
    "s1:\n  enabled: true\n  layers: {layer_name_regex_pattern: '(mlp'}\n",
    "layer_name_regex_pattern: '(mlp' is not a valid regular",
  ),
  ("s1:\n  enabled: true\n  layers: {layer_numbers: [0]}\n", "layers.layer_numbers: 0 must count from 1"),
  ("s1:\n  enabled: true\n  layers: {layer_numbers: [3-1]}\n", "layers.layer_numbers: '3-1' must count from 1"),
  (
    "s1:\n  enabled: true\n  layers: {layer_numbers: [9]}\n",
    "layers.layer_numbers: 9 is beyond this model's 2 layers (1-2)",
  ),
  (
    "s1:\n  enabled: true\n  layers: {layer_numbers: [first]}\n",
    "'first' is not a layer number, a range such as 1-12, or all",
  ),
  ("s1:\n  layers: {layer_types: [qkv]}\n", "section 's1' enabled: is missing"),
  ("s1:\n  enabled: yes\n  layers: {layer_types: [qkv]}\n", "section 's1' enabled: 'yes' is not true or false"),
  (
    "s1:\n  enabled: true\n  layer: {layer_types: [qkv]}\n",
    "section 's1' layer: unknown field; did you mean 'layers'? (valid: enabled, layers,",
  ),
  (
    QKV + "  collect_tensor_stats: {enabled: true, type: [median], tensors: [activation]}\n",
    f"section 's1' collect_tensor_stats.type: 'median' is not one of {ALL_OF_STATS}",
  ),
  (
    QKV + "  collect_tensor_stats: {enabled: true, type: [min], tensors: [input]}\n",
    "collect_tensor_stats.tensors: 'input' is not one of activation, gradient, weight",
  ),
  (
    QKV + "  collect_tensor_stats: {enabled: true, type: [min], tensors: [weight], freq: 0}\n",
    "freq: 0 must be an integer >= 1",
  ),
  (
    QKV + "  collect_tensor_stats: {enabled: true, type: [min], tensors: [weight], start_step: 9, end_step: 5}\n",
    "collect_tensor_stats.end_step: 5 is before start_step=9",
  ),
  (
    QKV + "  transformer_engine: {collect_fp8_tensor_stats: {enabled: true, type: [min], tensors: [weight]}}\n",
    "transformer_engine.collect_fp8_tensor_stats.type: 'min' is not one of underflows, overflows",
  ),
  (
    QKV + "  transformer_engine: {disable_fp8_gemm: {enabled: true, gemms: [bprop]}}\n",
    "section 's1' transformer_engine.disable_fp8_gemm.gemms: 'bprop' is not one of fprop, dgrad, wgrad",
  ),
  (
    QKV + "  per_tensor_scaling: {enabled: true, gemms: [fprop], margin: 0.5}\n",
    "per_tensor_scaling.margin: 0.5 must be an integer",
  ),
  (
    QKV + "  per_tensor_scaling: {enabled: true, gemms: [fprop], margin: 31}\n",
    "per_tensor_scaling.margin: 31 must be an integer from 0 to 8",
  ),
  (
    QKV + "  per_tensor_scaling: {enabled: true, gemms: [fprop], margin: -2}\n",
    "per_tensor_scaling.margin: -2 must be an integer from 0 to 8",
  ),
  (
    "s1:\n  enabled: true\n  layers: {layer_numbers: [all, 9]}\n",
    "layers.layer_numbers: all cannot be combined with layer numbers",
  ),
  ("s1:\n  enabled: true\n  layers: {layer_types: [qkv]}\ns1:\n  enabled: false\n", "'s1' is set twice (first on line 1)"),
  ("s1: [1, 2]\n", "section 's1': must be a mapping of field: value"),
  ("- s1\n", "must be a mapping of named sections"),
  ("s1: {enabled: true\n", "is not valid YAML at line 2"),
]


@pytest.mark.parametrize("text, message", BAD_FILES, ids=[m[:40] for _, m in BAD_FILES])
def test_a_malformed_file_is_one_config_error_naming_the_field(tmp_path, text, message):
  path = _write(tmp_path, text)
  with pytest.raises(ConfigError) as error:
    numerics_config.load(path, num_layers=2)
  assert f"numerics_debug_config={path}" in str(error.value)
  assert message in str(error.value)
  assert "\n" not in str(error.value)


def test_the_entry_point_stops_before_compiling_with_one_line_and_exit_2(tmp_path):
  path = _write(tmp_path, BAD_FILES[0][0])
  result = run_python([TRAIN_PY, "MaxText/configs/base.yml", "run_name=x", *tiny_args(f"numerics_debug_config={path}")])
  assert result.returncode == 2, result.stderr
  assert result.stderr.strip().splitlines() == [f"Error: numerics_debug_config={path}: {BAD_FILES[0][1]}"]
  missing = run_python([TRAIN_PY, "MaxText/configs/base.yml", "run_name=x", "numerics_debug_config=/no/such.yml"])
  assert missing.returncode == 2 and "numerics_debug_config=/no/such.yml does not exist" in missing.stderr


# --- statistics in the step against the same tensors outside it ---------------------------------------------------


def _reference(config, params, batch, module_path):
  """The input, kernel and loss gradient w.r.t. the output of one DenseGeneral, from the model's own forward pass
  (unrolled layers, float32), with the output's gradient taken by jax.grad through an added perturbation."""
  model = training_setup.create_model(config)
  taken = {}

  def loss(perturbation):
    def interceptor(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if isinstance(context.module, linears.DenseGeneral) and context.module.path == module_path:
        taken.update(activation=args[0], weight=context.module.variables["params"]["kernel"], output=out)
        return out + perturbation
      return out

    with nn.intercept_methods(interceptor):
      total, (weights, *_) = train_step.loss_fn(
        model, config, selection.for_config(config), params, batch, jax.random.PRNGKey(0), True
      )
    return total / weights, dict(taken)

  output = jax.eval_shape(loss, 0.0)[1]["output"]
  gradient, tensors = jax.jit(jax.grad(loss, has_aux=True))(jnp.zeros(output.shape, jnp.float32))
  return {"activation": tensors["activation"], "weight": tensors["weight"], "gradient": gradient}


def _numpy_stats(x, tensor):
  """The statistics in float64 numpy (the FP8 casts of the float32 values through ml_dtypes)."""
  fp8 = ml_dtypes.float8_e5m2 if tensor == "gradient" else ml_dtypes.float8_e4m3fn
  x32 = np.asarray(x, np.float32)
  x = x32.astype(np.float64)
  flushed = (x32 != 0) & (x32.astype(fp8).astype(np.float32) == 0)
  nonzero = np.abs(x[x != 0])
  return {
    "min": x.min(),
    "max": x.max(),
    "mean": x.mean(),
    "std": x.std(ddof=1),
    "l1_norm": np.abs(x).sum(),
    "l2_norm": np.sqrt(np.square(x).sum()),
    "cur_amax": np.abs(x).max(),
    "dynamic_range": np.log2(np.abs(x).max()) - np.log2(nonzero.min()),
    "underflows": flushed.mean(),
    "overflows": (np.abs(x32) > float(ml_dtypes.finfo(fp8).max)).mean(),
  }


@pytest.fixture(scope="module", params=[True, pytest.param(False, marks=pytest.mark.slow)], ids=["scanned", "unrolled"])
def collected(request, tmp_path_factory):
  """Two steps with statistics every 2 steps (freq: 2), scanned or unrolled layers, and the reference tensors."""
  path = _write(tmp_path_factory.mktemp("numerics"), STATS_YAML)
  config = tiny_config(f"scan_layers={request.param}", f"numerics_debug_config={path}")
  params, metrics = run_train_steps(config, steps=2)
  unrolled_config = tiny_config("scan_layers=false", "remat_policy=none")  # the plain forward pass, no remat
  unrolled = dict(params)
  if request.param:
    unrolled["decoder"] = layer_stacking.unstack_layers(params["decoder"], config.num_decoder_layers, config.param_scan_axis)
  references = {
    path: _reference(unrolled_config, unrolled, padded_token_batch(), ("decoder", "layers_1", *path)) for path in TARGETS
  }
  return config, metrics, references


def test_statistics_equal_those_of_the_same_tensors_outside_the_step(collected):
  config, metrics, references = collected
  plan = numerics_stats.create_plan(
    config, training_setup.build(config, mesh.create_device_mesh(config)).abstract_state.params
  )
  rows = plan.rows(0, metrics[0][numerics_stats.METRICS_KEY])
  assert {row["layer"] for row in rows} == {"decoder.layers.1.self_attention.out", "decoder.layers.1.mlp.wo"}
  assert len(rows) == 2 * 3 * len(ALL_STATS)
  for row in rows:
    x = references[tuple(row["layer"].split(".")[-2:])][row["tensor"]]
    expected = _numpy_stats(x, row["tensor"])[row["stat"]]
    # float32 sums over a few thousand elements. The fractions are counts over x.size, exact up to one element at
    # the FP8 rounding boundary. dynamic_range rests on the smallest nonzero |x| alone, which for a gradient is what
    # is left of a cancellation: other orders of the same float32 sums (scan, remat) move it by a few ulps of amax
    # (2.4e-7 x amax seen), so compare 2**-dynamic_range = min|x| / amax to 1e-6.
    value, tolerance = row["value"], dict(rtol=2e-5, atol=1e-9)
    if row["stat"] in numerics_config.FP8_STATS:
      tolerance = dict(atol=1.0 / x.size)
    elif row["stat"] == "dynamic_range":
      value, expected, tolerance = 2.0**-value, 2.0**-expected, dict(rtol=0, atol=1e-6)
    np.testing.assert_allclose(value, expected, err_msg=str(row), **tolerance)
  by_stat = {(r["layer"], r["tensor"], r["stat"]): r["value"] for r in rows}
  assert by_stat[("decoder.layers.1.mlp.wo", "gradient", "l2_norm")] > 0


def test_off_frequency_steps_compute_nothing_and_report_nothing(collected):
  config, metrics, _ = collected
  numerics = config.numerics_debug
  assert numerics.sections[0].stats[0].active(0) and not numerics.sections[0].stats[0].active(1)
  step1 = metrics[1][numerics_stats.METRICS_KEY]
  assert all(float(np.max(np.abs(v))) == 0.0 for v in jax.tree.leaves(step1))  # the lax.cond's off branch
  layer0 = jax.tree.map(lambda v: v[0], metrics[0][numerics_stats.METRICS_KEY]) if config.scan_layers else None
  if layer0 is not None:  # layer 1 (index 0) of the scanned modules is not selected: gated off in the scan
    assert all(float(np.max(np.abs(v))) == 0.0 for v in jax.tree.leaves(layer0))


def test_microbatches_combine_to_the_whole_batch_statistics():
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 32, 16)) * 3.0 + 1.0
  x = x.at[0, 0, :4].set(0.0).at[3, 1, 0].set(500.0).at[2, 2, 2].set(1e-4)
  reductions = tuple(sorted({r for stat in ALL_STATS for r in numerics_taps.REDUCTIONS[stat]}))

  def reduced(part):
    return {"k": {"activation": numerics_taps.reduce(part, reductions, jnp.float8_e4m3fn)}}

  @jax.jit
  def statistics(x):
    halves = numerics_stats.combine(reduced(x[:1]), reduced(x[1:]))
    quarters = functools.reduce(numerics_stats.combine, [reduced(x[i : i + 1]) for i in range(4)])
    return [numerics_stats.finalize_tensor(r["k"]["activation"], ALL_STATS) for r in (reduced(x), halves, quarters)]

  whole, *combined = statistics(x)
  expected = _numpy_stats(x, "activation")
  for stats in combined:
    for name in ALL_STATS:
      np.testing.assert_allclose(stats[name], whole[name], rtol=1e-5, err_msg=name)
      np.testing.assert_allclose(stats[name], expected[name], rtol=1e-5, err_msg=name)
  assert float(whole["overflows"]) == pytest.approx(1 / x.size) and float(whole["underflows"]) > 0


# --- free when off ---------------------------------------------------------------------------------------------


def _compiled_hlo(config) -> str:
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  hlo = aot_compile.lower_train_step(setup, config, device_mesh).compile().as_text()
  hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)  # source lines
  return re.sub(r"(?m)^(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*\n?", "", hlo)


def test_off_by_default_compiles_to_the_same_step_as_without_the_feature(monkeypatch):
  config = tiny_config()
  assert config.numerics_debug_config == "" and not config.numerics_debug
  with_feature = _compiled_hlo(config)
  # Without the feature's code path (nor quantization's): the dense layers call lax.dot_general, the scan stacks
  # no `numerics` collection, and the step builds no statistics plan.
  monkeypatch.setattr(numerics_taps, "dot_general", lambda module, x, kernel, dims, *_: lax.dot_general(x, kernel, dims))
  monkeypatch.setattr(models, "STACKED_COLLECTIONS", {"intermediates": 0, "cache": 0})
  monkeypatch.setattr(numerics_stats, "create_plan", lambda config, params: None)
  assert _compiled_hlo(config) == with_feature


def test_the_compiled_step_signature_holds_the_files_content_not_its_path(tmp_path):
  def signature(text, name):
    config = tiny_config(f"numerics_debug_config={_write(tmp_path, text, name)}")
    return compiled_step_file.step_signature(config, jax.devices())

  assert signature(STATS_YAML, "a.yml") == signature(STATS_YAML, "b.yml")
  assert signature(STATS_YAML, "a.yml") != signature(STATS_YAML.replace("freq: 2", "freq: 3"), "c.yml")
  assert signature(STATS_YAML, "a.yml") != compiled_step_file.step_signature(tiny_config(), jax.devices())


# --- written by the run ----------------------------------------------------------------------------------------


def test_the_run_writes_statistics_lines_tensorboard_and_debug_logs(tmp_path):
  path = _write(tmp_path, STATS_YAML)
  config = tiny_config(f"numerics_debug_config={path}", tmp_path=tmp_path)
  params = training_setup.build(config, mesh.create_device_mesh(config)).abstract_state.params

  class Writer:
    scalars = []

    def add_scalar(self, tag, value, step):
      self.scalars.append((tag, value, step))

  (writer,) = numerics_log.observers(config, params, Writer(), start_step=0)
  plan = writer.plan
  stats = plan.finalize(
    {tap.key: {t: {r: jnp.ones(len(tap.layers)) for r in tap.reductions(t)} for t in tap.tensors()} for tap in plan.taps}
  )
  writer(0, {}, {numerics_stats.METRICS_KEY: jax.device_get(stats)})
  writer(1, {}, {numerics_stats.METRICS_KEY: jax.device_get(stats)})  # freq 2: not reported
  run_dir = tmp_path / "test"
  lines = [
    json.loads(line) for line in (run_dir / "debug_statistics_logs" / "numerics_statistics.jsonl").read_text().splitlines()
  ]
  assert len(lines) == 2 * 3 * len(ALL_STATS) and {line["step"] for line in lines} == {0}
  assert set(lines[0]) == {"step", "layer", "tensor", "stat", "value"}
  assert lines[0]["layer"] == "decoder.layers.1.mlp.wo" and lines[0]["tensor"] == "activation"
  assert ("numerics/decoder.layers.1.mlp.wo/activation/min", 1.0, 0) in Writer.scalars
  selected = (run_dir / "debug_logs" / "selected_layers.txt").read_text()
  assert "decoder.layers.1.self_attention.out  attention_out" in selected and "layers.0." not in selected
  assert "fc2_and_attention_out" in (run_dir / "debug_logs" / "numerics_debug_config.yml").read_text()
