"""Gemma 2: Gemma layers (with post-norms) alternating local (sliding window) and global attention.

One scanned block holds a local then a global layer, so the stacked parameter tree stays uniform under
scan_layers; num_decoder_layers counts layers (26 for Gemma 2 2B), i.e. twice the scanned blocks. Attention
and final logits are soft-capped by attn_logits_soft_cap and final_logits_soft_cap (shared options).
"""

import flax.linen as nn

from MaxText.layers import block_parts
from MaxText.layers.gemma import GemmaDecoderLayer
from MaxText.layers.linears import Gemm


class Gemma2DecoderLayerPair(nn.Module):
  """Layers 2i (`local`: window sliding_window_size) and 2i+1 (`global`: no window) of Gemma 2."""

  config: object
  gemm: Gemm

  @nn.compact
  def __call__(self, x, positions, segment_ids, deterministic: bool):
    x = GemmaDecoderLayer(self.config, self.gemm, name="local")(x, positions, segment_ids, deterministic)
    return GemmaDecoderLayer(self.config, self.gemm, sliding_window=0, name="global")(
      x, positions, segment_ids, deterministic
    )


# Two decoder layers per block: common_types.DECODER_LAYERS_PER_BLOCK["gemma2"].
FAMILY = block_parts.DecoderFamily(Gemma2DecoderLayerPair, final_norm=block_parts.gemma_rms_norm, scale_embedding=True)
