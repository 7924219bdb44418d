"""The memory roofline of decoding: a generation step reads at least every parameter and the whole KV cache once,
so it takes at least those bytes over the device's memory bandwidth (benchmarks/decode_benchmark.py,
MaxText/inference_microbenchmark.py)."""

import jax
import jax.numpy as jnp

from MaxText.runtime import aot_targets
from MaxText.training import flops


def device_bytes(tree) -> int:
  """Bytes of the tree's shards on the first device."""
  device = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def kv_cache_bytes(config, rows: int) -> int:
  """The KV cache of `rows` rows on one device: keys and values of every layer, max_target_length slots (an int8
  cache counts 1 byte a value; its scales are left out)."""
  itemsize = 1 if getattr(config, "quantize_kvcache", False) else jnp.dtype(config.dtype).itemsize
  per_row_slot = 2 * config.num_decoder_layers * config.num_kv_heads * config.head_dim * itemsize
  return rows * config.max_target_length * per_row_slot // jax.device_count()


def roofline_tokens_per_s(rows: int, bytes_per_step: int, bandwidth_gbps: float | None) -> float | None:
  """The most tokens/s a step that reads bytes_per_step for `rows` new tokens can reach (None: unknown bandwidth)."""
  return rows * bandwidth_gbps * 1e9 / bytes_per_step if bandwidth_gbps else None


def bandwidth_gbps(override: float | None = None) -> float | None:
  """One device's memory bandwidth: `override`, else the chip table's (aot_targets.CHIPS), else None."""
  if override is not None:
    return override
  kind = jax.devices()[0].device_kind
  chip = aot_targets.CHIPS.get("cpu" if kind == "cpu" else flops.device_generation(kind) or "")
  return chip.memory_bandwidth_gbps if chip else None
