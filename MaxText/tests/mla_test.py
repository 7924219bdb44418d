"""Multi-head Latent Attention (layers/mla.py) against transformers' DeepseekV3Attention, packed segments, the
latent KV cache of decoding, and the flash kernel against dot_product."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.layers import linears, mla

E, N, Q_LORA, KV_LORA, NOPE, ROPE, V = 32, 4, 16, 8, 8, 4, 6  # embed, heads, ranks, head dims
B, T = 2, 8
THETA = 10000.0
# DeepSeek-V3's YaRN at a tiny scale (its mscale == mscale_all_dim, so RoPE's attention_factor is 1).
YARN = dict(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
# mscale != mscale_all_dim: cos and sin scaled too; with a rope dim of 8 and 4096 original positions the ramp between
# interpolated and kept frequencies has an interior point.
YARN_RAMP = dict(
  factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707
)

# Flax param -> (Hugging Face DeepseekV3Attention tensor, how many leading axes of the Flax kernel are its inputs).
# A kernel is the HF Linear weight [out, in] transposed, its input and output axes split out: wq_b/query/wkv_b's
# outputs (heads, head dim), out's inputs (heads, v_head_dim). Nothing is permuted: each query head's dims are
# [nope, rope], wkv_a's outputs [latent, k_pe], wkv_b's per head [k_nope, value], the RoPE dims in HF's order
# (interleaved pairs). None: a norm's scale, the HF weight as it is. The checkpoint conversion inverts this table.
HF_NAMES = {
  ("wq_a", "kernel"): ("q_a_proj.weight", 1),
  ("q_norm", "scale"): ("q_a_layernorm.weight", None),
  ("wq_b", "kernel"): ("q_b_proj.weight", 1),
  ("query", "kernel"): ("q_proj.weight", 1),
  ("wkv_a", "kernel"): ("kv_a_proj_with_mqa.weight", 1),
  ("kv_norm", "scale"): ("kv_a_layernorm.weight", None),
  ("wkv_b", "kernel"): ("kv_b_proj.weight", 1),
  ("out", "kernel"): ("o_proj.weight", 2),
}


def hf_state_dict(params) -> dict[str, np.ndarray]:
  """MLA params -> the state dict of transformers' DeepseekV3Attention, by HF_NAMES."""
  state = {}
  for (module, leaf), (hf_name, num_in) in HF_NAMES.items():
    if module not in params:  # wq_a, q_norm, wq_b or query, as q_lora_rank says
      continue
    value = np.asarray(params[module][leaf], np.float32)
    if num_in is not None:
      value = value.reshape(math.prod(value.shape[:num_in]), -1).T  # [*in, *out] -> [out, in]
    state[hf_name] = value
  assert len(state) == sum(len(p) for p in params.values()), "an MLA param without an HF tensor"
  return state


def _mla(q_lora_rank=Q_LORA, yarn=None, rope=ROPE, kernel="dot_product", interleave=True, cache_length=16):
  return mla.MLA(
    num_heads=N,
    q_lora_rank=q_lora_rank,
    kv_lora_rank=KV_LORA,
    qk_nope_head_dim=NOPE,
    qk_rope_head_dim=rope,
    v_head_dim=V,
    rope_max_timescale=THETA,
    rope_scaling=mla.yarn_rope_scaling(**yarn) if yarn else None,
    norm_epsilon=1e-6,
    attention_kernel=kernel,
    cache_length=cache_length,
    gemm=linears.PLAIN,
    dtype="float32",
    weight_dtype="float32",
    rope_interleave=interleave,
  )


def _inputs(batch=B, length=T, seed=0):
  x = jax.random.normal(jax.random.PRNGKey(seed), (batch, length, E))
  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
  return x, positions, jnp.ones((batch, length), jnp.int32)


def _forward(module):
  """module's full-sequence forward, jitted (one compilation instead of one per operation)."""
  return jax.jit(lambda params, x, positions, segment_ids: module.apply({"params": params}, x, positions, segment_ids, True))


def _params(module, x, positions, segment_ids):
  init = jax.jit(lambda key: module.init(key, x, positions, segment_ids, True))
  params = nn.unbox(init(jax.random.PRNGKey(1)))["params"]
  for i, norm in enumerate(n for n in ("q_norm", "kv_norm") if n in params):  # scales away from their init (ones)
    scale = params[norm]["scale"]
    params[norm]["scale"] = scale + 0.3 * jax.random.normal(jax.random.PRNGKey(10 + i), scale.shape)
  return params


def _hf_config(q_lora_rank, yarn, rope, interleave):
  from transformers import DeepseekV3Config  # noqa: PLC0415  # torch and transformers only for these tests

  rope_parameters = (
    {"rope_type": "yarn", "rope_theta": THETA, **yarn} if yarn else {"rope_type": "default", "rope_theta": THETA}
  )
  config = DeepseekV3Config(
    hidden_size=E,
    num_attention_heads=N,
    num_key_value_heads=N,
    q_lora_rank=q_lora_rank or None,
    kv_lora_rank=KV_LORA,
    qk_nope_head_dim=NOPE,
    qk_rope_head_dim=rope,
    v_head_dim=V,
    rope_parameters=rope_parameters,
    rope_interleave=interleave,
    max_position_embeddings=64,
  )
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  return config


def _hf_attention(params, x, q_lora_rank, yarn, rope, interleave):
  """transformers' DeepseekV3Attention on x with params' weights: causal, position_ids 0..T-1."""
  torch = pytest.importorskip("torch")
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek  # noqa: PLC0415

  config = _hf_config(q_lora_rank, yarn, rope, interleave)
  attention = deepseek.DeepseekV3Attention(config, layer_idx=0).eval()
  attention.load_state_dict({k: torch.tensor(v) for k, v in hf_state_dict(params).items()}, strict=True)
  hidden = torch.tensor(np.asarray(x))
  batch, length = hidden.shape[:2]
  position_ids = torch.arange(length)[None].expand(batch, length)
  cos_sin = deepseek.DeepseekV3RotaryEmbedding(config)(hidden, position_ids)
  causal = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None]
  with torch.no_grad():
    out, _ = attention(hidden, cos_sin, causal)
  return out.numpy()


@pytest.mark.parametrize(
  "q_lora_rank, yarn, rope, interleave",
  [
    (Q_LORA, None, ROPE, True),
    (0, None, ROPE, True),  # DeepSeek-V2-Lite: `query` projects directly
    (Q_LORA, YARN, ROPE, True),
    (0, YARN_RAMP, 8, True),
    (Q_LORA, YARN, ROPE, False),  # rope_interleave=False: rotate_half on the dims as they are
  ],
  ids=["q_lora", "direct_query", "yarn", "yarn_attention_factor", "not_interleaved"],
)
def test_matches_transformers_deepseek_v3_attention(q_lora_rank, yarn, rope, interleave):
  module = _mla(q_lora_rank, yarn, rope, interleave=interleave)
  x, positions, segment_ids = _inputs()
  params = _params(module, x, positions, segment_ids)
  got = _forward(module)(params, x, positions, segment_ids)
  want = _hf_attention(params, x, q_lora_rank, yarn, rope, interleave)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("yarn, rope", [(YARN, ROPE), (YARN_RAMP, 8), (YARN_RAMP, 64)])
def test_yarn_frequencies_and_scales_match_transformers(yarn, rope):
  pytest.importorskip("torch")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek  # noqa: PLC0415

  config = _hf_config(Q_LORA, dict(yarn), rope, True)
  inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
  scaling = mla.yarn_rope_scaling(**yarn)
  np.testing.assert_allclose(mla.rope_frequencies(rope, THETA, scaling), inv_freq.numpy(), rtol=1e-6)
  assert scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)
  want_scale = deepseek.DeepseekV3Attention(config, layer_idx=0).scaling
  assert _mla(yarn=yarn, rope=rope).query_scale == pytest.approx(want_scale, rel=1e-12)


def test_packed_segments_match_each_segment_alone():
  module = _mla(yarn=YARN)
  first, second = 5, 7
  x, _, _ = _inputs(batch=1, length=first + second)
  positions = jnp.concatenate([jnp.arange(first), jnp.arange(second)])[None]
  segment_ids = jnp.concatenate([jnp.ones(first, jnp.int32), 2 * jnp.ones(second, jnp.int32)])[None]
  params = _params(module, x, positions, segment_ids)
  forward = _forward(module)
  packed = forward(params, x, positions, segment_ids)
  for part in (slice(0, first), slice(first, None)):
    alone_x, alone_positions, alone_segments = x[:, part], positions[:, part], jnp.ones_like(segment_ids[:, part])
    alone = forward(params, alone_x, alone_positions, alone_segments)
    np.testing.assert_allclose(packed[:, part], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank, yarn", [(Q_LORA, None), (0, YARN)])
def test_latent_cache_prefill_and_decode_match_the_full_forward(q_lora_rank, yarn):
  cache_length, prompt = 12, 3
  module = _mla(q_lora_rank, yarn, cache_length=cache_length)
  x, positions, segment_ids = _inputs()
  params = _params(module, x, positions, segment_ids)
  full = _forward(module)(params, x, positions, segment_ids)

  step = jax.jit(lambda cache, x, p, s: module.apply({"params": params, **cache}, x, p, s, True, mutable=["cache"]))
  out, cache = step({}, x[:, :prompt], positions[:, :prompt], segment_ids[:, :prompt])
  outs = [out]
  for t in range(prompt, T):
    out, cache = step(cache, x[:, t : t + 1], positions[:, t : t + 1], segment_ids[:, t : t + 1])
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)

  # The cache holds the latent and the shared RoPE key, nothing per head.
  shapes = jax.tree.map(jnp.shape, nn.unbox(cache["cache"]))
  assert shapes == {"cached_kv_latent": (B, cache_length, KV_LORA), "cached_k_rope": (B, cache_length, ROPE)}


def test_flash_matches_dot_product_forward_and_backward():
  """The splash kernel (Pallas interpreter on CPU) with MLA's query/key head dim (12) != value head dim (6)."""
  x, positions, segment_ids = _inputs(batch=1, length=128)
  segment_ids = segment_ids.at[:, 50:].set(2)
  positions = positions.at[:, 50:].add(-50)
  dot, flash = _mla(yarn=YARN), _mla(yarn=YARN, kernel="flash")
  params = _params(dot, x, positions, segment_ids)

  def value_and_grad(module):
    loss = lambda params: (module.apply({"params": params}, x, positions, segment_ids, True) ** 2).sum()  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(params)

  (loss_flash, grads_flash), (loss_dot, grads_dot) = value_and_grad(flash), value_and_grad(dot)
  np.testing.assert_allclose(loss_flash, loss_dot, rtol=1e-5)
  np.testing.assert_allclose(
    _forward(flash)(params, x, positions, segment_ids),
    _forward(dot)(params, x, positions, segment_ids),
    rtol=1e-5,
    atol=1e-5,
  )
  for a, b in zip(jax.tree.leaves(grads_flash), jax.tree.leaves(grads_dot)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_an_unsupported_kernel_is_refused_at_construction():
  with pytest.raises(ValueError, match="cudnn_flash_te.*value head dim"):
    _mla(kernel="cudnn_flash_te")
