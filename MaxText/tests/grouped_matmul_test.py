"""The experts' grouped matmuls (layers/grouped_matmul.py): megablox's Pallas kernels (interpreted on CPU) and the GPU
path's padded tiles against jax.lax.ragged_dot and a float64 NumPy reference, forward and both gradients; which
kernel a config runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.layers import grouped_matmul
from MaxText.layers.grouped_matmul import GroupedMatmul
from MaxText.tests.helpers import tiny_config

M, K, N = 40, 16, 24
SIZES = [7, 0, 20, 5]  # uneven, an empty group, and 8 trailing rows past sum(SIZES)
# Row tiles that do not divide the rows (padded inside), a k tile that does not divide k (masked by the kernel).
ODD_TILES = ((("wi", "fwd", "batch_seq"), 16), (("wi", "fwd", "embed_dim"), 12), (("wi", "drhs", "batch_seq"), 24))


def _data():
  rng = np.random.default_rng(0)
  lhs, rhs, cotangent = rng.normal(size=(M, K)), rng.normal(size=(len(SIZES), K, N)), rng.normal(size=(M, N))
  return lhs, rhs, cotangent


def _numpy_reference(lhs, rhs, cotangent):
  """Per group in float64: y = x w_e, dx = g w_e^T, dw_e = x^T g; rows past the groups give 0 and get 0."""
  out, dlhs, drhs = np.zeros((M, N)), np.zeros((M, K)), np.zeros_like(rhs)
  start = 0
  for e, size in enumerate(SIZES):
    rows = slice(start, start + size)
    out[rows] = lhs[rows] @ rhs[e]
    dlhs[rows] = cotangent[rows] @ rhs[e].T
    drhs[e] = lhs[rows].T @ cotangent[rows]
    start += size
  return out, dlhs, drhs


def _forward_and_grads(matmul, lhs, rhs, cotangent):
  lhs, rhs, cotangent = (jnp.asarray(a, jnp.float32) for a in (lhs, rhs, cotangent))
  sizes = jnp.asarray(SIZES, jnp.int32)

  def forward_and_grads(a, b):
    out, vjp = jax.vjp(lambda a, b: matmul(a, b, sizes, "wi"), a, b)
    return (out, *vjp(cotangent))

  return jax.jit(forward_and_grads)(lhs, rhs), str(jax.make_jaxpr(forward_and_grads)(lhs, rhs))


@pytest.mark.parametrize(
  "matmul",
  [
    GroupedMatmul("megablox", interpret=True),
    GroupedMatmul("megablox", ODD_TILES, interpret=True),
    GroupedMatmul("padded_tiles"),
  ],
  ids=["megablox", "megablox_odd_tiles", "padded_tiles"],
)
def test_equals_ragged_dot_forward_and_gradients(matmul):
  data = _data()
  expected, _ = _forward_and_grads(GroupedMatmul("ragged_dot"), *data)
  for got, want in zip(expected, _numpy_reference(*data)):  # ragged_dot itself against the closed form
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  got, jaxpr = _forward_and_grads(matmul, *data)
  for name, g, e in zip(("forward", "input gradient", "weight gradient"), got, expected):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5, err_msg=name)  # NaN in a padding row fails this too
  assert not np.any(got[2][1]), "an empty group's weight gradient is 0"
  # The kernels ran (no silent fallback); the GPU path multiplies tiles, with no ragged_dot to fall back to dense.
  if matmul.kernel == "megablox":
    assert jaxpr.count("pallas_call") == 3  # gmm forward, gmm input gradient, tgmm weight gradient
  else:
    assert "pallas_call" not in jaxpr and "ragged_dot" not in jaxpr


def test_tiles_from_the_keys_the_fallbacks_and_the_shapes():
  matmul = GroupedMatmul("megablox", ((("wo", "fwd", "mlp_dim"), 256), (("wo", "dlhs", "batch_seq"), 64)))
  # wo: (m, mlp) x (E, mlp, embed). Unset tiles come from the shapes: the dim up to its cap, else a multiple of 128
  # dividing it; a tile larger than its dim is the dim.
  fwd, dlhs, drhs = matmul._tilings("wo", 4096, 1536, 7168)  # pylint: disable=protected-access
  assert fwd == (512, 256, 1024) and dlhs == (64, 1024, 768) and drhs == (512, 768, 1024)
  assert matmul._tilings("wo", 24, 16, 8)[0] == (24, 16, 8)  # pylint: disable=protected-access
  config = tiny_config("megablox=true", "tile_embed_dim=512", "wi_tile_fwd_embed_dim=256")
  tiles = dict(grouped_matmul.tile_keys(config))
  assert tiles[("wi", "fwd", "embed_dim")] == 256 and tiles[("wi", "dlhs", "embed_dim")] == 512
  assert tiles[("wo", "drhs", "mlp_dim")] == -1


def test_the_kernel_a_config_runs():
  on_cpu, off = tiny_config("megablox=true"), tiny_config("megablox=false")
  assert grouped_matmul.from_config(on_cpu).kernel == "ragged_dot"  # CPU devices: ragged_dot, said in one info line
  assert grouped_matmul.from_config(off).kernel == "ragged_dot"
  with grouped_matmul.interpreted():
    assert grouped_matmul.from_config(on_cpu) == GroupedMatmul("megablox", grouped_matmul.tile_keys(on_cpu), True)
    assert grouped_matmul.from_config(off).kernel == "ragged_dot"
  # The hardware the program compiles for (an AOT target's included).
  assert grouped_matmul.from_config(on_cpu.replace(hardware="tpu")).kernel == "megablox"
  assert grouped_matmul.from_config(on_cpu.replace(hardware="gpu")).kernel == "padded_tiles"
  assert grouped_matmul.from_config(off.replace(hardware="tpu")).kernel == "ragged_dot"
