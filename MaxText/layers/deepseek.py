"""DeepSeek-V3: Llama's pre-norm layer with multi-head latent attention (layers/mla.py), a dense MLP in the first
first_num_dense_layers layers and a mixture of experts with shared experts in the rest (layers/deepseek_moe.py).

The two kinds of layer have different params, so the decoder runs them as two stacks, `dense_layers` then
`moe_layers` (common_types.SPLIT_STACKS; upstream MaxText's checkpoint names).
"""

from MaxText.layers import block_parts, context_parallel, mla, moe
from MaxText.layers.deepseek_moe import DeepSeekMoeBlock
from MaxText.layers.llama2 import LlamaDecoderLayer


def latent_attention(config, gemm) -> mla.MLA:
  scaling = None
  if config.rope_type == "yarn":
    # DeepSeek's configs set mscale and mscale_all_dim alike (the HF conversion refuses others)
    scaling = mla.yarn_rope_scaling(
      config.rope_factor,
      config.original_max_position_embeddings,
      config.beta_fast,
      config.beta_slow,
      config.mscale,
      config.mscale,
    )
  return mla.MLA(
    num_heads=config.num_query_heads,
    q_lora_rank=config.q_lora_rank,
    kv_lora_rank=config.kv_lora_rank,
    qk_nope_head_dim=config.qk_nope_head_dim,
    qk_rope_head_dim=config.qk_rope_head_dim,
    v_head_dim=config.v_head_dim,
    rope_max_timescale=config.rope_max_timescale,
    rope_scaling=scaling,
    norm_epsilon=config.normalization_layer_epsilon,
    attention_kernel=config.attention,
    cache_length=config.max_target_length,
    gemm=gemm,
    layout=context_parallel.from_config(config),
    dtype=config.dtype,
    weight_dtype=config.weight_dtype,
    name="self_attention",
  )


class DeepSeekDenseLayer(LlamaDecoderLayer):
  """Llama's layer with multi-head latent attention (self_attention: MLA's params)."""

  def attention(self, x, positions, segment_ids, deterministic: bool):
    return latent_attention(self.config, self.gemm)(x, positions, segment_ids, deterministic)


class DeepSeekMoeLayer(DeepSeekDenseLayer):
  """The feed-forward is routed experts plus shared ones (DeepSeekMoeBlock, named MoeBlock_0 as Mixtral's)."""

  def feed_forward(self, x, segment_ids, deterministic: bool):
    del deterministic  # the experts have no dropout
    cfg = self.config
    return DeepSeekMoeBlock(
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      intermediate_dim=cfg.moe_mlp_dim,
      shared_experts=cfg.shared_experts,
      n_routing_groups=cfg.n_routing_groups,
      topk_routing_group=cfg.topk_routing_group,
      routed_scaling_factor=cfg.routed_scaling_factor,
      norm_topk_prob=True,
      experts=block_parts.experts_config(cfg),
      activations=tuple(cfg.mlp_activations),
      dtype=cfg.dtype,
      weight_dtype=cfg.weight_dtype,
      gemm=self.gemm,
      name="MoeBlock_0",
    )(x, segment_ids)


FAMILY = block_parts.DecoderFamily(
  DeepSeekMoeLayer,
  stack_layers={"dense_layers": DeepSeekDenseLayer, "moe_layers": DeepSeekMoeLayer},
  # DeepSeek-V3's sequence-wise balance loss (its alpha is load_balance_loss_weight)
  balance_loss=lambda sown, config: moe.sequence_balance_loss(sown, config.num_experts, config.num_experts_per_tok),
)
