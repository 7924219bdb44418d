"""The `default` decoder layer: attention and MLP in parallel on one shared pre-norm (PaLM / GPT-J style)."""

import flax.linen as nn
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import block_parts


class DecoderLayer(nn.Module):
  """out = x + dropout(attn(norm(x)) + mlp(norm(x)))."""

  config: object

  @nn.compact
  def __call__(self, x, segment_ids, positions, deterministic: bool):
    cfg = self.config
    x = checkpoint_name(block_parts.layer_input(x), "decoder_layer_input")  # (B, T, E)
    normed = block_parts.rms_norm(cfg, "pre_self_attention_norm")(x)
    attn = block_parts.self_attention(cfg)(normed, positions, segment_ids)
    mlp = block_parts.mlp(cfg)(normed, deterministic)
    return x + block_parts.dropout(cfg)(attn + mlp, deterministic=deterministic)
