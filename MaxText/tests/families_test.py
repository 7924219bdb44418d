"""Dense families and their shared-layer options against independent float64 NumPy references.

Each option (sliding window, soft caps, (1 + w) RMSNorm, LayerNorm, biases, q/k norm, Llama 3.1 RoPE
scaling, learned positions, scaled embedding, fused kernels, iota embedding) is checked against math written
here from the papers / reference implementations, and every family runs scanned and unrolled with the same
logits and takes a train step.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.checkpoints import layer_stacking
from MaxText.layers import attention_masks, attentions, block_parts, embeddings, linears, models, normalizations
from MaxText.runtime import mesh
from MaxText.tests.helpers import tiny_config
from MaxText.tests.tiny_models import FAMILIES
from MaxText.training import train_step, training_setup

BATCH, LENGTH = 2, 16
F64 = np.float64


# ----------------------------------------------------------------------------- float64 reference


def _np_rms_norm(x, scale, eps, plus_one=False):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * ((1 + scale) if plus_one else scale)


def _np_layer_norm(x, scale, bias, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * scale + bias


def _np_llama3_frequencies(head_dim, base, factor, low, high, original):
  """transformers' _compute_llama3_parameters, one frequency at a time, in float64."""
  out = []
  for i in range(0, head_dim, 2):
    freq = 1.0 / base ** (i / head_dim)
    wavelen = 2 * math.pi / freq
    if wavelen < original / high:
      out.append(freq)
    elif wavelen > original / low:
      out.append(freq / factor)
    else:
      smooth = (original / wavelen - low) / (high - low)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


def _np_frequencies(cfg, head_dim, local=False):
  """local: a Gemma 3 local layer's (its own base, never scaled); rope_linear_scaling_factor divides the others'."""
  if local:
    return 1.0 / cfg.local_rope_max_timescale ** (np.arange(0, head_dim, 2) / head_dim)
  if cfg.rope_scaling_factor > 0:
    return _np_llama3_frequencies(
      head_dim,
      cfg.rope_max_timescale,
      cfg.rope_scaling_factor,
      cfg.rope_scaling_low_freq_factor,
      cfg.rope_scaling_high_freq_factor,
      cfg.rope_scaling_original_max_position_embeddings,
    )
  return 1.0 / cfg.rope_max_timescale ** (np.arange(0, head_dim, 2) / head_dim) / cfg.rope_linear_scaling_factor


def _np_rope(x, positions, freqs):  # x: (T, N, D); transformers' rotate_half convention
  ang = positions[:, None, None] * freqs  # (T, 1, D/2)
  cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)
  half = x.shape[-1] // 2
  rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def _np_proj(p, x, name):
  y = np.einsum("te,ehd->thd", x, p[name]["kernel"])
  return y + p[name]["bias"] if "bias" in p[name] else y


def _np_attention(p, x, positions, segments, cfg, window, rope=True, qk_norm=False, plus_one=False, local=False):
  """One row: x (T, E) -> (T, E). plus_one: (1 + w) q/k norms (Gemma 3); local: a Gemma 3 local layer's RoPE."""
  q, k, v = _np_proj(p, x, "query"), _np_proj(p, x, "key"), _np_proj(p, x, "value")
  eps = cfg.normalization_layer_epsilon
  if qk_norm:
    norm = functools.partial(_np_rms_norm, eps=eps, plus_one=plus_one)
    q, k = norm(q, p["query_norm"]["scale"]), norm(k, p["key_norm"]["scale"])
  if rope:
    freqs = _np_frequencies(cfg, q.shape[-1], local)
    q, k = _np_rope(q, positions, freqs), _np_rope(k, positions, freqs)
  group = q.shape[1] // k.shape[1]
  k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
  logits = np.einsum("thd,shd->hts", q, k) / np.sqrt(cfg.query_pre_attn_scalar or cfg.head_dim)
  if cfg.attn_logits_soft_cap > 0:
    logits = cfg.attn_logits_soft_cap * np.tanh(logits / cfg.attn_logits_soft_cap)
  t = np.arange(len(x))
  allowed = (t[None, :] <= t[:, None]) & (segments[:, None] == segments[None, :])
  if window > 0:
    allowed &= t[:, None] - t[None, :] < window
  logits = np.where(allowed[None], logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("thd,hde->te", np.einsum("hts,shd->thd", probs, v), p["out"]["kernel"])
  return out + p["out"]["bias"] if "bias" in p["out"] else out


_NP_ACT = {
  "silu": lambda x: x / (1 + np.exp(-x)),
  "linear": lambda x: x,
  "gelu": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),  # gelu_pytorch_tanh
}


def _np_mlp(p, x, cfg):
  acts = cfg.mlp_activations
  names = ["wi"] if len(acts) == 1 else [f"wi_{i}" for i in range(len(acts))]

  def dense(name, h):
    return h @ p[name]["kernel"] + (p[name]["bias"] if "bias" in p[name] else 0)

  return dense("wo", np.prod([_NP_ACT[a](dense(n, x)) for a, n in zip(acts, names)], axis=0))


def _np_layer(family, lp, x, pos, seg, cfg, window, local=False):
  """One decoder layer of a family, written as its reference implementation (transformers) reads.

  local: a Gemma 3 local layer (its window is `window`)."""
  eps = cfg.normalization_layer_epsilon
  if family in ("llama2", "mistral", "qwen3"):
    norm = functools.partial(_np_rms_norm, eps=eps)
    h = x + _np_attention(
      lp["self_attention"],
      norm(x, lp["pre_self_attention_layer_norm"]["scale"]),
      pos,
      seg,
      cfg,
      window,
      qk_norm=family == "qwen3",
    )
    return h + _np_mlp(lp["mlp"], norm(h, lp["post_self_attention_layer_norm"]["scale"]), cfg)
  if family in ("gemma", "gemma2", "gemma3"):
    norm = functools.partial(_np_rms_norm, eps=eps, plus_one=True)
    gemma3 = family == "gemma3"
    normed = norm(x, lp["pre_self_attention_norm"]["scale"])
    attn = _np_attention(lp["self_attention"], normed, pos, seg, cfg, window, True, gemma3, gemma3, local)
    if cfg.use_post_attn_norm:
      attn = norm(attn, lp["post_self_attention_norm"]["scale"])
    h = x + attn
    mlp = _np_mlp(lp["mlp"], norm(h, lp["pre_ffw_norm"]["scale"]), cfg)
    if cfg.use_post_ffw_norm:
      mlp = norm(mlp, lp["post_ffw_norm"]["scale"])
    return h + mlp
  assert family == "gpt3"
  ln = functools.partial(_np_layer_norm, eps=eps)
  n1 = lp["pre_self_attention_norm"]
  h = x + _np_attention(lp["self_attention"], ln(x, n1["scale"], n1["bias"]), pos, seg, cfg, window, rope=False)
  n2 = lp["pre_mlp_norm"]
  return h + _np_mlp(lp["mlp"], ln(h, n2["scale"], n2["bias"]), cfg)


def _np_forward(family, params, tokens, positions, segments, cfg):
  """Logits (B, T, V) from unrolled params (decoder/layers_i; a Gemma 2 block is a local and a global layer)."""
  params = jax.tree.map(lambda a: np.asarray(a, F64), params)
  dec, table = params["decoder"], params["token_embedder"]["embedding"]
  out = []
  for row in range(tokens.shape[0]):
    pos, seg = positions[row], segments[row]
    x = table[tokens[row]]
    if family in ("gemma", "gemma2", "gemma3"):
      x = x * np.sqrt(cfg.emb_dim)
    if cfg.trainable_position_size > 0:
      x = x + dec["position_embedder"]["embedding"][pos]
    for i in range(models.num_blocks(cfg)):
      lp = dec[f"layers_{i}"]
      if family == "gemma2":
        x = _np_layer(family, lp["local"], x, pos, seg, cfg, cfg.sliding_window_size)
        x = _np_layer(family, lp["global"], x, pos, seg, cfg, 0)
      elif family == "gemma3":  # layers 5, 11, ... are global
        local = (i + 1) % 6 != 0
        x = _np_layer(family, lp, x, pos, seg, cfg, cfg.sliding_window_size if local else 0, local)
      else:
        x = _np_layer(family, lp, x, pos, seg, cfg, cfg.sliding_window_size)
    fn = dec["decoder_norm"]
    if family == "gpt3":
      x = _np_layer_norm(x, fn["scale"], fn["bias"], cfg.normalization_layer_epsilon)
    else:
      x = _np_rms_norm(x, fn["scale"], cfg.normalization_layer_epsilon, plus_one=family in ("gemma", "gemma2", "gemma3"))
    if cfg.logits_via_embedding:
      logits = x @ table.T / (np.sqrt(cfg.emb_dim) if cfg.normalize_embedding_logits else 1)
    else:
      logits = x @ dec["logits_dense"]["kernel"]
    if cfg.final_logits_soft_cap > 0:
      logits = cfg.final_logits_soft_cap * np.tanh(logits / cfg.final_logits_soft_cap)
    out.append(logits)
  return np.stack(out)


# ----------------------------------------------------------------------------- helpers


def _inputs(vocab=4096, seed=1):
  """Two rows; the second packs two segments with positions restarting at 0."""
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (BATCH, LENGTH), 0, vocab)
  positions = np.stack([np.arange(LENGTH), np.concatenate([np.arange(7), np.arange(LENGTH - 7)])])
  segments = np.stack([np.ones(LENGTH, np.int32), np.repeat([1, 2], [7, LENGTH - 7]).astype(np.int32)])
  return tokens, jnp.asarray(positions), jnp.asarray(segments)


def _randomize(params, seed=7, scale=0.1):
  """Random values for every parameter (biases and norm scales included, which init to 0 or 1)."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(
    tree, [leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype) for leaf, k in zip(leaves, keys)]
  )


def _unrolled(params, config):
  dec = layer_stacking.unstack_layers(params["decoder"], models.num_blocks(config), config.param_scan_axis)
  return dict(params, decoder=dec)


def _family_config(family, *extra):
  return tiny_config(f"decoder_block={family}", *FAMILIES[family], "scan_layers=false", *extra)


@functools.cache
def _family_params(family):
  config = _family_config(family)
  tokens, positions, _ = _inputs()
  params = nn.unbox(jax.jit(models.Transformer(config).init)(jax.random.PRNGKey(0), tokens, positions))["params"]
  return _randomize(params)


# ----------------------------------------------------------------------------- option-level tests


@pytest.mark.parametrize("window", [0, 1, 3])
def test_attention_mask_matches_loops(window):
  segments = np.array([[1, 1, 1, 1, 2, 2, 2, 0]])
  mask = np.asarray(attention_masks.attention_mask(jnp.asarray(segments), window))[0, 0, 0]
  for t in range(8):
    for s in range(8):
      expected = s <= t and segments[0, t] == segments[0, s] and (window == 0 or t - s < window)
      assert mask[t, s] == expected, (t, s)


def test_llama3_rope_frequencies_match_transformers_formula():
  scaling = embeddings.Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
  )
  got = embeddings.rope_inverse_frequencies(128, 1, 500_000, scaling)  # Llama 3.1 8B/70B/405B
  expected = _np_llama3_frequencies(128, 500_000, 8.0, 1.0, 4.0, 8192)
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  plain = embeddings.rope_inverse_frequencies(128, 1, 500_000)
  assert got[0] == plain[0] and got[-1] == pytest.approx(plain[-1] / 8, rel=1e-6)  # high kept, low divided
  assert 0 < np.sum((got != plain) & (got != plain / 8))  # and a smoothed band in between


@pytest.mark.parametrize("plus_one", [False, True])
def test_rms_norm_matches_reference(plus_one):
  x = np.random.default_rng(0).normal(size=(2, 3, 16))
  scale = np.random.default_rng(1).normal(size=16)
  norm = normalizations.RMSNorm(epsilon=1e-6, dtype="float32", weight_dtype="float32", scale_plus_one=plus_one)
  got = norm.apply({"params": {"scale": jnp.asarray(scale, jnp.float32)}}, jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(got, _np_rms_norm(x, scale, 1e-6, plus_one), rtol=1e-5, atol=1e-5)
  init = nn.unbox(norm.init(jax.random.PRNGKey(0), jnp.ones((1, 16))))["params"]["scale"]
  assert float(init[0]) == (0.0 if plus_one else 1.0)  # the stored weight is the checkpoint's, not 1 + w


def test_layer_norm_matches_reference():
  rng = np.random.default_rng(0)
  x, scale, bias = rng.normal(size=(2, 3, 16)) + 2.0, rng.normal(size=16), rng.normal(size=16)
  got = normalizations.LayerNorm(epsilon=1e-5, dtype="float32", weight_dtype="float32").apply(
    {"params": {"scale": jnp.asarray(scale, jnp.float32), "bias": jnp.asarray(bias, jnp.float32)}},
    jnp.asarray(x, jnp.float32),
  )
  np.testing.assert_allclose(got, _np_layer_norm(x, scale, bias, 1e-5), rtol=1e-5, atol=1e-5)


# (config args, family options of block_parts.self_attention, reference options)
_ATTENTION_CASES = {
  "qk_norm": ([], dict(use_qk_norm=True), dict(qk_norm=True)),
  "window_softcap_scalar": (["sliding_window_size=4", "attn_logits_soft_cap=2.0", "query_pre_attn_scalar=12"], {}, {}),
  "bias_no_rope": (["base_num_kv_heads=4"], dict(use_rope=False, use_bias=True), dict(rope=False)),
  "llama3_rope": (FAMILIES["llama2"], {}, {}),
}


@pytest.mark.parametrize("case", sorted(_ATTENTION_CASES))
def test_attention_options_match_reference(case):
  args, options, ref_options = _ATTENTION_CASES[case]
  cfg = tiny_config("attention=dot_product", *args)
  attention = block_parts.self_attention(cfg, linears.PLAIN, **options)
  x = jax.random.normal(jax.random.PRNGKey(0), (BATCH, LENGTH, cfg.emb_dim))
  _, positions, segments = _inputs()
  params = _randomize(nn.unbox(attention.init(jax.random.PRNGKey(1), x, positions, segments, True))["params"])
  got = jax.jit(attention.apply, static_argnums=4)({"params": params}, x, positions, segments, True)
  np_params = jax.tree.map(lambda a: np.asarray(a, F64), params)
  for row in range(BATCH):
    expected = _np_attention(
      np_params,
      np.asarray(x[row], F64),
      np.asarray(positions[row]),
      np.asarray(segments[row]),
      cfg,
      cfg.sliding_window_size,
      **ref_options,
    )
    np.testing.assert_allclose(got[row], expected, rtol=1e-5, atol=1e-5)


def test_flash_sliding_window_and_soft_cap_match_dot_product():
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (1, 128, 2, 64)) / 4
  k, v = jax.random.normal(ks[1], (1, 128, 1, 64)), jax.random.normal(ks[2], (1, 128, 1, 64))
  seg = jnp.concatenate([jnp.ones((1, 50), jnp.int32), 2 * jnp.ones((1, 78), jnp.int32)], axis=1)
  options = dict(sliding_window=20, logits_soft_cap=3.0)
  from MaxText.layers.flash_attention import flash_attention  # pylint: disable=import-outside-toplevel

  got = flash_attention(q, k, v, seg, interpret=True, **options)
  np.testing.assert_allclose(got, attentions.dot_product_attention(q, k, v, seg, **options), atol=2e-6)


@pytest.mark.parametrize("kernel", ["dot_product", "flash"])
def test_a_traced_layer_kind_picks_the_local_or_global_attention(kernel):
  """A scanned Gemma 3 layer knows its kind as a traced bool: jax.lax.cond must pick what a known kind computes."""
  config = tiny_config("base_emb_dim=64", "head_dim=64", "max_target_length=128", "rope_max_timescale=1000000")
  local = attentions.LocalAttention(sliding_window=20, rope_max_timescale=100)
  # flash on CPU devices runs in the Pallas interpreter (the config itself refuses flash on a CPU)
  attention = block_parts.self_attention(config, linears.Gemm(), attention_kernel=kernel, sliding_window=0, local=local)
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 128, 64))
  positions, segments = jnp.arange(128)[None], jnp.ones((1, 128), jnp.int32)
  params = attention.init(jax.random.PRNGKey(1), x, positions, segments, True)
  traced = jax.jit(lambda kind: attention.apply(params, x, positions, segments, True, is_local=kind))
  for is_local in (True, False):
    known = attention.apply(params, x, positions, segments, True, is_local=is_local)
    np.testing.assert_allclose(traced(jnp.asarray(is_local)), known, atol=2e-6)
  assert not np.allclose(traced(jnp.asarray(True)), traced(jnp.asarray(False)), atol=1e-3)


# ----------------------------------------------------------------------------- families


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_logits_match_float64_reference(family):
  config = _family_config(family)
  tokens, positions, segments = _inputs()
  params = _family_params(family)
  logits = jax.jit(models.Transformer(config).apply)({"params": params}, tokens, positions, segments)
  expected = _np_forward(family, params, np.asarray(tokens), np.asarray(positions), np.asarray(segments), config)
  np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_scanned_equals_unrolled(family):
  config = tiny_config(f"decoder_block={family}", *FAMILIES[family], "scan_layers=true")
  tokens, positions, segments = _inputs()
  model = models.Transformer(config)
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), tokens, positions))["params"]
  scanned = jax.jit(model.apply)({"params": params}, tokens, positions, segments)
  unrolled = jax.jit(models.Transformer(_family_config(family)).apply)(
    {"params": _unrolled(params, config)}, tokens, positions, segments
  )
  np.testing.assert_allclose(np.asarray(scanned), np.asarray(unrolled), rtol=1e-5, atol=1e-5)


# One train step through the real builders; gemma2 (layer pairs, every option) in the quick suite, the rest slow.
@pytest.mark.parametrize(
  "family", [f if f == "gemma2" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)]
)
def test_family_train_step(family):
  config = tiny_config(f"decoder_block={family}", *FAMILIES[family], "scan_layers=true")
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  state = setup.init_state(config, device_mesh)
  tokens, positions, segments = _inputs()
  batch = {
    "inputs": tokens,
    "inputs_position": positions,
    "inputs_segmentation": segments,
    "targets": jnp.roll(tokens, -1, axis=1),
    "targets_position": positions,
    "targets_segmentation": segments,
  }
  new_state, metrics = jax.jit(functools.partial(train_step.train_step, setup.model, config, setup.features))(state, batch)
  assert np.isfinite(float(metrics["learning/loss"]))
  assert float(metrics["learning/raw_grad_norm"]) > 0
  assert int(new_state.step) == 1


def test_gemma2_scans_pairs_of_local_and_global_layers():
  config = _family_config("gemma2")
  assert (config.num_decoder_layers, models.num_blocks(config)) == (4, 2)
  layer = _family_params("gemma2")["decoder"]["layers_0"]
  assert set(layer) == {"local", "global"}
  assert set(layer["local"]) == {
    "pre_self_attention_norm",
    "self_attention",
    "post_self_attention_norm",
    "pre_ffw_norm",
    "mlp",
    "post_ffw_norm",
  }


# ----------------------------------------------------------------------------- fused kernels and iota embedding


def test_fused_qkv_fused_mlp_and_iota_embed_give_the_same_logits():
  dims = ("base_num_kv_heads=4", "scan_layers=false")
  config = tiny_config(*dims)
  tokens, positions, segments = _inputs()
  params = _randomize(nn.unbox(models.Transformer(config).init(jax.random.PRNGKey(0), tokens, positions))["params"])
  expected = models.Transformer(config).apply({"params": params}, tokens, positions, segments)

  fused = jax.tree.map(lambda a: a, params)
  for i in range(config.num_decoder_layers):
    layer = dict(fused["decoder"][f"layers_{i}"])
    att, mlp = dict(layer["self_attention"]), dict(layer["mlp"])
    qkv = [att.pop(n)["kernel"] for n in ("query", "key", "value")]
    att["qkv_proj"] = {"kernel": jnp.stack(qkv, axis=1)}  # [E, 3, N, D]
    mlp["wi"] = {"kernel": jnp.stack([mlp.pop("wi_0")["kernel"], mlp.pop("wi_1")["kernel"]], axis=1)}  # [E, 2, M]
    layer.update(self_attention=att, mlp=mlp)
    fused["decoder"] = dict(fused["decoder"], **{f"layers_{i}": layer})
  fused_config = tiny_config(*dims, "fused_qkv=true", "fused_mlp=true", "use_iota_embed=true")
  got = models.Transformer(fused_config).apply({"params": fused}, tokens, positions, segments)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
  # The fused model initialises exactly this tree.
  init = jax.eval_shape(models.Transformer(fused_config).init, jax.random.PRNGKey(0), tokens, positions)
  shapes = jax.tree.map(lambda a: a.shape, nn.unbox(init)["params"])
  assert shapes == jax.tree.map(lambda a: a.shape, fused)
