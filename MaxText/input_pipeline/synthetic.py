"""dataset_type=synthetic: random tokens made on the devices, for speed tests with no input pipeline cost. With
use_multimodal each row starts with its images' soft tokens, and the batch holds random pixels for them."""

import functools

import jax
import jax.numpy as jnp

from MaxText.input_pipeline import images
from MaxText.input_pipeline.batching import check_state_kind
from MaxText.runtime import sharding


def _synthetic_batch(step, *, seed: int, shape: tuple[int, int], vocab_size: int) -> dict:
  tokens = jax.random.randint(jax.random.fold_in(jax.random.PRNGKey(seed), step), (shape[0], shape[1] + 1), 0, vocab_size)
  positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
  ones = jnp.ones(shape, jnp.int32)
  return {
    "inputs": tokens[:, :-1],
    "inputs_position": positions,
    "inputs_segmentation": ones,
    "targets": tokens[:, 1:],
    "targets_position": positions,
    "targets_segmentation": ones,
  }


def _with_images(make, step, *, seed: int, shape: tuple, image_token_id: int, soft_tokens: int) -> dict:
  """make(step) with random pixels of `shape` (images.batch_shape), each row's first images x soft_tokens inputs being
  its images' soft tokens."""
  batch = make(step)
  pixels = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(seed + 1), step), shape, jnp.float32)
  runs = min(shape[1] * soft_tokens, batch["inputs"].shape[1])
  return {**batch, "inputs": batch["inputs"].at[:, :runs].set(image_token_id), "images": pixels}


class SyntheticDataIterator:
  """Batch k is a deterministic function of (data_shuffle_seed, k); its state is just k."""

  def __init__(self, config, mesh):
    shape = (config.global_batch_size_to_load, config.max_target_length)
    make = functools.partial(_synthetic_batch, seed=config.data_shuffle_seed, shape=shape, vocab_size=config.vocab_size)
    if config.use_multimodal:
      make = functools.partial(
        _with_images,
        make,
        seed=config.data_shuffle_seed,
        shape=images.batch_shape(config),
        image_token_id=config.image_token_id,
        soft_tokens=config.mm_tokens_per_image,
      )
    self._make = jax.jit(make, out_shardings=sharding.data_sharding(config, mesh))
    self._step = 0

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = self._make(self._step)
    self._step += 1
    return batch

  def get_state(self) -> dict:
    return {"kind": "synthetic", "step": self._step}

  def set_state(self, state: dict) -> None:
    check_state_kind(state, "synthetic")
    self._step = int(state["step"])

  def close(self) -> None:
    pass
