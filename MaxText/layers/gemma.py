"""Gemma decoder layer: pre-norm attention and GeGLU MLP with (1 + scale) RMSNorms; Gemma 2 adds post-norms.

The family also scales the token embeddings by sqrt(emb_dim) and ends with a (1 + scale) RMSNorm; its
presets tie the logits to the embedding (logits_via_embedding) without dividing them.
"""

import flax.linen as nn

from MaxText.layers import block_parts
from MaxText.layers.linears import Gemm


class GemmaDecoderLayer(nn.Module):
  """h = x + post_attn_norm(attn(norm(x))); out = h + post_ffw_norm(mlp(norm(h))).

  The post-norms exist when use_post_attn_norm / use_post_ffw_norm are set (Gemma 2, Gemma 3). Gemma 3 overrides
  the `attention` hook.

  Attributes:
    sliding_window: the attention window of this layer; None takes sliding_window_size from the config.
  """

  config: object
  gemm: Gemm
  sliding_window: int | None = None

  def attention(self, x, positions, segment_ids, deterministic: bool, layer_index):
    del layer_index  # Gemma's and Gemma 2's layers do not depend on where they are in the stack
    window = self.config.sliding_window_size if self.sliding_window is None else self.sliding_window
    attention = block_parts.self_attention(self.config, self.gemm, sliding_window=window)
    return attention(x, positions, segment_ids, deterministic)

  @nn.compact
  def __call__(self, x, positions, segment_ids, deterministic: bool, layer_index=None):
    """layer_index: the layer's index in the stack, for families whose DecoderFamily.takes_layer_index (else None)."""
    cfg = self.config
    attn = self.attention(
      block_parts.gemma_rms_norm(cfg, "pre_self_attention_norm")(x), positions, segment_ids, deterministic, layer_index
    )
    if cfg.use_post_attn_norm:
      attn = block_parts.gemma_rms_norm(cfg, "post_self_attention_norm")(attn)
    h = x + block_parts.dropout(cfg)(attn, deterministic=deterministic)
    mlp = block_parts.mlp(cfg, self.gemm)(block_parts.gemma_rms_norm(cfg, "pre_ffw_norm")(h), deterministic)
    if cfg.use_post_ffw_norm:
      mlp = block_parts.gemma_rms_norm(cfg, "post_ffw_norm")(mlp)
    return h + block_parts.dropout(cfg)(mlp, deterministic=deterministic)


FAMILY = block_parts.DecoderFamily(GemmaDecoderLayer, final_norm=block_parts.gemma_rms_norm, scale_embedding=True)
