"""Converts params between the scanned layout (layers stacked on param_scan_axis) and per-layer layers_{i}."""

import jax
import jax.numpy as jnp


def unstack_layers(decoder_params: dict, num_layers: int, scan_axis: int) -> dict:
  """decoder/{layers: stacked} -> decoder/{layers_0, ..., layers_{L-1}}; other decoder params are kept.

  num_layers is the number of scanned blocks (models.num_blocks: half the layers for Gemma 2).
  """
  stacked = {x.shape[scan_axis if x.ndim > 1 else 0] for x in jax.tree.leaves(decoder_params["layers"])}
  if stacked != {num_layers}:
    raise ValueError(f"decoder/layers stacks {sorted(stacked)} blocks, expected {num_layers}")
  out = {k: v for k, v in decoder_params.items() if k != "layers"}
  for i in range(num_layers):
    out[f"layers_{i}"] = jax.tree.map(
      lambda x, i=i: jnp.take(x, i, axis=scan_axis if x.ndim > 1 else 0), decoder_params["layers"]
    )
  return out


def stack_layers(decoder_params: dict, num_layers: int, scan_axis: int) -> dict:
  """decoder/{layers_0, ..., layers_{L-1}} -> decoder/{layers: stacked on scan_axis}."""
  out = {k: v for k, v in decoder_params.items() if not k.startswith("layers_")}
  per_layer = [decoder_params[f"layers_{i}"] for i in range(num_layers)]
  out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs, axis=scan_axis if xs[0].ndim > 0 else 0), *per_layer)
  return out
