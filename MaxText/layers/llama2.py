"""Llama 2/3 decoder layer: pre-norm attention, then a pre-norm feed-forward, each with a residual."""

import flax.linen as nn

from MaxText.layers import block_parts
from MaxText.layers.linears import Gemm


class LlamaDecoderLayer(nn.Module):
  """h = x + attn(norm(x)); out = h + ffn(norm(h)).

  Families that differ from Llama in one sub-block override its hook: `attention` (Qwen3's q/k norms) or
  `feed_forward` (Mixtral's mixture of experts).
  """

  config: object
  gemm: Gemm

  def attention(self, x, positions, segment_ids, deterministic: bool):
    return block_parts.self_attention(self.config, self.gemm)(x, positions, segment_ids, deterministic)

  def feed_forward(self, x, segment_ids, deterministic: bool):
    del segment_ids  # a mixture of experts needs them (its routing statistics leave padding out)
    return block_parts.mlp(self.config, self.gemm)(x, deterministic)

  @nn.compact
  def __call__(self, x, positions, segment_ids, deterministic: bool):
    cfg = self.config
    attn = self.attention(
      block_parts.rms_norm(cfg, "pre_self_attention_layer_norm")(x), positions, segment_ids, deterministic
    )
    h = x + block_parts.dropout(cfg)(attn, deterministic=deterministic)
    ffn = self.feed_forward(block_parts.rms_norm(cfg, "post_self_attention_layer_norm")(h), segment_ids, deterministic)
    return h + block_parts.dropout(cfg)(ffn, deterministic=deterministic)
