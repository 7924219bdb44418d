"""Residual-branch dropout whose masks do not depend on how the layers or the batch are split.

A decoder layer's masks come from the decoder's dropout key, the layer's index in the model and the dropout's place
in the layer (`decoder_key`, `layer`), not from Flax's module-path rngs: so the scanned stack, the unrolled layers
(scan_layers=false) and the pipeline, which applies a layer on its own, draw the same masks.

A mask is one draw over the whole batch, shared along the sequence (B, 1, E). Data, fsdp and context parallelism
split that draw. The pipeline runs a layer once per microbatch; it says which rows of the batch the microbatch holds
(`microbatch_rows`), and the mask is the whole batch's at those rows. That costs drawing (B, 1, E) bits per
microbatch, small beside the (B, T, E) activations.
"""

import contextlib
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass
class _Layer:
  key: jax.Array
  drawn: int = 0  # the layer's masks drawn so far: the next one's place


_DECODER_KEY: list = []  # innermost last; None: no layer keys (dropout off)
_LAYER: list[_Layer] = []
_MICROBATCH: list[tuple[int, jax.Array]] = []  # (the batch's rows, the microbatch's row indices)


@contextlib.contextmanager
def _pushed(stack: list, item):
  stack.append(item)
  try:
    yield
  finally:
    stack.pop()


def decoder_key(key):
  """The decoder layers' masks within this context derive from `key` (None: the decoder is deterministic)."""
  return _pushed(_DECODER_KEY, key)


def layer(index):
  """Within this context, masks are layer `index`'s (a traced index is fine): fold_in(decoder key, index), then the
  mask's place in the layer."""
  if not _DECODER_KEY or _DECODER_KEY[-1] is None:
    return contextlib.nullcontext()
  return _pushed(_LAYER, _Layer(jax.random.fold_in(_DECODER_KEY[-1], index)))


def microbatch_rows(batch: int, rows):
  """Within this context, masks are drawn for a batch of `batch` rows and rows `rows` (the microbatch) are kept."""
  return _pushed(_MICROBATCH, (batch, rows))


class Dropout(nn.Module):
  """Drops each (row, feature) with probability `rate`, the same along the sequence (axis -2), scaling the kept ones
  by 1 / (1 - rate). Outside a decoder layer its key is Flax's make_rng("dropout")."""

  rate: float

  @nn.compact
  def __call__(self, x, deterministic: bool):
    if deterministic or self.rate == 0.0:
      return x
    if self.rate == 1.0:
      return jnp.zeros_like(x)
    keep = 1.0 - self.rate
    if _LAYER:
      rng = jax.random.fold_in(_LAYER[-1].key, _LAYER[-1].drawn)
      _LAYER[-1].drawn += 1
    else:
      rng = self.make_rng("dropout")
    shape = (*x.shape[:-2], 1, x.shape[-1])
    if _MICROBATCH:
      batch, rows = _MICROBATCH[-1]
      mask = jax.random.bernoulli(rng, keep, (batch, *shape[1:]))[rows]
    else:
      mask = jax.random.bernoulli(rng, keep, shape)
    return jax.lax.select(jnp.broadcast_to(mask, x.shape), x / keep, jnp.zeros_like(x))
