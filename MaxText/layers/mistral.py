"""Mistral: the Llama layer, with attention limited to the last `sliding_window_size` keys (0: no limit).

The window is a shared attention option (block_parts.self_attention reads sliding_window_size), so the
layer and its parameter names are Llama's; this family exists to name the architecture.
"""

from MaxText.layers.llama2 import LlamaDecoderLayer


class MistralDecoderLayer(LlamaDecoderLayer):
  """h = x + attn_window(norm(x)); out = h + mlp(norm(h))."""
