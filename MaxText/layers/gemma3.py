"""Gemma 3 (the text model): Gemma 2's layer (four norms per block) with (1 + w) RMSNorms on each query and key head,
no soft caps, and local (sliding-window) and global layers interleaved 5:1.

Layer i is global when (i + 1) % 6 == 0, as transformers' layer_types. The two kinds differ only in what they compute:
a local layer attends within sliding_window_size with RoPE base local_rope_max_timescale; a global one sees every
earlier token with RoPE base rope_max_timescale, scaled by rope_linear_scaling_factor (Gemma 3 4B and up). Their params
are the same, so the stack scans single layers, each told its index (DecoderFamily.takes_layer_index): any layer count
works (Gemma 3 1B has 26 = 4 x 6 + 2 layers), and the checkpoint layout is the one of every single-layer family.
"""

from MaxText.layers import block_parts
from MaxText.layers.attentions import LocalAttention
from MaxText.layers.gemma import GemmaDecoderLayer

PATTERN = 6  # five local layers, then a global one


def is_local(layer_index):
  """Whether layer `layer_index` (an int, or a traced int of a scanned layer) is a local one."""
  return (layer_index + 1) % PATTERN != 0


def local_attention(config) -> LocalAttention:
  base = config.local_rope_max_timescale
  return LocalAttention(config.sliding_window_size, base if base > 0 else config.rope_max_timescale)


class Gemma3DecoderLayer(GemmaDecoderLayer):
  """Gemma 2's layer; attention has self_attention/query_norm and key_norm (scale [head_dim], 1 + w)."""

  def attention(self, x, positions, segment_ids, deterministic: bool, layer_index):
    attention = block_parts.self_attention(
      self.config,
      self.gemm,
      sliding_window=0,  # the global layers'; the local ones take local_attention's
      use_qk_norm=True,
      qk_norm_plus_one=True,
      local=local_attention(self.config),
    )
    return attention(x, positions, segment_ids, deterministic, is_local=is_local(layer_index))


FAMILY = block_parts.DecoderFamily(
  Gemma3DecoderLayer, final_norm=block_parts.gemma_rms_norm, scale_embedding=True, takes_layer_index=True
)
