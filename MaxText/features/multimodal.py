"""use_multimodal on the train step's side: the batch's `images` (B, max_num_images_per_example, C, H, W) float32
pixel values beside its token arrays (input_pipeline/images.py), and with freeze_vision_encoder_params the vision
encoder kept out of the optimizer (no state for it, no update: AdamW's weight decay would move it). The model holds
the encoder's output constant then (layers/vision_encoder.soft_tokens_of), so no gradient flows through it; the
projector trains, and LoRA's adapters act on the text model alone (the encoder's dense layers multiply plainly).
"""

import jax
import jax.numpy as jnp
import optax

from MaxText import feature_protocol
from MaxText.input_pipeline import images
from MaxText.layers import layer_names

ENCODER = "vision_encoder"  # the encoder's params: params/vision_encoder/...


def _split(tree):
  """(the params without the encoder's, the encoder's)."""
  return layer_names.partition(tree, lambda keys, _: keys[0] == ENCODER)


def without_encoder(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """`optimizer` on every param but the vision encoder's, whose updates are zeros."""

  def init(params):
    return optimizer.init(_split(params)[0])

  def update(grads, state, params=None):
    rest, encoder = _split(grads)
    updates, state = optimizer.update(rest, state, None if params is None else _split(params)[0])
    return layer_names.merge(updates, jax.tree.map(jnp.zeros_like, encoder)), state

  return optax.GradientTransformation(init, update)


class Multimodal(feature_protocol.Feature):
  name = "multimodal"

  def __init__(self, config):
    self.config = config

  def optimizer(self, tx):
    return without_encoder(tx) if self.config.freeze_vision_encoder_params else tx

  def batch_shapes(self, shapes: dict) -> dict:
    return {**shapes, "images": (images.batch_shape(self.config), jnp.float32)}
