"""quantization=int4w and intmp (quant_cfg_path, upstream's per-layer file), and int8's quantization_local_shard_count:
against numpy references of the quantization they describe."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from MaxText.errors import ConfigError, UserError
from MaxText.layers import quant_rules, quantizations
from MaxText.tests.helpers import tiny_config
from MaxText.tests.tiny_models import GEMM_DIMS, dense_outputs, gemm_and_grads, make_quantization, train_on_one_batch

MP_SCALE = "configs/quantization/mp_scale.json"  # shipped with the package


def _write(tmp_path, content, name="mp.json"):
  path = tmp_path / name
  path.write_text(content if isinstance(content, str) else json.dumps(content))
  return str(path)


# --- the file ----------------------------------------------------------------------------------------------------


def test_the_first_matching_pattern_wins_and_the_rest_take_the_default():
  rules = quant_rules.parse(
    json.dumps({".*/query": {"bits": 4, "scale": 0.8}, ".*/(query|key)": {"bits": 6}, "__default__": {"tile_size": 8}}),
    "mp.json",
  )
  assert rules.find("decoder/layers/self_attention/query") == quant_rules.WeightQuant(4, 0.8, -1)
  assert rules.find("decoder/layers_3/self_attention/key") == quant_rules.WeightQuant(6, 1.0, -1)
  assert rules.find("decoder/layers/mlp/wo") == quant_rules.WeightQuant(8, 1.0, 8)
  assert rules.find("decoder/layers/self_attention/query_norm") == rules.default  # fullmatch, not search
  assert quant_rules.parse('{".*": {}}', "x").find("a/b") == quant_rules.WeightQuant()  # upstream's defaults: 8 bits


@pytest.mark.parametrize(
  "content, message",
  [
    ("{not json", r"quant_cfg_path=mp.json is not valid JSON"),
    ("[]", r"must be a JSON object from module-path patterns to settings"),
    ('{".*": 4}', r"'\.\*' must map to an object such as"),
    ('{".*": {"bits": 1}}', r"'\.\*': bits=1; choose one of 2, 3, 4, 5, 6, 7, 8"),
    ('{".*": {"bits": 16}}', r"bits=16; choose one of 2, 3, 4, 5, 6, 7, 8"),
    ('{".*": {"bits": 4.0}}', r"bits=4\.0; choose one of"),
    ('{".*": {"scale": 1.5}}', r"scale=1\.5; it clips the range to scale x absmax: a number in \(0, 1\]"),
    ('{".*": {"tile_size": 0}}', r"tile_size=0; -1 \(one scale per channel\) or a positive integer"),
    ('{".*": {"w_bits": 4}}', r"unknown field\(s\) w_bits; the fields are bits, scale, tile_size"),
    ('{"(": {"bits": 4}}', r"'\(' is not a regular expression"),
  ],
)
def test_a_mistake_in_the_file_is_one_config_error(content, message):
  with pytest.raises(ConfigError, match=message):
    quant_rules.parse(content, "mp.json")


def test_intmp_needs_an_existing_file_and_the_file_needs_intmp(tmp_path, capsys):
  with pytest.raises(ConfigError, match=r"quantization=intmp reads each layer's bits from quant_cfg_path"):
    tiny_config("quantization=intmp")
  with pytest.raises(ConfigError, match=r"quant_cfg_path=nowhere\.json does not exist"):
    tiny_config("quantization=intmp", "quant_cfg_path=nowhere.json")
  config = tiny_config("quantization=intmp", f"quant_cfg_path={MP_SCALE}")  # found in the package
  assert config.quant_rules.find("decoder/layers/self_attention/query").bits == 4
  tiny_config(f"quant_cfg_path={_write(tmp_path, '{}')}")
  assert "acts only with quantization=intmp; ignored in this run" in capsys.readouterr().err


# --- one GEMM ----------------------------------------------------------------------------------------------------


def _reference_kernel(kernel, quant: quant_rules.WeightQuant):
  """The kernel (16, 32) as weight-only quantization stores it: symmetric integers of `bits` bits, one scale per
  output channel and tile of the contracting axis, from scale x absmax mapped to 2**(bits-1) - 1/2 (qwix's bound)."""
  tile = quant.tile_size if quant.tile_size > 0 else kernel.shape[0]
  tiles = kernel.reshape(kernel.shape[0] // tile, tile, kernel.shape[1])
  step = np.abs(tiles).max(axis=1, keepdims=True) * quant.scale / (2 ** (quant.bits - 1) - 0.5)
  ratio = tiles / step
  integers = np.clip(np.round(ratio), -(2 ** (quant.bits - 1)), 2 ** (quant.bits - 1) - 1)
  # A ratio on a half (the absmax itself, at scale 1) may round either way, depending on how the division rounds.
  tie = np.abs(np.abs(ratio - np.trunc(ratio)) - 0.5) < 2e-5
  steps = np.broadcast_to(step, tiles.shape).reshape(kernel.shape)
  return (integers * step).reshape(kernel.shape), tie.reshape(kernel.shape), steps


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("scale, tile", [(1.0, -1), (0.8, -1), (1.0, 4), (0.7, 8)])
def test_a_weight_only_gemm_multiplies_by_the_quantized_kernel(bits, scale, tile):
  weight = quant_rules.WeightQuant(bits, scale, tile)
  recipe = quantizations.Recipe(low=(True, False, False), weight=weight)
  gemm = functools.partial(quantizations._gemm, make_quantization("intmp"), recipe, None)  # pylint: disable=protected-access
  x = jnp.eye(16, dtype=jnp.float32)[None]  # (1, 16, 16): the output is the kernel the GEMM used
  kernel = jax.random.normal(jax.random.PRNGKey(1), (16, 32))
  used = np.asarray(gemm(x, kernel, GEMM_DIMS))[0]
  expected, tie, steps = _reference_kernel(np.asarray(kernel), weight)
  np.testing.assert_allclose(used[~tie], expected[~tie], rtol=1e-6, atol=1e-7)
  assert np.all(np.abs(used - expected)[tie] <= steps[tie] * 1.0001)  # a tie: one step either way
  assert tie.sum() <= kernel.size // (tile if tile > 0 else 16) + 2  # the ties are the tiles' absmaxes, not the bulk
  exact = gemm_and_grads(lax.dot_general)
  got = gemm_and_grads(gemm)
  np.testing.assert_array_equal(got[1], exact[1])  # weight-only: both backward GEMMs in high precision
  np.testing.assert_array_equal(got[2], exact[2])


def test_local_shard_count_gives_each_part_of_the_batch_its_own_wgrad_scales():
  """With 2 parts, wgrad is the sum of the 1-part wgrads of each half of the batch; with 0 it is exact."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16))
  kernel = jax.random.normal(jax.random.PRNGKey(1), (16, 32)) * 0.1
  g = jax.random.normal(jax.random.PRNGKey(2), (2, 8, 32))

  def wgrad(shards, rows):
    quant = quantizations.Quantization("int8", False, 16, make_quantization("int8").numerics, (), False, None, shards)
    gemm = functools.partial(quantizations._gemm, quant, quant.recipe("decoder.layers.0.mlp.wo"), None, dims=GEMM_DIMS)  # pylint: disable=protected-access
    return jax.vjp(lambda k: gemm(x[rows], k), kernel)[1](g[rows])[0]

  halves = wgrad(1, slice(0, 1)) + wgrad(1, slice(1, 2))
  np.testing.assert_allclose(wgrad(2, slice(None)), halves, rtol=1e-5, atol=1e-6)
  assert not np.allclose(wgrad(1, slice(None)), halves, rtol=1e-5, atol=1e-6)  # one scale over both halves differs
  exact = jax.vjp(lambda k: lax.dot_general(x, k, GEMM_DIMS), kernel)[1](g)[0]
  np.testing.assert_array_equal(wgrad(0, slice(None)), exact)  # 0: wgrad in high precision
  assert not np.array_equal(wgrad(1, slice(None)), exact)


def test_local_shard_count_is_resolved_and_checked(capsys):
  assert quantizations.from_config(tiny_config("quantization=int8")).wgrad_shards == 1  # -1: num_slices, 1 here
  with pytest.raises(ConfigError, match=r"quantization_local_shard_count=3 splits int8's wgrad over the 2 rows"):
    tiny_config("quantization=int8", "quantization_local_shard_count=3", "per_device_batch_size=2")
  with pytest.raises(ConfigError, match=r"quantization_local_shard_count=-2 must be -1 \(num_slices\), 0"):
    tiny_config("quantization_local_shard_count=-2")
  tiny_config("quantization=int8w", "quantization_local_shard_count=2")
  assert "quantization_local_shard_count=2: acts only with quantization=int8" in capsys.readouterr().err


# --- in the model ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_intmp_quantizes_each_layer_as_its_pattern_says(tmp_path, scan):
  """In the first layer (whose q, k, v see the same input in every mode), a projection whose pattern says 8 bits
  computes exactly as under int8w, one that says 4 bits as under int4w, and the default (6 bits) as neither."""
  path = _write(
    tmp_path, {".*/self_attention/key": {"bits": 4}, ".*/self_attention/query": {"bits": 8}, "__default__": {"bits": 6}}
  )
  outputs = {
    mode: dense_outputs(f"scan_layers={scan}", f"quantization={mode}", f"quant_cfg_path={path}")
    for mode in ("intmp", "int8w", "int4w")
  }
  first_layer = {}
  for key, value in outputs["intmp"].items():
    name = jax.tree_util.keystr(key)
    if "self_attention" in name and (scan or "layers_0" in name):
      projection = name.split("['self_attention']['")[1].split("'")[0]
      first_layer[projection] = (
        value[0] if scan else value,
        *(outputs[m][key][0] if scan else outputs[m][key] for m in ("int8w", "int4w")),
      )
  intmp, int8w, _ = first_layer["query"]
  np.testing.assert_array_equal(intmp, int8w)
  intmp, _, int4w = first_layer["key"]
  np.testing.assert_array_equal(intmp, int4w)
  intmp, int8w, int4w = first_layer["value"]
  assert not np.array_equal(intmp, int8w) and not np.array_equal(intmp, int4w)
  assert np.abs(intmp - int8w).max() < np.abs(int4w - int8w).max()  # 6 bits: nearer 8 than 4 is


def test_a_tile_that_does_not_divide_the_kernel_is_one_line(tmp_path):
  path = _write(tmp_path, {".*/mlp/wo": {"tile_size": 5}})
  with pytest.raises(UserError, match=r"tile_size=5 for decoder/layers/mlp/wo, whose kernel's innermost contracting"):
    dense_outputs("quantization=intmp", f"quant_cfg_path={path}")


@pytest.mark.parametrize("mode", ["int4w", "intmp"])
def test_a_weight_only_run_learns(mode):
  losses, _ = train_on_one_batch("dtype=bfloat16", f"quantization={mode}", f"quant_cfg_path={MP_SCALE}", steps=8)
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0]
