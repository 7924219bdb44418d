"""cudnn_flash_jax and cudnn_flash_te against dot_product.

Everywhere: the cuDNN call with implementation="xla" (the same arguments: causal flag, segment mask or row
lengths, window, scale, grouped heads; XLA's reference instead of cuDNN) equals dot_product, so the masking
logic is tested on CPU. Where JAX reports a GPU: the real cuDNN kernel (bfloat16) against dot_product, forward
and gradients; TransformerEngine's kernel too where its JAX package imports. Elsewhere those skip.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.layers.attentions import dot_product_attention
from MaxText.layers.gpu_attention import cudnn_attention, transformer_engine_attention

B, T, NQ, NKV, D = 2, 128, 8, 2, 64
ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="cuDNN kernels need a GPU (JAX reports none)")
needs_te = pytest.mark.skipif(
  not ON_GPU or importlib.util.find_spec("transformer_engine") is None,
  reason="needs a GPU and TransformerEngine's JAX package (bash setup.sh DEVICE=gpu TE=1)",
)


def _qkv(dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (B, T, NQ, D)) / 8
  k = jax.random.normal(ks[1], (B, T, NKV, D))
  v = jax.random.normal(ks[2], (B, T, NKV, D))
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _packed():
  """Row 0: three documents; row 1: two documents, then padding."""
  row0 = np.repeat([1, 2, 3], [40, 50, T - 90])
  row1 = np.repeat([1, 2, 0], [70, 30, T - 100])
  return jnp.asarray(np.stack([row0, row1]), jnp.int32)


def _padded():
  """One document per row, padded at the end (a row of padding only included)."""
  lengths = [100, T]
  return jnp.asarray([[1] * n + [0] * (T - n) for n in lengths], jnp.int32)


def _grads(fn, q, k, v, weight):
  """d/d(q, k, v) of sum(weight * fn(q, k, v)): weight 0 on the rows a loss ignores (padding)."""
  return jax.grad(lambda *a: (fn(*a).astype(jnp.float32) * weight).sum(), argnums=(0, 1, 2))(q, k, v)


def _compare(kernel, segment_ids, q, k, v, atol, sliding_window=0):
  """kernel against dot_product on the tokens that are not padding: outputs and gradients."""
  reference = functools.partial(dot_product_attention, segment_ids=segment_ids, sliding_window=sliding_window)
  under_test = functools.partial(kernel, segment_ids=segment_ids, sliding_window=sliding_window)
  weight = (segment_ids != 0)[:, :, None, None].astype(jnp.float32)
  out, expected = under_test(q, k, v), reference(q, k, v)
  np.testing.assert_allclose(np.asarray(out * weight, np.float32), np.asarray(expected * weight, np.float32), atol=atol)
  for got, want in zip(_grads(under_test, q, k, v, weight), _grads(reference, q, k, v, weight)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol)


@pytest.mark.parametrize("sliding_window", [0, 17])
def test_packed_segment_mask_matches_dot_product(sliding_window):
  xla = functools.partial(cudnn_attention, segments="mask", implementation="xla")
  _compare(xla, _packed(), *_qkv(), atol=1e-5, sliding_window=sliding_window)


@pytest.mark.parametrize("sliding_window", [0, 17])
def test_row_lengths_match_dot_product_for_unpacked_rows(sliding_window):
  xla = functools.partial(cudnn_attention, segments="lengths", implementation="xla")
  _compare(xla, _padded(), *_qkv(), atol=1e-5, sliding_window=sliding_window)


@pytest.mark.parametrize("sliding_window", [0, 17])
def test_causal_only_matches_dot_product_for_whole_rows(sliding_window):
  xla = functools.partial(cudnn_attention, segments="causal", implementation="xla")
  _compare(xla, jnp.ones((B, T), jnp.int32), *_qkv(), atol=1e-5, sliding_window=sliding_window)


def test_row_lengths_would_be_wrong_for_packed_rows():
  """The reason the config picks "mask" for packed data: lengths alone let documents see each other."""
  seg = _packed()
  q, k, v = _qkv()
  out = cudnn_attention(q, k, v, seg, segments="lengths", implementation="xla")
  assert not np.allclose(out[0], dot_product_attention(q, k, v, seg)[0], atol=1e-3)


def test_a_row_of_padding_only_stays_finite():
  seg = jnp.zeros((B, T), jnp.int32)
  for segments in ("mask", "lengths"):
    out = cudnn_attention(*_qkv(), seg, segments=segments, implementation="xla")
    assert np.isfinite(np.asarray(out)).all(), segments


def test_soft_cap_is_refused():
  with pytest.raises(ValueError, match="soft cap"):
    cudnn_attention(*_qkv(), _packed(), logits_soft_cap=50.0, implementation="xla")


# bfloat16 inputs: cuDNN and the float32-softmax dot_product differ by bfloat16 rounding.
_GPU_ATOL = 2e-2


@needs_gpu
@pytest.mark.parametrize(
  "segments, segment_ids", [("mask", _packed), ("lengths", _padded), ("causal", lambda: jnp.ones((B, T), jnp.int32))]
)
def test_cudnn_matches_dot_product_on_gpu(segments, segment_ids):
  cudnn = jax.jit(functools.partial(cudnn_attention, segments=segments), static_argnames=("sliding_window",))
  _compare(cudnn, segment_ids(), *_qkv(jnp.bfloat16), atol=_GPU_ATOL)


@needs_gpu
def test_cudnn_sliding_window_on_gpu():
  cudnn = functools.partial(cudnn_attention, segments="mask")
  _compare(cudnn, _packed(), *_qkv(jnp.bfloat16), atol=_GPU_ATOL, sliding_window=17)


@needs_te
def test_transformer_engine_matches_dot_product_on_gpu():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  class Wrapper(nn.Module):  # TE's layer is a Flax module: it runs inside one
    @nn.compact
    def __call__(self, q, k, v, segment_ids, sliding_window=0):
      return transformer_engine_attention(q, k, v, segment_ids, sliding_window=sliding_window)

  q, k, v = _qkv(jnp.bfloat16)
  seg = _padded()
  variables = Wrapper().init(jax.random.PRNGKey(0), q, k, v, seg)

  def te(q, k, v, segment_ids, sliding_window=0):
    return Wrapper().apply(variables, q, k, v, segment_ids, sliding_window)

  _compare(te, seg, q, k, v, atol=_GPU_ATOL)


def _attention_layer_output(kernel: str, segment_ids, dtype=jnp.float32):
  """The Attention layer (projections, RoPE, the kernel, out) with attention_kernel=kernel, on fixed inputs."""
  from MaxText.layers.attentions import Attention  # pylint: disable=import-outside-toplevel
  from MaxText.layers.linears import PLAIN  # pylint: disable=import-outside-toplevel

  layer = Attention(
    NQ,
    NKV,
    D,
    attention_kernel=kernel,
    attention_segments="mask",
    rope_min_timescale=1,
    rope_max_timescale=10_000,
    rope_scaling=None,
    query_scale=D**-0.5,
    sliding_window=0,
    logits_soft_cap=0.0,
    norm_epsilon=1e-6,
    fused_qkv=False,
    cache_length=0,
    quantize_kvcache=False,
    kv_quant_axis="heads_and_dkv",
    gemm=PLAIN,
    dtype=dtype,
    weight_dtype="float32",
  )
  x = jax.random.normal(jax.random.PRNGKey(1), (B, T, 32), dtype)
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  variables = layer.init(jax.random.PRNGKey(2), x, positions, segment_ids, True)  # the same params for every kernel
  return layer.apply(variables, x, positions, segment_ids, True)


def test_attention_layer_runs_the_cudnn_call_with_its_segments(monkeypatch):
  """attention=cudnn_flash_jax in the layer: the cuDNN call (through XLA here) with the packed-segment mask."""
  from MaxText.layers import attentions  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(attentions, "cudnn_attention", functools.partial(cudnn_attention, implementation="xla"))
  seg = _packed()
  weight = (seg != 0)[:, :, None]
  got, want = _attention_layer_output("cudnn_flash_jax", seg), _attention_layer_output("dot_product", seg)
  np.testing.assert_allclose(got * weight, want * weight, atol=1e-5)


@needs_gpu
def test_attention_layer_with_cudnn_matches_dot_product_on_gpu():
  seg = _packed()
  weight = (seg != 0)[:, :, None]
  got = _attention_layer_output("cudnn_flash_jax", seg, jnp.bfloat16).astype(jnp.float32)
  want = _attention_layer_output("dot_product", seg, jnp.bfloat16).astype(jnp.float32)
  np.testing.assert_allclose(got * weight, want * weight, atol=5e-2)
