"""Gemma 3's image side: the SigLIP vision encoder (patch embedding, learned positions, pre-norm ViT layers, final
norm) and the multimodal projector (average pooling to the image's soft tokens, (1 + w) RMS norm, linear), as
transformers' SiglipVisionModel and Gemma3MultiModalProjector compute them.

Param names follow the reference checkpoint (embeddings/patch_embedding, encoder layers' layer_norm1, self_attn
q/k/v/out_proj, layer_norm2, mlp fc1/fc2, post_layernorm; mm_soft_emb_norm, mm_input_projection), so the conversion
is a table. The encoder's dense layers multiply plainly (linears.PLAIN): LoRA and quantization act on the text model.
Its params have logical axes of their own (vit_embed, vit_heads, vit_mlp), which base.yml's logical_axis_rules map
as the decoder's embed, heads and mlp; the projector's output dim is the text's embed.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.attentions import masked_attention
from MaxText.layers.linears import ACTIVATIONS, DenseGeneral
from MaxText.layers.normalizations import LayerNorm, RMSNorm

EPSILON = 1e-6  # SigLIP's layer_norm_eps, which Gemma 3's projector norm uses too
ACTIVATION = "gelu"  # SigLIP's gelu_pytorch_tanh
_ACTS = ("activation_batch", "activation_length", "activation_embed")


def _dense(config, features: int, axes: tuple, name: str) -> DenseGeneral:
  return DenseGeneral(features, axes, dtype=config.dtype_mm, weight_dtype=config.weight_dtype, use_bias=True, name=name)


def _layer_norm(config, name: str) -> LayerNorm:
  return LayerNorm(epsilon=EPSILON, dtype=config.dtype_mm, weight_dtype=config.weight_dtype, name=name)


class VisionAttention(nn.Module):
  """Bidirectional multi-head attention over an image's patches; q/k/v/out kernels [in, out] with biases."""

  config: object

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    width, heads = cfg.hidden_size_for_vit, cfg.num_attention_heads_for_vit
    head_dim = width // heads
    batch, patches, _ = x.shape

    def project(name):  # (B, P, N*D) -> (B, P, N, D)
      y = _dense(cfg, width, ("vit_embed", "vit_heads"), name)(x)
      return checkpoint_name(y, name).reshape(batch, patches, heads, head_dim)

    query, key, value = project("q_proj") * head_dim**-0.5, project("k_proj"), project("v_proj")
    everywhere = jnp.ones((1, 1, 1, patches, patches), bool)
    out = masked_attention(query, key, value, everywhere).reshape(batch, patches, width)  # (B, P, N*D)
    return _dense(cfg, width, ("vit_heads", "vit_embed"), "out_proj")(out)


class VisionLayer(nn.Module):
  """x + attention(norm(x)), then x + mlp(norm(x)); called (x, deterministic) -> (x, None) when scanned."""

  config: object
  scanned: bool

  @nn.compact
  def __call__(self, x, deterministic: bool):
    del deterministic  # SigLIP has no dropout in inference or fine-tuning
    cfg = self.config
    x = nn.with_logical_constraint(x, _ACTS)
    x = x + VisionAttention(cfg, name="self_attn")(_layer_norm(cfg, "layer_norm1")(x))
    h = _dense(cfg, cfg.intermediate_size_for_vit, ("vit_embed", "vit_mlp"), "fc1")(_layer_norm(cfg, "layer_norm2")(x))
    h = _dense(cfg, cfg.hidden_size_for_vit, ("vit_mlp", "vit_embed"), "fc2")(ACTIVATIONS[ACTIVATION](h))
    x = x + h  # (B, P, E)
    return (x, None) if self.scanned else x


class VisionEncoder(nn.Module):
  """Images (B, C, H, W) -> (B, patches, hidden_size_for_vit): SigLIP's last hidden state.

  Attributes:
    config: the run's Config (its *_for_vit keys, dtype_mm, scan_layers, param_scan_axis).
    remat_policy: the jax checkpoint policy of its layers (remat_policy_for_vit), or None for full remat.
    remat: whether the layers are rematerialised (remat_policy_for_vit != none).
  """

  config: object
  remat_policy: object = None
  remat: bool = True

  @nn.compact
  def __call__(self, images, deterministic: bool = True):
    cfg = self.config
    x = self._embed(images)  # (B, P, E)
    layer = VisionLayer
    if self.remat:  # args (self, x, deterministic): deterministic is a Python bool
      layer = nn.remat(layer, prevent_cse=not cfg.scan_layers, policy=self.remat_policy, static_argnums=(2,))
    if not cfg.scan_layers:
      for i in range(cfg.num_hidden_layers_for_vit):
        x = layer(cfg, False, name=f"layers_{i}")(x, deterministic)
    else:
      stack = nn.scan(
        layer,
        variable_axes={"params": cfg.param_scan_axis},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,),
        length=cfg.num_hidden_layers_for_vit,
        metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x, _ = stack(cfg, True, name="layers")(x, deterministic)
    return _layer_norm(cfg, "post_layernorm")(x)

  def _embed(self, images):
    """Patches (a conv with stride = kernel, as a dense layer over each patch's C x p x p pixels) + positions."""
    cfg = self.config
    patch, width = cfg.patch_size_for_vit, cfg.hidden_size_for_vit
    batch, channels, height, _ = images.shape
    side = height // patch
    x = images.astype(cfg.dtype_mm).reshape(batch, channels, side, patch, side, patch)
    x = x.transpose(0, 2, 4, 1, 3, 5).reshape(batch, side * side, channels, patch, patch)  # (B, P, C, p, p), row-major
    x = DenseGeneral(
      width,
      (None, None, None, "vit_embed"),
      axis=(-3, -2, -1),
      dtype=cfg.dtype_mm,
      weight_dtype=cfg.weight_dtype,
      use_bias=True,
      name="patch_embedding",
    )(x)
    init = nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "vit_embed"))
    positions = self.param("position_embedding", init, (side * side, width), cfg.weight_dtype)
    return nn.with_logical_constraint(x + positions.astype(cfg.dtype_mm), _ACTS)


class MultiModalProjector(nn.Module):
  """Encoder outputs (B, P, Ev) -> soft tokens (B, mm_tokens_per_image, emb_dim): average-pooled to a square of
  mm_tokens_per_image, normalised (RMS, 1 + w), projected to the text's width."""

  config: object

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    batch, patches, width = x.shape
    side, tokens_side = int(round(patches**0.5)), int(round(cfg.mm_tokens_per_image**0.5))
    kernel = side // tokens_side
    x = x.reshape(batch, tokens_side, kernel, tokens_side, kernel, width).mean(axis=(2, 4))
    x = x.reshape(batch, tokens_side * tokens_side, width)  # (B, S, Ev), row-major as the patches
    x = RMSNorm(EPSILON, cfg.dtype_mm, cfg.weight_dtype, scale_plus_one=True, name="mm_soft_emb_norm")(x)
    y = DenseGeneral(
      cfg.emb_dim, (None, "embed"), dtype=cfg.dtype_mm, weight_dtype=cfg.weight_dtype, name="mm_input_projection"
    )(x)
    return y.astype(cfg.dtype)


def place_soft_tokens(embedded, tokens, soft_tokens, image_token_id: int):
  """The text's embeddings with each image soft token replaced by its image's next soft token, in order.

  Args:
    embedded: (B, T, E) the tokens' embeddings.
    tokens: (B, T) ids; image_token_id marks the soft tokens' places (mm_tokens_per_image per image).
    soft_tokens: (B, N * S, E) each row's N images' S soft tokens, in the row's order.
  Returns:
    (B, T, E)
  """
  is_image = tokens == image_token_id
  index = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, soft_tokens.shape[1] - 1)  # (B, T)
  placed = jnp.take_along_axis(soft_tokens, index[..., None], axis=1).astype(embedded.dtype)
  return jnp.where(is_image[..., None], placed, embedded)


def image_blocks(tokens, image_token_id: int):
  """(B, T) int32: for an image soft token, the index of its run of soft tokens in the row (an image's tokens attend
  to each other both ways); -1 for text. As transformers' get_block_sequence_ids_for_mask."""
  is_image = tokens == image_token_id
  starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(is_image, jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1, -1)


def soft_tokens_of(encoder: nn.Module, projector: nn.Module, images, frozen: bool, deterministic: bool):
  """(B, N, C, H, W) images -> (B, N * S, E) soft tokens; frozen: the encoder's output is a constant (no gradient
  reaches its params, freeze_vision_encoder_params)."""
  batch, num = images.shape[:2]
  hidden = encoder(images.reshape(batch * num, *images.shape[2:]), deterministic)  # (B*N, P, Ev)
  if frozen:
    hidden = jax.lax.stop_gradient(hidden)
  soft = projector(hidden)  # (B*N, S, E)
  return soft.reshape(batch, num * soft.shape[1], soft.shape[2])
