"""The masks of causal self-attention (packed segments, sliding windows, decoding's cache slots) and the logits'
soft cap: shared by every attention kernel written in JAX (attentions.py, ring_attention.py)."""

import flax.struct
import jax
import jax.numpy as jnp

# Large negative instead of -inf: a fully masked row then gives a uniform softmax instead of NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@flax.struct.dataclass
class ImageSegments:
  """segment_ids where images' soft tokens sit in the text (Gemma 3): the tokens of one image attend to each other both
  ways, the rest causally. The stack passes it where it passes segment_ids; dot_product attention reads it.

  Attributes:
    ids: (B, T) packed-segment ids (0 = padding).
    blocks: (B, T) the image run of each token (vision_encoder.image_blocks), -1 for text.
  """

  ids: jax.Array
  blocks: jax.Array

  @property
  def shape(self):
    return self.ids.shape


def attention_mask(segment_ids, sliding_window: int = 0, order=None, chunk: int = 0):
  """Causal mask within packed segments: query t sees key s iff s <= t and both are in the same segment.

  Args:
    segment_ids: (B, T) segment of each token (0 = padding), or ImageSegments: also both ways within an image's
      tokens (within the window, as transformers' Gemma 3: window & (causal | same image)).
    sliding_window: > 0 also requires t - s < sliding_window (each query sees itself and the window-1 keys
      before it, as transformers' sliding-window mask).
    order: (T,) the original index of each token when the sequence is reordered (context_parallel), else None.
    chunk: > 0 also requires t // chunk == s // chunk (Llama 4's chunked local attention).
  Returns:
    (B, 1, 1, T, S) boolean mask, broadcastable over (kv_heads, group).
  """
  blocks = None
  if isinstance(segment_ids, ImageSegments):
    segment_ids, blocks = segment_ids.ids, segment_ids.blocks
  length = segment_ids.shape[1]
  t = jnp.arange(length) if order is None else jnp.asarray(order)
  allowed = t[None, :] <= t[:, None]  # (T, S) causal
  if blocks is not None:
    allowed = allowed | ((blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0))  # (B, T, S)
  if sliding_window > 0:
    allowed &= t[:, None] - t[None, :] < sliding_window
  if chunk > 0:
    allowed &= t[:, None] // chunk == t[None, :] // chunk
  same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, S)
  return (same_segment & allowed)[:, None, None, :, :]


def soft_cap(x, cap: float):
  """cap * tanh(x / cap): a smooth clip to (-cap, cap) (Gemma 2's attention and final logits)."""
  return jnp.tanh(x / cap) * cap


def cache_mask(positions, cache_length: int, sliding_window: int = 0, chunk: int = 0, segment_ids=None):
  """Which cache slots each query sees while decoding, where slot s holds the key of position s.

  Args:
    positions: (B, T) positions of the queries (their keys are already written at those slots).
    cache_length: S, the slots in the cache.
    sliding_window: > 0 also requires t - s < sliding_window, as attention_mask.
    chunk: > 0 also requires t // chunk == s // chunk, as attention_mask.
    segment_ids: ImageSegments of a prefill with images: also both ways within an image's tokens (within the
      window), as attention_mask; anything else: causal only.
  Returns:
    (B, 1, 1, T, S) boolean mask. Slots after a query's position (not yet written, or the padding of a
    prompt) are masked by causality.
  """
  t = positions[:, :, None]  # (B, T, 1)
  s = jnp.arange(cache_length)[None, None, :]  # (1, 1, S)
  allowed = s <= t
  if isinstance(segment_ids, ImageSegments):  # the keys' image runs at their slots, -1 elsewhere
    empty = jnp.full((cache_length,), -1, segment_ids.blocks.dtype)
    slots = jax.vmap(lambda b, start: jax.lax.dynamic_update_slice(empty, b, (start,)))(segment_ids.blocks, positions[:, 0])
    queries = segment_ids.blocks[:, :, None]
    allowed = allowed | ((queries == slots[:, None, :]) & (queries >= 0))
  if sliding_window > 0:
    allowed &= t - s < sliding_window
  if chunk > 0:
    allowed &= t // chunk == s // chunk
  return allowed[:, None, None, :, :]
