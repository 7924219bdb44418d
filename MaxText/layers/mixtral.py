"""Mixtral decoder layer: Mistral's pre-norm attention, then a pre-norm mixture of experts instead of the MLP."""

import flax.linen as nn
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import block_parts


class MixtralDecoderLayer(nn.Module):
  """h = x + attn(norm(x)); out = h + moe(norm(h)). The MoE sows its routing statistics (load-balancing loss)."""

  config: object

  @nn.compact
  def __call__(self, x, segment_ids, positions, deterministic: bool):
    cfg = self.config
    x = checkpoint_name(block_parts.layer_input(x), "decoder_layer_input")  # (B, T, E)
    attn = block_parts.self_attention(cfg)(
      block_parts.rms_norm(cfg, "pre_self_attention_layer_norm")(x), positions, segment_ids
    )
    h = x + block_parts.dropout(cfg)(attn, deterministic=deterministic)
    moe = block_parts.moe(cfg)(block_parts.rms_norm(cfg, "post_self_attention_layer_norm")(h), segment_ids)
    return h + block_parts.dropout(cfg)(moe, deterministic=deterministic)
