"""What the remat policies for fused attention kernels keep for the backward pass, read from JAX's own list of
the saved residuals (the unrolled tiny model: each layer's remat block is visible there)."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import pytest

from MaxText.features import selection
from MaxText.tests.helpers import tiny_config, token_batch
from MaxText.training import train_step, training_setup

_QKV = {"query_proj", "key_proj", "value_proj"}


def _saved_residuals(policy: str) -> str:
  """jax.ad_checkpoint.print_saved_residuals of the loss of the unrolled tiny model under `policy`."""
  config = tiny_config("scan_layers=false", f"remat_policy={policy}")
  model = training_setup.create_model(config)
  batch = token_batch(2, 32, 0, jnp.ones((2, 32), jnp.int32))
  rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(0)}
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
  params = jax.eval_shape(lambda: model.init(rngs, *inputs))["params"]

  def loss(p):
    return train_step.loss_fn(model, config, selection.for_config(config), p, batch, jax.random.PRNGKey(0), True)[0]

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
