"""An independent float64 NumPy forward pass of the decoder, written from the math, for numerics tests."""

import numpy as np

_ACT = {"silu": lambda x: x / (1 + np.exp(-x)), "linear": lambda x: x, "relu": lambda x: np.maximum(x, 0)}


def _rms_norm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, min_ts, max_ts):  # x: (T, N, D), positions: (T,)
  d = x.shape[-1]
  timescale = min_ts * (max_ts / min_ts) ** (2 * np.arange(d // 2) / d)
  ang = positions[:, None, None] / timescale
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def _attention(p, x, positions, segments, cfg):  # x: (T, E) for one row
  q = np.einsum("te,ehd->thd", x, p["query"]["kernel"])
  k = np.einsum("te,ehd->thd", x, p["key"]["kernel"])
  v = np.einsum("te,ehd->thd", x, p["value"]["kernel"])
  q, k = (
    _rope(q, positions, cfg.rope_min_timescale, cfg.rope_max_timescale),
    _rope(k, positions, cfg.rope_min_timescale, cfg.rope_max_timescale),
  )
  q = q / np.sqrt(cfg.query_pre_attn_scalar or cfg.head_dim)  # softmax scale, applied at run time
  group = q.shape[1] // k.shape[1]
  k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # GQA: each kv head serves `group` q heads
  logits = np.einsum("thd,shd->hts", q, k)
  t = np.arange(len(x))
  allowed = (t[None, :] <= t[:, None]) & (segments[:, None] == segments[None, :])
  logits = np.where(allowed[None], logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ctx = np.einsum("hts,shd->thd", probs, v)
  return np.einsum("thd,hde->te", ctx, p["out"]["kernel"])


def _mlp(p, x, cfg):
  acts = cfg.mlp_activations
  names = ["wi"] if len(acts) == 1 else [f"wi_{i}" for i in range(len(acts))]
  h = np.prod([_ACT[a](x @ p[n]["kernel"]) for a, n in zip(acts, names)], axis=0)
  return h @ p["wo"]["kernel"]


def forward(params, tokens, positions, segments, cfg):
  """Logits (B, T, V) in float64 from unrolled params (decoder/layers_i) of a llama2 or default block."""
  params = _to_float64(params)
  dec, eps = params["decoder"], cfg.normalization_layer_epsilon
  out = []
  for row in range(tokens.shape[0]):
    x = params["token_embedder"]["embedding"][tokens[row]]
    for i in range(cfg.num_decoder_layers):
      lp = dec[f"layers_{i}"]
      if cfg.decoder_block == "llama2":
        h = x + _attention(
          lp["self_attention"],
          _rms_norm(x, lp["pre_self_attention_layer_norm"]["scale"], eps),
          positions[row],
          segments[row],
          cfg,
        )
        x = h + _mlp(lp["mlp"], _rms_norm(h, lp["post_self_attention_layer_norm"]["scale"], eps), cfg)
      else:  # default: parallel block
        n = _rms_norm(x, lp["pre_self_attention_norm"]["scale"], eps)
        x = x + _attention(lp["self_attention"], n, positions[row], segments[row], cfg) + _mlp(lp["mlp"], n, cfg)
    x = _rms_norm(x, dec["decoder_norm"]["scale"], eps)
    if cfg.logits_via_embedding:
      logits = x @ params["token_embedder"]["embedding"].T / (np.sqrt(x.shape[-1]) if cfg.normalize_embedding_logits else 1)
    else:
      logits = x @ dec["logits_dense"]["kernel"]
    out.append(logits)
  return np.stack(out)


def _to_float64(tree):
  if isinstance(tree, dict):
    return {k: _to_float64(v) for k, v in tree.items()}
  return np.asarray(tree, dtype=np.float64)
