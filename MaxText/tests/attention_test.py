"""attention=flash (the TPU splash kernel, run here in the Pallas interpreter) against dot_product."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.layers.attentions import dot_product_attention
from MaxText.layers.flash_attention import flash_attention
from MaxText.tests.helpers import run_python

B, T, NQ, NKV, D = 4, 128, 4, 2, 64


def _qkv_segments():
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (B, T, NQ, D)) / 8
  k = jax.random.normal(ks[1], (B, T, NKV, D))
  v = jax.random.normal(ks[2], (B, T, NKV, D))
  seg = jnp.concatenate([jnp.ones((B, 50), jnp.int32), 2 * jnp.ones((B, T - 50), jnp.int32)], axis=1)
  return q, k, v, seg


def test_flash_matches_dot_product_forward_and_backward():
  q, k, v, seg = _qkv_segments()
  flash = functools.partial(flash_attention, interpret=True)
  np.testing.assert_allclose(flash(q, k, v, seg), dot_product_attention(q, k, v, seg), atol=2e-6)
  grads_flash = jax.grad(lambda *a: flash(*a, seg).sum(), argnums=(0, 1, 2))(q, k, v)
  grads_dot = jax.grad(lambda *a: dot_product_attention(*a, seg).sum(), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(grads_flash, grads_dot):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def _sharded_checks():
  """Flash attention under data, fsdp, tensor and context sharding against dot_product; run with 8 forced CPU
  devices (python3 -m MaxText.tests.attention_test), as the test below does."""
  from MaxText.layers import context_parallel  # pylint: disable=import-outside-toplevel
  from MaxText.runtime import mesh, sharding  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import tiny_config  # pylint: disable=import-outside-toplevel

  config = tiny_config("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_data_parallelism=2")
  device_mesh = mesh.create_device_mesh(config)
  q, k, v, seg = _qkv_segments()
  with sharding.logical_context(device_mesh, config):
    out = jax.jit(functools.partial(flash_attention, interpret=True))(q, k, v, seg)
  np.testing.assert_allclose(out, dot_product_attention(q, k, v, seg), atol=2e-6)
  # Fewer rows (4) than batch shards (fsdp 8), as with a fractional per_device_batch_size: rows split 4 ways.
  config = tiny_config("ici_fsdp_parallelism=8")
  with sharding.logical_context(mesh.create_device_mesh(config), config):
    out = jax.jit(functools.partial(flash_attention, interpret=True))(q, k, v, seg)
  np.testing.assert_allclose(out, dot_product_attention(q, k, v, seg), atol=2e-6)
  # Context parallelism (all_gather) with load balancing: the queries split over context, the mask cut into its
  # shards and masking by original index; forward and gradients against dot_product in the original order.
  context = ["ici_context_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "max_target_length=256"]
  config = tiny_config(*context)
  layout = context_parallel.from_config(config)
  order, back = layout.token_order(256), np.argsort(layout.token_order(256))
  q, k, v, seg = (jnp.concatenate([x, x[:, ::-1]], axis=1) for x in (q, k, v, seg))  # 256 tokens: 128 queries a shard
  ct = jax.random.normal(jax.random.PRNGKey(5), q.shape)

  def flash(q, k, v):
    q, k, v, s = (x[:, order] for x in (q, k, v, seg))
    out = flash_attention(q, k, v, s, sliding_window=40, interpret=True, layout=layout)
    return (out[:, back] * ct).sum()

  def reference(q, k, v):
    return (dot_product_attention(q, k, v, seg, sliding_window=40) * ct).sum()

  with sharding.logical_context(mesh.create_device_mesh(config), config):
    got = jax.jit(jax.value_and_grad(flash, argnums=(0, 1, 2)))(q, k, v)
  want = jax.value_and_grad(reference, argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  print("sharded flash ok")


def test_flash_under_data_fsdp_tensor_context_sharding():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  result = run_python(["-m", "MaxText.tests.attention_test"], env_extra=env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "sharded flash ok" in result.stdout


if __name__ == "__main__":
  _sharded_checks()
