"""GPT-3 decoder layer: LayerNorm with bias, multi-head attention and a GELU MLP, all projections with biases.

Positions come from a learned table (trainable_position_size > 0, `decoder/position_embedder`), not RoPE;
the family ends with a LayerNorm.
"""

import flax.linen as nn
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import block_parts


class Gpt3DecoderLayer(nn.Module):
  """h = x + attn(ln(x)); out = h + mlp(ln(h))."""

  config: object

  @nn.compact
  def __call__(self, x, segment_ids, positions, deterministic: bool):
    cfg = self.config
    x = checkpoint_name(block_parts.layer_input(x), "decoder_layer_input")  # (B, T, E)
    attn = block_parts.self_attention(cfg, use_rope=False, use_bias=True)(
      block_parts.layer_norm(cfg, "pre_self_attention_norm")(x), positions, segment_ids
    )
    h = x + block_parts.dropout(cfg)(attn, deterministic=deterministic)
    mlp = block_parts.mlp(cfg, use_bias=True)(block_parts.layer_norm(cfg, "pre_mlp_norm")(h), deterministic)
    return h + block_parts.dropout(cfg)(mlp, deterministic=deterministic)


FAMILY = block_parts.DecoderFamily(Gpt3DecoderLayer, final_norm=block_parts.layer_norm)
