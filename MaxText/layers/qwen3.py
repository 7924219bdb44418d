"""Qwen3: the Llama layer with an RMSNorm over head_dim on each query and key head, before RoPE; Qwen3-MoE: the same
attention with a mixture of experts as its feed-forward (softmax routing, top-k weights renormalised, no shared
expert: block_parts.moe)."""

from MaxText.layers import block_parts
from MaxText.layers.llama2 import LlamaDecoderLayer


class Qwen3DecoderLayer(LlamaDecoderLayer):
  """As Llama; attention has self_attention/query_norm and key_norm (scale [head_dim])."""

  def attention(self, x, positions, segment_ids, deterministic: bool):
    attention = block_parts.self_attention(self.config, self.gemm, use_qk_norm=True)
    return attention(x, positions, segment_ids, deterministic)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
  """Qwen3's attention; the feed-forward is the MoE block (MoeBlock_0), as Mixtral's."""

  def feed_forward(self, x, segment_ids, deterministic: bool):
    del deterministic  # the experts have no dropout
    return block_parts.moe(self.config)(x, segment_ids)
