"""Multi-token prediction (MTP, DeepSeek-V3 section 2.2): mtp_num_layers extra depths after the decoder, depth k
predicting from position i the token i + 1 + k, trained with the main loss (weighted by mtp_loss_scaling_factor).

Depth k combines the previous depth's hidden state h (for k = 1 the main model's, after its final norm, as
Megatron-Core's and vLLM's DeepSeek-V3 take it) with the embedding of the token k places ahead,
[enorm(embed(t_(i+k))); hnorm(h_i)], projects it back to emb_dim (eh_proj), and runs one more decoder layer (the
family's block of its last stack: an MoE layer for DeepSeek-V3). Its logits come from its own final norm and the
model's output head (shared with the main logits, as the embedding is). They are sown as `mtp_logits` for the loss;
decoding (the KV cache) skips the depths.
"""

from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp

from MaxText.layers import block_parts
from MaxText.layers.linears import DenseGeneral, Gemm

MTP_LOGITS = "mtp_logits"  # the sown (B, T, V) float32 logits of each depth, in depth order


class MtpDepth(nn.Module):
  """One depth: (h (B, T, E), the embeddings of the tokens k ahead (B, T, E)) -> (its hidden state, normed).

  Attributes:
    block: the decoder layer class as the stack runs it (called with a layer index).
    final_norm: the family's final norm builder, (config, name).
  """

  config: object
  gemm: Gemm
  block: type
  final_norm: Callable

  @nn.compact
  def __call__(self, hidden, ahead, positions, segment_ids, deterministic: bool, layer_index: int):
    cfg = self.config
    x = jnp.concatenate(
      [block_parts.rms_norm(cfg, "enorm")(ahead), block_parts.rms_norm(cfg, "hnorm")(hidden)], axis=-1
    )  # (B, T, 2E): the embedding first, as DeepSeek-V3's checkpoints' eh_proj reads it
    x = DenseGeneral(cfg.emb_dim, (None, "embed"), dtype=cfg.dtype, weight_dtype=cfg.weight_dtype, name="eh_proj")(x)
    h = self.block(config=cfg, gemm=self.gemm, name="layer")(x, positions, segment_ids, deterministic, layer_index)
    return h, self.final_norm(cfg, "norm")(h)
