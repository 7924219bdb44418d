"""What the remat policies for fused attention kernels, and remat_policy=custom's per-name choices, keep for the
backward pass, read from JAX's own list of the saved residuals (the unrolled tiny model: each layer's remat block is
visible there)."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.errors import ConfigError
from MaxText.features import selection
from MaxText.runtime import mesh
from MaxText.tests.helpers import tiny_config, token_batch
from MaxText.training import train_step, training_setup

_QKV = {"query_proj", "key_proj", "value_proj"}


def _loss_and_params(policy: str, *args):
  """The loss of the unrolled tiny model under `policy` (a function of the params), and its initial params."""
  config = tiny_config("scan_layers=false", f"remat_policy={policy}", *args)
  model = training_setup.create_model(config)
  batch = token_batch(2, 32, 0, jnp.ones((2, 32), jnp.int32))
  rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(0)}
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
  params = model.init(rngs, *inputs)["params"]

  def loss(p):
    return train_step.loss_fn(model, config, selection.for_config(config), p, batch, jax.random.PRNGKey(0), True)[0]

  return loss, params


def _saved_residuals(policy: str, *args) -> str:
  """jax.ad_checkpoint.print_saved_residuals of the loss of the unrolled tiny model under `policy`."""
  loss, params = _loss_and_params(policy, *args)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(loss, params)
  return out.getvalue()


@pytest.mark.parametrize(
  "policy, names",
  [
    ("minimal_flash", {"context"}),  # and every dot without batch dims, unnamed
    ("minimal_with_context", {"context", "out_proj", "mlpwi", *_QKV}),
    ("save_dot_with_context_except_mlp", {"context", "out_proj", *_QKV}),
    ("full", set()),
  ],
)
def test_named_residuals(policy, names):
  assert set(re.findall(r"named '(\w+)'", _saved_residuals(policy))) == names


def test_qkv_proj_offloaded_keeps_q_k_v_in_host_memory():
  residuals = _saved_residuals("qkv_proj_offloaded")
  on_host = re.findall(r"f32<host>\[([\d,]+)\]", residuals)
  # Per layer (2): the query (B, T, 4 heads, 8) and the key and value (B, T, 2 kv heads, 8).
  assert sorted(on_host) == sorted(["2,32,4,8", "2,32,2,8", "2,32,2,8"] * 2)
  assert "named '" not in residuals


CUSTOM = ["decoder_layer_input=offload", "out_proj=device"]


def test_custom_offloads_and_keeps_the_names_it_is_told():
  residuals = _saved_residuals("custom", *CUSTOM)
  # Per layer (2): the layer's input (B, T, emb) in host memory, out_proj's output kept on the device.
  assert re.findall(r"f32<host>\[([\d,]+)\]", residuals) == ["2,32,32"] * 2
  assert re.findall(r"named '(\w+)'", residuals) == ["out_proj"] * 2


def test_custom_gives_full_remats_loss_and_gradients():
  (loss, params), (full, _) = _loss_and_params("custom", *CUSTOM), _loss_and_params("full")
  (value, grads), (expected, expected_grads) = (jax.jit(jax.value_and_grad(f))(params) for f in (loss, full))
  assert value == pytest.approx(float(expected), rel=1e-6)
  jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7), grads, expected_grads)


def test_a_name_the_model_does_not_compute_is_one_line_naming_its_names():
  config = tiny_config("remat_policy=custom", "mla_q=device")
  with pytest.raises(ConfigError) as error:
    training_setup.build(config, mesh.create_device_mesh(config))
  assert str(error.value) == (
    "remat_policy=custom: mla_q=device: decoder_block=llama2 computes no such activation; its names are "
    "decoder_layer_input, context, mlpwi, mlpwi_0, mlpwi_1, mlpwo, query_proj, key_proj, value_proj, out_proj"
  )
