"""Mixtral decoder layer: Mistral's layer with a mixture of experts as its feed-forward."""

from MaxText.layers import block_parts
from MaxText.layers.mistral import MistralDecoderLayer


class MixtralDecoderLayer(MistralDecoderLayer):
  """h = x + attn(norm(x)); out = h + moe(norm(h)). The MoE sows its routing statistics (load-balancing loss)."""

  def feed_forward(self, x, segment_ids, deterministic: bool):
    del deterministic  # the experts have no dropout
    return block_parts.moe(self.config)(x, segment_ids)
