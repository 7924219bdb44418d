"""A tiny Gemma 3 with images on 1 device and on 8 (fsdp 4 x tensor 2), in one process, reported as JSON: the vision
encoder's soft tokens, 3 train steps' losses, whether the frozen encoder and the projector moved, and how the encoder's
params are sharded. Used by vision_test.py (slow).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python3 -m MaxText.tests.vision_layouts REPORT.json
"""

import json
import sys

import jax
import numpy as np

from MaxText import pyconfig
from MaxText.aot import aot_compile
from MaxText.layers import layer_names, vision_encoder
from MaxText.runtime import jax_runtime, mesh, sharding
from MaxText.tests.helpers import BASE_YML, TEST_JAX_CACHE_DIR, tiny_args
from MaxText.tests.tiny_models import next_token_batch
from MaxText.training import training_setup

IMAGE_TOKEN, SOFT_TOKENS, ROWS = 4000, 4, 8
ARGS = [
  "decoder_block=gemma3",
  "mlp_activations=[gelu,linear]",
  "logits_via_embedding=true",
  "normalize_embedding_logits=false",
  "use_post_attn_norm=true",
  "use_post_ffw_norm=true",
  "sliding_window_size=5",
  "use_multimodal=true",
  "image_size_for_vit=56",
  "patch_size_for_vit=14",
  "hidden_size_for_vit=32",
  "intermediate_size_for_vit=64",
  "num_attention_heads_for_vit=2",
  "num_hidden_layers_for_vit=2",
  f"mm_tokens_per_image={SOFT_TOKENS}",
  f"image_token_id={IMAGE_TOKEN}",
  "max_num_images_per_example=2",
  "learning_rate=1e-2",
  "warmup_steps_fraction=0",
  "attention=dot_product",
  "dataset_type=synthetic",
]
LAYOUTS = {
  "one_device": (1, [f"per_device_batch_size={ROWS}"]),
  "fsdp4_tensor2": (8, ["per_device_batch_size=1", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
}


def batch(config) -> dict:
  """ROWS rows of 32 tokens, each with two images' runs of soft tokens (between start and end tokens), and their
  pixels."""
  rng = np.random.default_rng(0)
  shape = (ROWS, config.max_target_length)
  tokens = rng.integers(1, 3000, shape).astype(np.int32)
  for start in (3, 15):
    tokens[:, start : start + SOFT_TOKENS + 2] = [3001, *[IMAGE_TOKEN] * SOFT_TOKENS, 3002]
  return {**next_token_batch(tokens), "images": rng.normal(size=(ROWS, 2, 3, 56, 56)).astype(np.float32)}


def run(devices: int, extra: list) -> dict:
  config = pyconfig.initialize(
    ["vision_layouts", BASE_YML, *tiny_args(*ARGS, *extra)], environ={}, devices=jax.devices()[:devices]
  )
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  state = setup.init_state(config, device_mesh)
  data = jax.device_put(batch(config), sharding.data_sharding(config, device_mesh))

  def soft_tokens(module, images):
    return vision_encoder.soft_tokens_of(module.vision_encoder, module.vision_projector, images, True, True)

  with sharding.logical_context(device_mesh, config):
    soft = jax.jit(lambda p, x: setup.model.apply({"params": p}, x, method=soft_tokens))(state.params, data["images"])
  before = jax.tree.map(np.asarray, state.params)
  kernel = state.params["vision_encoder"]["layers"]["fc1"]["kernel"]
  opt_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.opt_state)]
  step = aot_compile.compile_train_step(setup, config, device_mesh)
  losses = []
  with sharding.logical_context(device_mesh, config):
    for _ in range(3):
      state, metrics = step(state, data)
      losses.append(float(metrics["learning/loss"]))
  moved = {
    part: max(
      float(np.max(np.abs(np.asarray(a) - b)))
      for a, b in zip(jax.tree.leaves(state.params[part]), jax.tree.leaves(before[part]))
    )
    for part in ("vision_encoder", "vision_projector")
  }
  return {
    "soft_tokens": np.asarray(soft).tolist(),
    "losses": losses,
    "moved": moved,
    "encoder_in_optimizer": any("vision_encoder" in p for p in opt_paths),
    "fc1_kernel_spec": str(kernel.sharding.spec),
    "fc1_kernel_shard": list(kernel.sharding.shard_shape(kernel.shape)),
    "params": len(layer_names.flatten(before)),
  }


def main(report_path: str) -> None:
  jax_runtime.enable_compilation_cache(TEST_JAX_CACHE_DIR)
  report = {name: run(devices, extra) for name, (devices, extra) in LAYOUTS.items()}
  with open(report_path, "w", encoding="utf-8") as f:
    json.dump(report, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
