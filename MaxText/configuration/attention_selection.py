"""Which attention kernel a config runs on its devices: `autoselected` resolved, each kernel's limits checked.

Pure Python (pyconfig calls it once the devices are known, the devices of an AOT target included), so a
kernel the devices or the config cannot run stops the run with one ConfigError line before anything compiles.
"""

import importlib.util
import math

from MaxText.errors import ConfigError

CUDNN_DTYPES = ("bfloat16", "float16")
TE_INSTALL = "bash setup.sh DEVICE=gpu TE=1"
_GPU_KERNELS = ("cudnn_flash_jax", "cudnn_flash_te")


def cudnn_segments(dataset_type: str, packing: bool) -> str:
  """How cudnn_flash_jax masks segments (gpu_attention.SEGMENTS): "causal" for synthetic data (every row one
  whole document), "lengths" when every row holds one document padded at the end (packing=false), else "mask"."""
  if dataset_type == "synthetic":
    return "causal"
  return "mask" if packing else "lengths"


def _cudnn_obstacle(values) -> str:
  """Why cuDNN's flash attention cannot run this config ("" when it can), naming the key."""
  if values["dtype"] not in CUDNN_DTYPES:
    return f"dtype={values['dtype']} (cuDNN flash attention needs {' or '.join(CUDNN_DTYPES)})"
  if values.get("decoder_block") == "deepseek":
    return "decoder_block=deepseek (its multi-head latent attention runs dot_product or flash)"
  if values.get("decoder_block") == "llama4" and values.get("chunk_attn_window_size"):
    return f"chunk_attn_window_size={values['chunk_attn_window_size']} (cuDNN cannot express Llama 4's chunked mask)"
  if values.get("attention_sink"):
    return "attention_sink=true (the cuDNN kernels here take no sinks; dot_product and flash do)"
  if values["attn_logits_soft_cap"]:
    return f"attn_logits_soft_cap={values['attn_logits_soft_cap']} (cuDNN has no logits soft cap)"
  head_dim = values["head_dim"]
  if head_dim % 8 or head_dim > 256:
    return f"head_dim={head_dim} (cuDNN flash attention needs a multiple of 8, at most 256; 128 before Hopper)"
  for axis in ("sequence", "context"):
    if values.get(f"ici_{axis}_parallelism", 1) != 1 or values.get(f"dcn_{axis}_parallelism", 1) != 1:
      return f"ici/dcn_{axis}_parallelism != 1 (the cuDNN kernel here cannot shard the sequence)"
  return ""


def _te_obstacle(values) -> str:
  obstacle = _cudnn_obstacle(values)
  if obstacle:
    return obstacle
  if values["sliding_window_size"]:
    return f"sliding_window_size={values['sliding_window_size']} (not wired to TransformerEngine here)"
  if cudnn_segments(values["dataset_type"], values["packing"]) == "mask":
    return (
      f"packing=true with dataset_type={values['dataset_type']} (TransformerEngine's kernel masks padding, not "
      "packed segments: set packing=false or use cudnn_flash_jax)"
    )
  return ""


def _check_flash(values, platform: str) -> None:
  if platform != "tpu":
    raise ConfigError(
      f"attention=flash needs a TPU (Pallas splash kernel); this machine has {platform} devices: use dot_product"
    )
  length = values["max_target_length"]
  if not _flash_length(length):
    raise ConfigError(f"attention=flash needs max_target_length={length} to be a multiple of 128 (of 512 above 512)")


def _flash_length(length: int) -> bool:
  """Whether the splash kernel's blocks tile a sequence of this length."""
  return not (length % 128 or (length > 512 and length % 512))


def _check_gpu_kernel(kernel: str, values, platform: str) -> None:
  if platform != "gpu":
    raise ConfigError(
      f"attention={kernel} needs a GPU (cuDNN); this machine has {platform} devices: use attention=dot_product "
      "(or autoselected)"
    )
  obstacle = (_te_obstacle if kernel == "cudnn_flash_te" else _cudnn_obstacle)(values)
  if obstacle:
    raise ConfigError(f"attention={kernel} cannot run with {obstacle}; use attention=dot_product")
  if kernel == "cudnn_flash_te" and importlib.util.find_spec("transformer_engine") is None:
    raise ConfigError(
      f"attention=cudnn_flash_te needs TransformerEngine's JAX package, which is not installed: `{TE_INSTALL}` "
      "installs it (or use attention=cudnn_flash_jax)"
    )


def _ring(values) -> bool:
  context = values.get("ici_context_parallelism", 1) * values.get("dcn_context_parallelism", 1)
  return values.get("context_parallel_strategy") == "ring" and context != 1


def _check_heads_split(values, mesh_shape: dict, what: str) -> None:
  """The mesh axes of the heads' rules must split the query and key/value heads evenly: the splash kernel runs per
  head shard, and context parallelism's gathered keys with unevenly split kv heads gave wrong gradients (XLA CPU)."""
  for name, key in (("activation_heads", "num_query_heads"), ("activation_kv_heads", "num_kv_heads")):
    axes = next((a for rule, a in values["logical_axis_rules"] if rule == name), None) or ()
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    ways = math.prod(mesh_shape.get(a, 1) for a in axes)
    if values[key] % ways:
      split = " x ".join(f"{a} {mesh_shape.get(a, 1)}" for a in axes if mesh_shape.get(a, 1) > 1)
      raise ConfigError(
        f"{what} splits the heads over {split} = {ways} ways, which {key}={values[key]} does not divide: split them "
        "fewer ways (a long sequence can go over context instead of sequence), or use more heads"
      )


def check_length_sharding(values, mesh_shape: dict) -> None:
  """The sequence split over mesh axes sequence x context: lengths that divide, what ring attention supports, and
  heads that the flash kernel's shards divide."""
  sequence, context = mesh_shape.get("sequence", 1), mesh_shape.get("context", 1)
  length = values["max_target_length"]
  if values["attention"] == "flash":
    _check_heads_split(values, mesh_shape, "attention=flash")
  if sequence * context == 1:
    return
  if context > 1:
    _check_heads_split(values, mesh_shape, f"context parallelism ({context})")
  if length % (sequence * context):
    raise ConfigError(
      f"max_target_length={length} must be divisible by {sequence * context}: the sequence is split over "
      f"{sequence * context} devices (sequence {sequence} x context {context})"
    )
  if context > 1 and values["context_parallel_load_balance"] and length % (2 * context):
    raise ConfigError(
      f"max_target_length={length} must be divisible by {2 * context}: context_parallel_load_balance=true cuts the "
      f"sequence into 2 x context ({context}) chunks (or set it to false)"
    )
  kernel = values["attention"]
  if context > 1 and values["context_parallel_strategy"] == "ring":
    if values.get("attention_sink"):
      raise ConfigError(
        "context_parallel_strategy=ring cannot carry attention_sink=true (its blockwise softmax has no sinks): use "
        "context_parallel_strategy=all_gather"
      )
    if kernel != "dot_product":
      raise ConfigError(
        f"context_parallel_strategy=ring runs with attention=dot_product, not attention={kernel}: use dot_product, or "
        "context_parallel_strategy=all_gather with the kernel"
      )
    if sequence > 1:
      raise ConfigError(
        f"context_parallel_strategy=ring does not combine with ici/dcn_sequence_parallelism ({sequence}): the ring "
        "passes keys around the context axis only; shard the sequence over context alone"
      )
  local = length // context  # the queries of a device inside attention (sequence splits the heads there)
  if kernel == "flash" and (local % 128 or (local > 512 and local % 512)):
    raise ConfigError(
      f"attention=flash splits max_target_length={length} over context {context} into {local} queries each: that "
      "must be a multiple of 128 (of 512 above 512), the kernel's block"
    )


def select(values, platform: str) -> str:
  """The attention kernel of the config on `platform` ("cpu", "gpu", "tpu"), checked.

  autoselected: flash on TPU (dot_product for a length its blocks do not tile); cudnn_flash_jax on GPU when the
  config allows it (cuDNN is part of jax's CUDA build; TransformerEngine is an optional extra), else dot_product.
  """
  kernel = values["attention"]
  if values.get("use_multimodal") and kernel not in ("autoselected", "dot_product"):
    raise ConfigError(
      f"use_multimodal=true runs with attention=dot_product (its mask lets an image's tokens see each other both "
      f"ways), not attention={kernel}"
    )
  if kernel == "autoselected":
    if _ring(values) or values.get("use_multimodal"):
      kernel = "dot_product"  # ring attention is written in plain JAX: its blocks are dot products
    elif platform == "tpu":
      kernel = "flash" if _flash_length(values["max_target_length"]) else "dot_product"
    elif platform == "gpu" and not _cudnn_obstacle(values):
      kernel = "cudnn_flash_jax"
    else:
      kernel = "dot_product"
  if kernel == "flash":
    _check_flash(values, platform)
  elif kernel in _GPU_KERNELS:
    _check_gpu_kernel(kernel, values, platform)
  return kernel
