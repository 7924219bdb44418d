"""GPT-3 decoder layer: LayerNorm with bias, multi-head attention and a GELU MLP, all projections with biases.

Positions come from a learned table (trainable_position_size > 0, `decoder/position_embedder`), not RoPE;
the family ends with a LayerNorm.
"""

import flax.linen as nn

from MaxText.layers import block_parts
from MaxText.layers.linears import Gemm


class Gpt3DecoderLayer(nn.Module):
  """h = x + attn(ln(x)); out = h + mlp(ln(h))."""

  config: object
  gemm: Gemm

  @nn.compact
  def __call__(self, x, positions, segment_ids, deterministic: bool):
    cfg = self.config
    attn = block_parts.self_attention(cfg, self.gemm, use_rope=False, use_bias=True)(
      block_parts.layer_norm(cfg, "pre_self_attention_norm")(x), positions, segment_ids, deterministic
    )
    h = x + block_parts.dropout(cfg)(attn, deterministic=deterministic)
    mlp = block_parts.mlp(cfg, self.gemm, use_bias=True)(block_parts.layer_norm(cfg, "pre_mlp_norm")(h), deterministic)
    return h + block_parts.dropout(cfg)(mlp, deterministic=deterministic)


FAMILY = block_parts.DecoderFamily(Gpt3DecoderLayer, final_norm=block_parts.layer_norm)
