"""Builders that create the shared sub-blocks from the config, so that family blocks stay short, and the
DecoderFamily record through which a family tells the generic decoder stack what it needs.

The layer contract: the decoder, every block and attention are called (x, positions, segment_ids, deterministic),
where `deterministic` (a Python bool) turns dropout off; a block has the fields `config` and `gemm` (how its dense
layers multiply: linears.Gemm), and returns x's shape. The stack (models.Decoder) constrains and names each block's
input (decoder_layer_input) and scans or unrolls the blocks; blocks hold the math only.
"""

import dataclasses
from collections.abc import Callable

import flax.linen as nn

from MaxText.configuration import attention_selection
from MaxText.layers import context_parallel, grouped_matmul
from MaxText.layers.attentions import Attention
from MaxText.layers.dropout import Dropout
from MaxText.layers.embeddings import LinearRopeScaling, Llama3RopeScaling
from MaxText.layers.linears import Gemm, MlpBlock
from MaxText.layers.moe import MoeBlock, load_balancing_loss
from MaxText.layers.moe_experts import ExpertsConfig
from MaxText.layers.normalizations import LayerNorm, RMSNorm


def rms_norm(config, name: str, scale_plus_one: bool = False) -> RMSNorm:
  """RMSNorm; scale_plus_one multiplies by (1 + scale) in float32 (Gemma)."""
  return RMSNorm(
    epsilon=config.normalization_layer_epsilon,
    dtype=config.dtype,
    weight_dtype=config.weight_dtype,
    scale_plus_one=scale_plus_one,
    name=name,
  )


def gemma_rms_norm(config, name: str) -> RMSNorm:
  return rms_norm(config, name, scale_plus_one=True)


def layer_norm(config, name: str) -> LayerNorm:
  return LayerNorm(
    epsilon=config.normalization_layer_epsilon, dtype=config.dtype, weight_dtype=config.weight_dtype, name=name
  )


def rope_scaling(config) -> Llama3RopeScaling | LinearRopeScaling | None:
  """Llama 3.1's scaling (rope_scaling_factor > 0), linear scaling (rope_linear_scaling_factor != 1), or None."""
  if config.rope_scaling_factor <= 0:
    return LinearRopeScaling(config.rope_linear_scaling_factor) if config.rope_linear_scaling_factor != 1 else None
  return Llama3RopeScaling(
    factor=config.rope_scaling_factor,
    low_freq_factor=config.rope_scaling_low_freq_factor,
    high_freq_factor=config.rope_scaling_high_freq_factor,
    original_max_position_embeddings=config.rope_scaling_original_max_position_embeddings,
  )


def self_attention(config, gemm: Gemm, name: str = "self_attention", attention_cls=Attention, **family_options):
  """Attention (or a family's subclass, attention_cls) from the config; family_options (use_rope, use_bias,
  use_qk_norm, sliding_window, local, ...) override it."""
  options = dict(
    num_query_heads=config.num_query_heads,
    num_kv_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    attention_kernel=config.attention,
    attention_segments=attention_selection.cudnn_segments(config.dataset_type, config.packing),
    rope_min_timescale=config.rope_min_timescale,
    rope_max_timescale=config.rope_max_timescale,
    rope_scaling=rope_scaling(config),
    query_scale=(config.query_pre_attn_scalar or config.head_dim) ** -0.5,
    sliding_window=config.sliding_window_size,
    logits_soft_cap=config.attn_logits_soft_cap,
    fused_qkv=config.fused_qkv,
    cache_length=config.max_target_length,
    quantize_kvcache=config.quantize_kvcache,
    kv_quant_axis=config.kv_quant_axis,
    layout=context_parallel.from_config(config),
    gemm=gemm,
    norm_epsilon=config.normalization_layer_epsilon,
    dtype=config.dtype,
    weight_dtype=config.weight_dtype,
  )
  options.update(family_options)
  return attention_cls(**options, name=name)


def mlp(config, gemm: Gemm, name: str = "mlp", use_bias: bool = False) -> MlpBlock:
  return MlpBlock(
    intermediate_dim=config.mlp_dim,
    activations=config.mlp_activations,
    dropout_rate=config.dropout_rate,
    dtype=config.dtype,
    weight_dtype=config.weight_dtype,
    use_bias=use_bias,
    fused=config.fused_mlp,
    gemm=gemm,
    name=name,
  )


def moe(config, name: str = "MoeBlock_0") -> MoeBlock:
  """The mixture of experts that replaces the MLP (named as upstream MaxText's Mixtral checkpoints)."""
  return MoeBlock(
    num_experts=config.num_experts,
    num_experts_per_tok=config.num_experts_per_tok,
    intermediate_dim=config.mlp_dim,
    activations=tuple(config.mlp_activations),
    experts=experts_config(config),
    dtype=config.dtype,
    weight_dtype=config.weight_dtype,
    name=name,
  )


def experts_config(config) -> ExpertsConfig:
  """How the routed experts compute: sparse_matmul x capacity_factor, the dispatch, the grouped matmul's kernel."""
  return ExpertsConfig(
    config.capacity_factor,
    config.sparse_matmul,
    config.moe_dispatch,
    grouped_matmul.from_config(config),
    whole_batch=config.max_checkify,
  )


def dropout(config) -> Dropout:
  """Residual-branch dropout, shared across the sequence axis."""
  return Dropout(config.dropout_rate)


@dataclasses.dataclass(frozen=True)
class DecoderFamily:
  """What the generic decoder stack (models.Decoder) takes from a family.

  Attributes:
    layer: the block (the module docstring's contract), stacked common_types.num_blocks times: Gemma 2's holds two
      decoder layers, as common_types.DECODER_LAYERS_PER_BLOCK says.
    final_norm: builds the norm after the last layer, called (config, name).
    scale_embedding: multiply the token embeddings by sqrt(emb_dim) in the activation dtype (Gemma).
    stack_layers: the block of each stack, by name, for a family with several (common_types.SPLIT_STACKS; None:
      `layer` is the one stack's, `layers`).
    balance_loss: (sown intermediates, config) -> the MoE balance loss that load_balance_loss_weight weighs (0.0
      without experts): Switch/Mixtral's by default.
    takes_layer_index: the block is called with its index in the stack after `deterministic` (an int unrolled, a
      traced int32 scalar under scan_layers), for layers whose computation, not params, depends on where they are
      (Gemma 3's local and global layers).
  """

  layer: type[nn.Module]
  final_norm: Callable = rms_norm
  scale_embedding: bool = False
  stack_layers: dict | None = None
  balance_loss: Callable = lambda sown, config: load_balancing_loss(sown, config.num_experts)
  takes_layer_index: bool = False

  def block(self, stack: str) -> type[nn.Module]:
    """The block of the stack named `stack` (models.layer_stacks)."""
    return self.stack_layers[stack] if self.stack_layers else self.layer
