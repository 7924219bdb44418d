"""Llama 2/3 decoder layer: pre-norm attention, then pre-norm gated MLP, each with a residual."""

import flax.linen as nn
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import block_parts


class LlamaDecoderLayer(nn.Module):
  """h = x + attn(norm(x)); out = h + mlp(norm(h)).

  Families that differ from Llama only in the attention (Qwen3's q/k norms) override `attention`.
  """

  config: object

  def attention(self) -> nn.Module:
    return block_parts.self_attention(self.config)

  @nn.compact
  def __call__(self, x, segment_ids, positions, deterministic: bool):
    cfg = self.config
    x = checkpoint_name(block_parts.layer_input(x), "decoder_layer_input")  # (B, T, E)
    attn = self.attention()(block_parts.rms_norm(cfg, "pre_self_attention_layer_norm")(x), positions, segment_ids)
    h = x + block_parts.dropout(cfg)(attn, deterministic=deterministic)
    mlp = block_parts.mlp(cfg)(block_parts.rms_norm(cfg, "post_self_attention_layer_norm")(h), deterministic)
    return h + block_parts.dropout(cfg)(mlp, deterministic=deterministic)
