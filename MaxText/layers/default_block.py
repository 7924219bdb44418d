"""The `default` decoder layer: attention and MLP in parallel on one shared pre-norm (PaLM / GPT-J style)."""

import flax.linen as nn

from MaxText.layers import block_parts
from MaxText.layers.linears import Gemm


class DecoderLayer(nn.Module):
  """out = x + dropout(attn(norm(x)) + mlp(norm(x)))."""

  config: object
  gemm: Gemm

  @nn.compact
  def __call__(self, x, positions, segment_ids, deterministic: bool):
    cfg = self.config
    normed = block_parts.rms_norm(cfg, "pre_self_attention_norm")(x)
    attn = block_parts.self_attention(cfg, self.gemm)(normed, positions, segment_ids, deterministic)
    mlp = block_parts.mlp(cfg, self.gemm)(normed, deterministic)
    return x + block_parts.dropout(cfg)(attn + mlp, deterministic=deterministic)
