"""Converts params between the scanned layout (a stack's layers stacked on param_scan_axis, decoder/<stack>) and the
per-layer one (decoder/<stack>_<i>). Most families have one stack, `layers`; DeepSeek two (common_types.layer_stacks).
"""

import jax
import jax.numpy as jnp


def unstack_layers(decoder_params: dict, num_layers: int, scan_axis: int, stack: str = "layers") -> dict:
  """decoder/{<stack>: stacked} -> decoder/{<stack>_0, ..., <stack>_{L-1}}; other decoder params are kept.

  num_layers is the number of scanned blocks in the stack (models.num_blocks: half the layers for Gemma 2).
  """
  stacked = {x.shape[scan_axis if x.ndim > 1 else 0] for x in jax.tree.leaves(decoder_params[stack])}
  if stacked != {num_layers}:
    raise ValueError(f"decoder/{stack} stacks {sorted(stacked)} blocks, expected {num_layers}")
  out = {k: v for k, v in decoder_params.items() if k != stack}
  for i in range(num_layers):
    out[f"{stack}_{i}"] = jax.tree.map(
      lambda x, i=i: jnp.take(x, i, axis=scan_axis if x.ndim > 1 else 0), decoder_params[stack]
    )
  return out


def stack_layers(decoder_params: dict, num_layers: int, scan_axis: int, stack: str = "layers") -> dict:
  """decoder/{<stack>_0, ..., <stack>_{L-1}} -> decoder/{<stack>: stacked on scan_axis}."""
  names = [f"{stack}_{i}" for i in range(num_layers)]
  out = {k: v for k, v in decoder_params.items() if k not in names}
  out[stack] = jax.tree.map(
    lambda *xs: jnp.stack(xs, axis=scan_axis if xs[0].ndim > 0 else 0), *[decoder_params[n] for n in names]
  )
  return out


def unstack_all(decoder_params: dict, stacks: dict[str, int], scan_axis: int) -> dict:
  """unstack_layers for every stack (name -> blocks, as models.layer_stacks)."""
  for stack, blocks in stacks.items():
    decoder_params = unstack_layers(decoder_params, blocks, scan_axis, stack)
  return decoder_params


def stack_all(decoder_params: dict, stacks: dict[str, int], scan_axis: int) -> dict:
  """stack_layers for every stack (name -> blocks, as models.layer_stacks)."""
  for stack, blocks in stacks.items():
    decoder_params = stack_layers(decoder_params, blocks, scan_axis, stack)
  return decoder_params
