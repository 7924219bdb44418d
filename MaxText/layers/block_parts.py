"""Builders that create the shared sub-blocks from the config, so that family blocks stay short."""

import flax.linen as nn

from MaxText.layers.attentions import Attention
from MaxText.layers.linears import MlpBlock
from MaxText.layers.normalizations import RMSNorm


def rms_norm(config, name: str) -> RMSNorm:
  return RMSNorm(epsilon=config.normalization_layer_epsilon, dtype=config.dtype, weight_dtype=config.weight_dtype, name=name)


def self_attention(config, name: str = "self_attention") -> Attention:
  return Attention(
    num_query_heads=config.num_query_heads,
    num_kv_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    attention_kernel=config.attention,
    rope_min_timescale=config.rope_min_timescale,
    rope_max_timescale=config.rope_max_timescale,
    query_scale=(config.query_pre_attn_scalar or config.head_dim) ** -0.5,
    dtype=config.dtype,
    weight_dtype=config.weight_dtype,
    name=name,
  )


def mlp(config, name: str = "mlp") -> MlpBlock:
  return MlpBlock(
    intermediate_dim=config.mlp_dim,
    activations=config.mlp_activations,
    dropout_rate=config.dropout_rate,
    dtype=config.dtype,
    weight_dtype=config.weight_dtype,
    name=name,
  )


def dropout(config) -> nn.Dropout:
  """Residual-branch dropout, shared across the sequence axis."""
  return nn.Dropout(config.dropout_rate, broadcast_dims=(-2,))


def layer_input(x):
  return nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))
