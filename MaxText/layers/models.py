"""The decoder stack, written once for every family: embed -> (scanned, rematted) blocks -> norm -> logits."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.configuration import common_types, pipeline_schedule
from MaxText.layers import (
  block_parts,
  context_parallel,
  deepseek,
  dropout,
  gemma,
  gemma2,
  gemma3,
  gpt3,
  gpt_oss,
  linears,
  llama4,
  pipeline,
  quantizations,
  remat,
  vision_encoder,
)
from MaxText.layers.attention_masks import ImageSegments, soft_cap
from MaxText.layers.block_parts import DecoderFamily
from MaxText.layers.default_block import DecoderLayer
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import DenseGeneral, Gemm
from MaxText.layers.llama2 import LlamaDecoderLayer
from MaxText.layers.mistral import MistralDecoderLayer
from MaxText.layers.mixtral import MixtralDecoderLayer
from MaxText.layers.multi_token_prediction import MTP_LOGITS, MtpDepth
from MaxText.layers.qwen3 import Qwen3DecoderLayer, Qwen3MoeDecoderLayer

# decoder_block -> the family's layer and what the stack does around it (final norm, embedding scale).
DECODER_BLOCKS = {
  "default": DecoderFamily(DecoderLayer),
  "llama2": DecoderFamily(LlamaDecoderLayer),
  "mistral": DecoderFamily(MistralDecoderLayer),
  "mixtral": DecoderFamily(MixtralDecoderLayer),
  "gemma": gemma.FAMILY,
  "gemma2": gemma2.FAMILY,
  "gemma3": gemma3.FAMILY,
  "gpt3": gpt3.FAMILY,
  "qwen3": DecoderFamily(Qwen3DecoderLayer),
  "qwen3_moe": DecoderFamily(Qwen3MoeDecoderLayer),
  "deepseek": deepseek.FAMILY,
  "llama4": llama4.FAMILY,
  "gpt_oss": gpt_oss.FAMILY,
}

# Collections that the scanned layers stack on axis 0 besides their params: sown statistics (e.g. MoE routing, for
# the load-balancing loss), KV caches, the per-layer inputs of the numerics statistics (numerics_taps), and the
# fp8 state and per-layer recipes of quantization (quantizations).
STACKED_COLLECTIONS = {
  "intermediates": 0,
  "cache": 0,
  linears.TAP_COLLECTION: 0,
  quantizations.FP8_COLLECTION: 0,
  quantizations.TABLE_COLLECTION: 0,
}

# The layer axis of a stack that runs before the pipelined one (DeepSeek's dense layers): not split over stage, which
# splits the pipelined stack's (base.yml's rule for "layers"); no rule names it, so every stage holds all its layers.
UNPIPELINED_LAYERS = "unpipelined_layers"

# The collections a pipelined stack takes with its params (the others are outputs: sown statistics, KV caches).
_INPUTS = ("params", linears.TAP_COLLECTION, quantizations.FP8_COLLECTION)

_cp = jax.checkpoint_policies
_QKV = ("query_proj", "value_proj", "key_proj", "qkv_proj")
# What the backward pass may keep; everything else is recomputed. "none" turns remat off.
REMAT_POLICIES = {
  "full": None,
  "minimal": _cp.checkpoint_dots_with_no_batch_dims,
  "save_dot_except_mlpwi": _cp.save_only_these_names(*_QKV, "out_proj", "mlpwo"),
  "save_dot_except_mlp": _cp.save_only_these_names(*_QKV, "out_proj"),
  "save_qkv_proj": _cp.save_only_these_names(*_QKV),
  "save_out_proj": _cp.save_only_these_names("out_proj"),
  "minimal_flash": _cp.save_from_both_policies(_cp.checkpoint_dots_with_no_batch_dims, _cp.save_only_these_names("context")),
  # "minimal", with what it keeps moved to host memory until the backward pass needs it (TPU, GPU).
  "minimal_offloaded": _cp.offload_dot_with_no_batch_dims(offload_src="device", offload_dst="pinned_host"),
  # Upstream's GPU names. A fused attention kernel (cuDNN, splash) is no dot to "minimal": saving its output
  # ("context") spares rerunning it in the backward pass.
  "minimal_with_context": _cp.save_only_these_names(*_QKV, "out_proj", "mlpwi", "mlpwo", "context"),
  "save_dot_with_context_except_mlp": _cp.save_only_these_names(*_QKV, "context", "out_proj"),
  "qkv_proj_offloaded": _cp.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=list(_QKV),
    offload_src="device",
    offload_dst="pinned_host",
  ),
  "none": None,
}


def num_blocks(config) -> int:
  """Scanned blocks (layers/ stacked, or layers_0 .. layers_{n-1}) of the decoder: layers / layers per block."""
  return common_types.num_blocks(config.decoder_block, config.num_decoder_layers)


def layer_stacks(config) -> dict[str, int]:
  """The decoder's stacks of blocks, in order: name -> blocks (one, `layers`, but for common_types.SPLIT_STACKS)."""
  return common_types.layer_stacks(config.decoder_block, config.num_decoder_layers, config.first_num_dense_layers)


def logits_dot_dtype(cfg) -> str:
  """The dtype of the logits matmul, tied (Embed.attend) or untied (logits_dense)."""
  return "float32" if cfg.logits_dot_in_fp32 else cfg.dtype


@functools.cache
def _stacked(block_cls, takes_layer_index: bool, scanned: bool):
  """The block as the stack runs it: its input constrained to the activation sharding and named
  decoder_layer_input (what remat keeps at least), and with nn.scan's (carry, out) signature when scanned.
  The stack gives every block its index; only a family that takes_layer_index gets it. Params keep the block's own
  names."""

  class Stacked(block_cls):
    def __call__(self, x, positions, segment_ids, deterministic, layer_index):
      x = nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))
      args = (positions, segment_ids, deterministic) + ((layer_index,) if takes_layer_index else ())
      with dropout.layer(layer_index):  # its masks, wherever the layer runs
        y = super().__call__(checkpoint_name(x, "decoder_layer_input"), *args)  # (B, T, E)
      return (y, None) if scanned else y

  Stacked.__name__ = block_cls.__name__
  return Stacked


def _stacked_layers(variables: dict, stack: str, order, scan_axis: int) -> dict:
  """Unrolled layers' collections ({name: {<stack>_<i>: tree}}) stacked as a scanned stack holds them, the layers
  in `order`: params on scan_axis, the other collections on axis 0 (STACKED_COLLECTIONS)."""
  out = {}
  for name, tree in variables.items():
    layers = [tree[f"{stack}_{i}"] for i in order if f"{stack}_{i}" in tree]
    if layers:
      axis = scan_axis if name == "params" else 0
      out[name] = jax.tree.map(lambda *xs, a=axis: jnp.stack(xs, axis=a if xs[0].ndim > 0 else 0), *layers)
  return out


class Decoder(nn.Module):
  """Embeds tokens, runs num_decoder_layers layers of `config.decoder_block`, and returns float32 logits."""

  config: object
  shared_embedding: nn.Module
  gemm: Gemm

  def _block_stack(self, stack: str, scanned: bool):
    cfg = self.config
    family = DECODER_BLOCKS[cfg.decoder_block]
    block = _stacked(family.block(stack), family.takes_layer_index, scanned)
    if cfg.remat_policy != "none":
      # Args are (self, x, positions, segment_ids, deterministic, layer_index): `deterministic` is a Python bool.
      policy = remat.custom_policy(cfg) if cfg.remat_policy == "custom" else REMAT_POLICIES[cfg.remat_policy]
      block = nn.remat(block, prevent_cse=not scanned, policy=policy, static_argnums=(4,))
    return block

  @nn.compact
  def __call__(self, tokens, positions, segment_ids, deterministic: bool, soft_tokens=None):
    """soft_tokens: None, or (B, N * S, E) the soft tokens of each row's images, which take the places of the
    image_token_id tokens (and attend both ways within an image: ImageSegments)."""
    cfg = self.config
    y = self._embed(tokens, positions)  # (B, T, E)
    if soft_tokens is not None:
      y = vision_encoder.place_soft_tokens(y, tokens, soft_tokens, cfg.image_token_id)
      segment_ids = ImageSegments(segment_ids, vision_encoder.image_blocks(tokens, cfg.image_token_id))
    y = block_parts.dropout(cfg)(y, deterministic=deterministic)
    layer_key = None if deterministic or cfg.dropout_rate == 0 else self.make_rng("dropout")
    with dropout.decoder_key(layer_key):  # the layers' masks (dropout.py)
      y = self._layers(y, positions, segment_ids, deterministic)
      y = DECODER_BLOCKS[cfg.decoder_block].final_norm(cfg, "decoder_norm")(y)
      head = self._output_head()
      decoding = self.is_mutable_collection("cache") and not self.is_initializing()
      if cfg.mtp_num_layers > 0 and not decoding:  # decoding skips the extra depths
        self._multi_token_prediction(y, tokens, positions, segment_ids, deterministic, head)
    y = block_parts.dropout(cfg)(y, deterministic=deterministic)
    return self._logits(y, head)  # (B, T, V) float32

  def _multi_token_prediction(self, hidden, tokens, positions, segment_ids, deterministic: bool, head):
    """Sows each depth's logits (multi_token_prediction.MTP_LOGITS); depth k sees the embedding of token i + k at
    position i (the last k positions wrap around: the loss leaves them out), i + k in the data's order (context
    parallelism's load balancing reorders the sequence)."""
    cfg = self.config
    layout = context_parallel.from_config(cfg)
    family = DECODER_BLOCKS[cfg.decoder_block]
    block = self._block_stack(list(layer_stacks(cfg))[-1], scanned=False)
    for k in range(1, cfg.mtp_num_layers + 1):
      ahead = self._embed(context_parallel.roll(layout, tokens, -k), positions)
      depth = MtpDepth(cfg, self.gemm, block, family.final_norm, name=f"mtp_{k}")
      hidden, normed = depth(hidden, ahead, positions, segment_ids, deterministic, cfg.num_decoder_layers + k - 1)
      self.sow("intermediates", MTP_LOGITS, self._logits(normed, head))

  def _embed(self, tokens, positions):
    cfg = self.config
    y = self.shared_embedding(tokens)
    if DECODER_BLOCKS[cfg.decoder_block].scale_embedding:
      y = y * jnp.asarray(cfg.emb_dim**0.5, y.dtype)  # rounded to the activation dtype, as the reference does
    if cfg.trainable_position_size > 0:
      y = y + Embed(
        cfg.trainable_position_size,
        cfg.emb_dim,
        dtype=cfg.dtype,
        weight_dtype=cfg.weight_dtype,
        use_iota=cfg.use_iota_embed,
        attend_dtype=cfg.dtype,  # never attended
        name="position_embedder",
      )(positions)
    return y

  def _layers(self, y, positions, segment_ids, deterministic: bool):
    """Each stack of blocks in turn (layer_stacks); a block's index counts from the first block of the first."""
    offset = 0
    for stack, blocks in layer_stacks(self.config).items():
      y = self._stack(stack, blocks, offset, y, positions, segment_ids, deterministic)
      offset += blocks
    return y

  def _stack(self, stack: str, blocks: int, offset: int, y, positions, segment_ids, deterministic: bool):
    """One stack: scanned as decoder/<stack> (params stacked on param_scan_axis), or unrolled as <stack>_i."""
    schedule = pipeline_schedule.resolve(self.config.get_keys())
    if schedule is not None and stack != schedule.stack:  # a stack before the pipelined one: stage as data too
      with nn.logical_axis_rules(pipeline.stage_as_data(nn.get_logical_axis_rules())):
        return self._scanned(stack, blocks, offset, y, positions, segment_ids, deterministic, UNPIPELINED_LAYERS)
    if schedule is not None and not self.is_initializing():
      return self._pipelined(schedule, stack, y, positions, segment_ids, deterministic)
    return self._scanned(stack, blocks, offset, y, positions, segment_ids, deterministic, "layers")

  def _scanned(self, stack: str, blocks: int, offset: int, y, positions, segment_ids, deterministic: bool, axis: str):
    """The stack scanned (or unrolled), its layer axis named `axis` (the logical axis that shards it)."""
    cfg = self.config
    block = self._block_stack(stack, cfg.scan_layers)
    if not cfg.scan_layers:
      for i in range(blocks):
        y = block(config=cfg, gemm=self.gemm, name=f"{stack}_{i}")(y, positions, segment_ids, deterministic, offset + i)
      return y
    scanned = nn.scan(
      block,
      variable_axes={"params": cfg.param_scan_axis, **STACKED_COLLECTIONS},
      split_rngs={"params": True, "dropout": True},
      in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0),
      length=blocks,
      metadata_params={nn.PARTITION_NAME: axis},
    )
    tables = None if self.is_initializing() else self._recipe_tables(stack)
    if tables is not None:  # each layer's quantization recipe, which its dense modules switch on
      scanned = nn.map_variables(scanned, quantizations.TABLE_COLLECTION, trans_in_fn=lambda _: tables, init=False)
    indices = offset + jnp.arange(blocks, dtype=jnp.int32)
    y, _ = scanned(config=cfg, gemm=self.gemm, name=stack)(y, positions, segment_ids, deterministic, indices)
    return y

  def _recipe_tables(self, stack: str):
    """Each layer's quantization recipe, which its dense modules switch on; None: none."""
    return quantizations.layer_tables(self.gemm.quant, stack, self.variables["params"][stack])

  def _pipelined(self, schedule, stack: str, y, positions, segment_ids, deterministic: bool):
    """The stack through the pipeline (pipeline.py), its model collections with it, its statistics sown as the
    stack sows them. Unrolled layers (scan_layers=false) are stacked for it at every step, in memory order: the
    pipeline runs them as the scanned stack's layers (its quantization recipes by layer index, LoRA's paths read
    layers_<i> as layers already), and their gradients flow back to each layer."""
    cfg = self.config
    order = schedule.memory_order()
    if cfg.scan_layers:
      variables = {name: tree[stack] for name, tree in self.variables.items() if name in _INPUTS and stack in tree}
      quant = self.gemm.quant
    else:
      inputs = {name: tree for name, tree in self.variables.items() if name in _INPUTS}
      variables = _stacked_layers(inputs, stack, order, cfg.param_scan_axis)
      quant = self.gemm.quant and dataclasses.replace(self.gemm.quant, scanned=True)
    # The block's params sit under decoder/<stack> (as if scanned).
    gemm = dataclasses.replace(self.gemm, scope=(*self.path, stack), quant=quant)
    layer = self._block_stack(stack, scanned=False)(config=cfg, gemm=gemm, parent=None)
    tables = quantizations.layer_tables(quant, stack, variables["params"])
    if tables is not None:  # made in the model's layer order; the pipelined params are in memory order
      variables.update(jax.tree.map(lambda t: t[jnp.asarray(order)], tables))
    sow = self.is_mutable_collection("intermediates")
    y, sown = pipeline.run(schedule, layer, variables, y, positions, segment_ids, deterministic, cfg, sow)
    if sown and cfg.scan_layers:
      self.put_variable("intermediates", stack, sown)
    elif sown:  # each unrolled layer's own, as it would sow them
      for position, i in enumerate(order):
        self.put_variable("intermediates", f"{stack}_{i}", jax.tree.map(lambda a, p=position: a[p], sown))
    return y

  def _output_head(self):
    """The untied logits projection (shared by the main logits and multi-token prediction's), or None when tied."""
    cfg = self.config
    if cfg.logits_via_embedding:
      return None
    return DenseGeneral(
      cfg.vocab_size, ("embed", "vocab"), dtype=logits_dot_dtype(cfg), weight_dtype=cfg.weight_dtype, name="logits_dense"
    )

  def _logits(self, y, head):
    cfg = self.config
    if head is None:
      logits = self.shared_embedding.attend(y)
      if cfg.normalize_embedding_logits:
        logits = logits / jnp.sqrt(y.shape[-1])
    else:
      logits = head(y)
    logits = nn.with_logical_constraint(
      logits, ("activation_embed_and_logits_batch", "activation_length", "activation_vocab")
    )
    logits = logits.astype(jnp.float32)
    if cfg.final_logits_soft_cap > 0:
      logits = soft_cap(logits, cfg.final_logits_soft_cap)
    return logits


class Transformer(nn.Module):
  """The decoder-only LM. Param tree: token_embedder/embedding, decoder/{layers or layers_i, decoder_norm, logits_dense}.

  Attributes:
    config: the run's Config.
    gemm: how the decoder layers' dense layers multiply (train_state.create_model adds the numerics statistics'
      tap); None: quantized as the config says, untapped.
  """

  config: object
  gemm: Gemm | None = None

  def setup(self):
    cfg = self.config
    self.token_embedder = Embed(
      cfg.vocab_size,
      cfg.emb_dim,
      dtype=cfg.dtype,
      weight_dtype=cfg.weight_dtype,
      attend_dtype=logits_dot_dtype(cfg),
      use_iota=cfg.use_iota_embed,
      name="token_embedder",
    )
    gemm = self.gemm or Gemm(quant=quantizations.from_config(cfg))
    self.decoder = Decoder(config=cfg, shared_embedding=self.token_embedder, gemm=gemm, name="decoder")
    if cfg.use_multimodal:  # the image side, beside the text decoder (params vision_encoder/, vision_projector/)
      policy = cfg.remat_policy_for_vit
      self.vision_encoder = vision_encoder.VisionEncoder(
        cfg,
        remat.custom_policy(cfg) if policy == "custom" else REMAT_POLICIES[policy],
        remat=policy != "none",
        name="vision_encoder",
      )
      self.vision_projector = vision_encoder.MultiModalProjector(cfg, name="vision_projector")

  def __call__(self, tokens, positions, segment_ids=None, deterministic: bool = True, images=None):
    """tokens, positions, segment_ids: (B, T) int arrays (segment_ids None: one segment per row) -> (B, T, V) float32
    logits. deterministic=False applies dropout (with a "dropout" rng).

    images (use_multimodal): None, or (B, N, C, H, W) float pixel values, each row's N images (rows with fewer are
    padded; an image without soft tokens in its row is unused), in the order of their soft-token runs."""
    cfg = self.config
    if segment_ids is None:
      segment_ids = jnp.ones_like(tokens)
    if cfg.use_multimodal and images is None and self.is_initializing():  # the encoder's params exist from init
      size = cfg.image_size_for_vit
      images = jnp.zeros((tokens.shape[0], 1, cfg.num_channels_for_vit, size, size), jnp.float32)
    soft = None
    if cfg.use_multimodal and images is not None:
      frozen = cfg.freeze_vision_encoder_params
      soft = vision_encoder.soft_tokens_of(self.vision_encoder, self.vision_projector, images, frozen, deterministic)
    return self.decoder(tokens, positions, segment_ids, deterministic, soft)
