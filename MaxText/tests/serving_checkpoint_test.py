"""Quantized serving checkpoints (decode.py save_quantized_params_path / checkpoint_is_quantized, upstream's flow):
the int8 kernels decode within the int8 tolerance of the float params, in about a quarter of their size."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from MaxText.checkpoints import serving_checkpoint
from MaxText.errors import ConfigError, UserError
from MaxText.inference import decoding
from MaxText.runtime import mesh, sharding
from MaxText.tests.helpers import tiny_config

# Kernels dominate here (vocab 256), as in real models.
MODEL = ("vocab_size=256", "base_emb_dim=128", "base_mlp_dim=512", "base_num_decoder_layers=4", "head_dim=32")


def _size(path) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _logits(config, model, params, device_mesh, tokens):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  with sharding.logical_context(device_mesh, config):
    return np.asarray(jax.jit(model.apply)({"params": params}, tokens, positions))


@pytest.mark.parametrize("scan", [True, False])
def test_int8_serving_checkpoint_decodes_as_the_float_params_in_a_quarter_of_the_size(tmp_path, scan):
  config = tiny_config(*MODEL, "quantization=int8", f"scan_layers={scan}", "dtype=float32")
  device_mesh = mesh.create_device_mesh(config)
  model, abstract = decoding.build(config, device_mesh)
  params = decoding.random_params(config, model, abstract, device_mesh)
  ocp.PyTreeCheckpointer().save(tmp_path / "float", {"params": params})
  serving_checkpoint.save(config, params, str(tmp_path / "int8"))
  # The arrays: int8 kernels, and in float32 the scales, the embedding, the logits and the norms (as quantization
  # leaves them): 0.30 of the float32 params here, nearer 0.25 in larger models. The files add Orbax's metadata.
  restored = ocp.PyTreeCheckpointer().restore(tmp_path / "int8")["params"]
  arrays = sum(x.nbytes for x in jax.tree.leaves(restored)) / sum(x.nbytes for x in jax.tree.leaves(params))
  assert 0.25 < arrays < 0.31, arrays
  assert _size(tmp_path / "int8") / _size(tmp_path / "float") < 0.36

  served = tiny_config(
    *MODEL,
    "quantization=int8",
    f"scan_layers={scan}",
    "dtype=float32",
    "checkpoint_is_quantized=true",
    f"load_parameters_path={tmp_path / 'int8'}",
  )
  loaded = decoding.load_params(served, model, abstract, device_mesh)
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  assert all(
    a.sharding == b.sharding and a.dtype == b.dtype for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params))
  )
  # Against the float params in float32 GEMMs: the int8 kernels cost less than int8 GEMMs on the float params already
  # do (the int8 tolerance), and decoding them with int8 GEMMs stays within 5% of the largest logit.
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 256)
  plain = config.replace(quantization="")
  plain_model = decoding.build(plain, device_mesh)[0]
  exact = _logits(plain, plain_model, params, device_mesh, tokens)

  def error(cfg, mdl, p):
    return np.max(np.abs(_logits(cfg, mdl, p, device_mesh, tokens) - exact)) / np.max(np.abs(exact))

  int8_gemms, int8_kernels = error(config, model, params), error(plain, plain_model, loaded)
  assert 0 < int8_kernels < int8_gemms, (int8_kernels, int8_gemms)
  assert error(config, model, loaded) < 0.05


def test_wrong_serving_checkpoint_keys_are_one_line(tmp_path):
  with pytest.raises(ConfigError, match="save_quantized_params_path needs quantization=int8"):
    tiny_config(f"save_quantized_params_path={tmp_path}/q")
  with pytest.raises(ConfigError, match="checkpoint_is_quantized=true reads load_parameters_path"):
    tiny_config("quantization=int8", "checkpoint_is_quantized=true")
  config = tiny_config("quantization=int8")
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("")
  with pytest.raises(UserError, match="exists and is not empty"):
    serving_checkpoint.save(config, {}, str(tmp_path / "full"))
