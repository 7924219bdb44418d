"""Names shared by the config validation (pure Python) and the modules that implement them.

Each implementing module has a test asserting that its table covers exactly these names.
"""

DECODER_BLOCKS = (
  "default",
  "llama2",
  "mistral",
  "mixtral",
  "gemma",
  "gemma2",
  "gemma3",
  "gpt3",
  "qwen3",
  "qwen3_moe",
  "deepseek",
  "llama4",
  "gpt_oss",
)
# Decoder layers in one block of the stack, where not 1 (Gemma 2 stacks (local, global) pairs): the one place that
# says it, read by the config checks (before JAX starts), the decoder stack and the quantization recipes.
# Llama 4's block is 4 layers, lcm of its MoE interleave and NoPE interval (each of 1, 2 or 4): upstream's
# inhomogeneous_layer_cycle_interval, so each layer's kind is static within the block.
DECODER_LAYERS_PER_BLOCK = {"gemma2": 2, "llama4": 4}


def layers_per_block(decoder_block: str) -> int:
  return DECODER_LAYERS_PER_BLOCK.get(decoder_block, 1)


def num_blocks(decoder_block: str, num_decoder_layers: int) -> int:
  """The blocks of the decoder stack (scanned as decoder/layers, or unrolled as layers_0 .. layers_{n-1})."""
  return num_decoder_layers // layers_per_block(decoder_block)


# Families whose decoder is two stacks of different layers: the first `first_num_dense_layers` layers (dense
# feed-forward) in the first, the rest (mixture of experts) in the second, named as upstream MaxText's checkpoints.
SPLIT_STACKS = {"deepseek": ("dense_layers", "moe_layers")}
STACK_NAMES = ("layers", "dense_layers", "moe_layers")  # every name a stack of blocks has under decoder/
# Families whose routers hold a selection bias that the optimizer must not move (routing_bias.py).
ROUTING_BIAS_BLOCKS = ("deepseek",)


def layer_stacks(decoder_block: str, num_decoder_layers: int, first_num_dense_layers: int = 0) -> dict[str, int]:
  """The decoder's stacks of blocks in the order they run: name -> blocks (params decoder/<name> scanned, or
  <name>_0 .. <name>_<n-1> unrolled). One stack, `layers`, except for SPLIT_STACKS (an empty stack is left out)."""
  if decoder_block in SPLIT_STACKS:
    dense, moe = SPLIT_STACKS[decoder_block]
    counts = {dense: first_num_dense_layers, moe: num_decoder_layers - first_num_dense_layers}
    return {name: count for name, count in counts.items() if count > 0}
  return {"layers": num_blocks(decoder_block, num_decoder_layers)}


ATTENTION_KERNELS = ("autoselected", "dot_product", "flash", "cudnn_flash_jax", "cudnn_flash_te")
REMAT_POLICIES = (
  "full",
  "minimal",
  "save_dot_except_mlpwi",
  "save_dot_except_mlp",
  "save_qkv_proj",
  "save_out_proj",
  "minimal_flash",
  "minimal_offloaded",
  "minimal_with_context",
  "save_dot_with_context_except_mlp",
  "qkv_proj_offloaded",
  "custom",
  "none",
)
# remat_policy=custom: upstream's names of the activations the layers tag (checkpoint_name), each a key whose value
# says where the backward pass finds it: recomputed (remat), kept on the device, or offloaded to host memory.
REMAT_NAMES = (
  "decoder_layer_input",
  "context",
  "mlpwi",
  "mlpwi_0",
  "mlpwi_1",
  "mlpwo",
  "moe_mlpwi_0",
  "moe_mlpwi_1",
  "moe_mlpwo",
  "query_proj",
  "key_proj",
  "value_proj",
  "qkv_proj",
  "out_proj",
  "mla_q",
  "mla_kv",
  "attention_out",
)
REMAT_PLACEMENTS = ("remat", "device", "offload")
REMAT_NAME_DEFAULTS = {"decoder_layer_input": "device"}  # the others: remat
# The policies that keep the attention output ("context"): for fused attention kernels (flash, cuDNN).
CONTEXT_REMAT_POLICIES = ("minimal_flash", "minimal_with_context", "save_dot_with_context_except_mlp")
MLP_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_exact", "relu", "tanh", "sigmoid", "linear")
DTYPES = ("float32", "bfloat16", "float16")
DATASET_TYPES = ("embedded", "synthetic", "tfds", "grain", "hf")
OPTIMIZERS = ("adamw", "adam_pax", "sgd", "muon")
HARDWARE = ("auto", "cpu", "gpu", "gpu_multiprocess", "tpu")
XLA_FLAGS_PRESETS = ("", "a3mega")  # "" = none; the flags are in xla_flag_presets.PRESETS
JAX_DISTRIBUTED_INIT = ("auto", "always", "never")
NONFINITE_ACTIONS = ("abort", "skip", "none")
QUANTIZATIONS = ("", "int8", "int8w", "int4w", "intmp", "fp8")
GEMMS = ("fprop", "dgrad", "wgrad")  # a dense layer's forward GEMM, and its input's and kernel's gradient GEMMs
FP8_SCALINGS = ("delayed", "current")
KV_QUANT_AXES = ("heads_and_dkv", "dkv")
KV_QUANT_DTYPES = ("int8",)
STEP_WATCHDOG = ("auto", "true", "false")
PROFILERS = ("", "xplane", "nsys")  # "" = off
DECODE_SAMPLING_STRATEGIES = ("greedy", "weighted", "nucleus", "topk")
COMPILE_SEARCHES = ("", "per_device_batch_size", "per_device_batch_size,remat_policy")

CONTEXT_PARALLEL_STRATEGIES = ("all_gather", "ring")

# The ici_/dcn_ parallelism keys of each mesh axis (mesh axis "stage" is set by *_pipeline_parallelism).
MESH_AXIS_KEY = {
  "data": "data",
  "stage": "pipeline",
  "fsdp": "fsdp",
  "fsdp_transpose": "fsdp_transpose",
  "sequence": "sequence",
  "context": "context",
  "tensor": "tensor",
  "expert": "expert",
  "autoregressive": "autoregressive",
}
