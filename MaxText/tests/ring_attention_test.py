"""ring_attention on 8 forced CPU devices (fsdp 2 x context 4) against dot_product_attention on the whole
sequence in its original order: outputs and d query, d key, d value, for the plain and the load-balanced
orders, and grouped-query heads with packed segments, soft cap and sliding window. And memory: the compiled
forward and backward never hold an array of the full length.

One child process (this file run as a script) runs every case: the device count is fixed at JAX start-up.
"""

import functools
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from MaxText.layers.attentions import dot_product_attention
from MaxText.layers.ring_attention import ring_attention
from MaxText.tests.helpers import run_python

CONTEXT = 4
BATCH, LENGTH, HEAD_DIM = 4, 32, 8  # 2 rows per fsdp shard, chunks of 8 tokens per context device
CAPPED = {"logits_soft_cap": 30.0, "sliding_window": 5}
# name -> (load-balanced order, query heads, kv heads, packed segments, ring_attention options)
CASES = {
  "contiguous": (False, 2, 2, False, {}),
  "load_balanced": (True, 2, 2, False, {}),
  "gqa_packed_capped_window": (True, 4, 2, True, CAPPED),
  "latent_value_dim": (True, 2, 2, False, {}),  # values narrower than keys, as multi-head latent attention's
}
VALUE_DIM = {"latent_value_dim": 6}
OUTPUTS = ("out", "dquery", "dkey", "dvalue")
# Memory: 256 tokens, 64 per context device; no other dim is 256.
MEMORY_LENGTH, MEMORY_HEADS, MEMORY_HEAD_DIM = 256, 4, 16


def load_balanced_order(length: int, devices: int):
  """Original token indices in sharded order: device d holds chunks d and 2N-1-d of 2N."""
  chunks = np.arange(length).reshape(2 * devices, -1)
  return np.concatenate([chunks[[d, 2 * devices - 1 - d]].ravel() for d in range(devices)])


def packed_segments(batch: int, length: int):
  """Several documents per row, different per row, padding (0) at the end."""
  segments = np.zeros((batch, length), np.int32)
  for row in range(batch):
    ends = [3 + 2 * row, 11 + row, 20, length - 1 - row]
    start = 0
    for doc, end in enumerate(ends[:-1]):
      segments[row, start:end] = doc + 1
      start = end
    segments[row, start : ends[-1]] = len(ends)
  return segments


def _child(out_dir):
  """Runs every case on 8 devices; saves ring and reference outputs and gradients (<case>.npz), writes a report."""
  mesh = Mesh(np.array(jax.devices()).reshape(2, CONTEXT), ("fsdp", "context"))
  spec = P("fsdp", "context")

  def ring_fn(options):
    def attend(q, k, v, segments, index):
      return ring_attention(q, k, v, segments, index, axis_name="context", **options)

    return jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)

  def out_and_grads(attend, inputs, cotangent):
    out, vjp = jax.vjp(attend, *inputs)
    return out, *vjp(cotangent)

  report = {"device_count": jax.device_count()}
  for name, (balanced, num_q, num_kv, packed, options) in CASES.items():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (BATCH, LENGTH, num_q, HEAD_DIM)) / np.sqrt(HEAD_DIM)
    k = jax.random.normal(keys[1], (BATCH, LENGTH, num_kv, HEAD_DIM))
    v = jax.random.normal(keys[2], (BATCH, LENGTH, num_kv, VALUE_DIM.get(name, HEAD_DIM)))
    cotangent = jax.random.normal(keys[3], (*q.shape[:-1], v.shape[-1]))
    segments = packed_segments(BATCH, LENGTH) if packed else np.ones((BATCH, LENGTH), np.int32)
    order = load_balanced_order(LENGTH, CONTEXT) if balanced else np.arange(LENGTH)
    index = jnp.asarray(np.broadcast_to(order, (BATCH, LENGTH)), jnp.int32)

    def reference(q, k, v, segments=segments, options=options):
      return dot_product_attention(q, k, v, segments, **options)

    expected = out_and_grads(reference, (q, k, v), cotangent)
    ring = jax.jit(functools.partial(out_and_grads, ring_fn(options)))
    permuted = [x[:, order] for x in (q, k, v)]
    found = ring((*permuted, jnp.asarray(segments[:, order]), index), cotangent[:, order])
    unpermute = np.argsort(order)  # back to the original order
    found = [np.asarray(x)[:, unpermute] for x in found]
    arrays = {f"expected_{what}": np.asarray(x) for what, x in zip(OUTPUTS, expected)}
    arrays |= {f"found_{what}": x for what, x in zip(OUTPUTS, found)}
    np.savez(f"{out_dir}/{name}.npz", **arrays)

  # Memory: compile value_and_grad at a length where a gathered key/value would show.
  shape = (2, MEMORY_LENGTH, MEMORY_HEADS, MEMORY_HEAD_DIM)
  segments = jnp.ones(shape[:2], jnp.int32)
  index = jnp.broadcast_to(jnp.asarray(load_balanced_order(MEMORY_LENGTH, CONTEXT), jnp.int32), shape[:2])
  attend = ring_fn({})

  def loss(q, k, v, segments, index):
    return jnp.sum(attend(q, k, v, segments, index) * q)

  # Segments and indices as arguments: as constants the jitted program would hold them whole.
  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*[jnp.ones(shape)] * 3, segments, index).compile()
  hlo = compiled.as_text()
  dims = {tuple(int(d) for d in s.split(",")) for s in re.findall(r"\w+\[(\d+(?:,\d+)*)\]", hlo)}
  memory = compiled.memory_analysis()
  report["memory"] = {
    "full_length_shapes": sorted(s for s in dims if MEMORY_LENGTH in s),
    "largest_shape": max(dims, key=np.prod),
    "temp_bytes": memory.temp_size_in_bytes,
    "argument_bytes": memory.argument_size_in_bytes,
  }
  with open(f"{out_dir}/report.json", "w", encoding="utf-8") as f:
    json.dump(report, f)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  out_dir = tmp_path_factory.mktemp("ring")
  # LLVM optimisation level 0 halves the compile time; the HLO (and its shapes) are the same.
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0", "JAX_PLATFORMS": "cpu"}
  result = run_python(["-m", "MaxText.tests.ring_attention_test", str(out_dir)], env_extra=env)
  assert result.returncode == 0, result.stderr[-5000:]
  out = json.loads((out_dir / "report.json").read_text())
  assert out["device_count"] == 8
  out["arrays"] = {name: dict(np.load(out_dir / f"{name}.npz")) for name in CASES}
  return out


@pytest.mark.parametrize("name", CASES)
def test_output_and_gradients_match_dot_product_attention(report, name):
  arrays = report["arrays"][name]
  for what in OUTPUTS:
    np.testing.assert_allclose(arrays[f"found_{what}"], arrays[f"expected_{what}"], rtol=1e-5, atol=1e-5, err_msg=what)


def test_full_length_never_materialises(report):
  memory = report["memory"]
  print(memory)
  assert memory["full_length_shapes"] == []
  assert len(memory["largest_shape"]) == 5 and memory["largest_shape"][-2:] == [64, 64]  # one block's logits


if __name__ == "__main__":
  _child(sys.argv[1])
