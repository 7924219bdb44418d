"""Qwen3: the Llama layer with an RMSNorm over head_dim on each query and key head, before RoPE."""

from MaxText.layers import block_parts
from MaxText.layers.llama2 import LlamaDecoderLayer


class Qwen3DecoderLayer(LlamaDecoderLayer):
  """As Llama; attention has self_attention/query_norm and key_norm (scale [head_dim])."""

  def attention(self, x, positions, segment_ids, deterministic: bool):
    attention = block_parts.self_attention(self.config, self.gemm, use_qk_norm=True)
    return attention(x, positions, segment_ids, deterministic)
