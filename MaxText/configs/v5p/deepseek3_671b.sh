#!/usr/bin/env bash
# DeepSeek-V3 671B on v5p-1024 (upstream published 90.7 s per step, 152.4 TFLOP/s per chip: benchmarks/
# maxtext_v5p_model_configs.py deepseek3_671b_v5p_1024, tpu-recipes training/v5p/DeepSeek3-671B-MaxText).
#
# Train, on every host of the slice:
#   bash MaxText/configs/v5p/deepseek3_671b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket [DATASET_PATH=gs://my-tfds-dir]
# Check from any host (a CPU is enough) that it compiles and fits, and its step-time estimate:
#   bash MaxText/configs/v5p/deepseek3_671b.sh EXECUTABLE=train_compile M_COMPILE_TOPOLOGY=v5p-1024
# Published keys: pure FSDP, per_device_batch_size=6, 8192 tokens, remat_policy=custom with decoder_layer_input and
# out_proj offloaded to host memory, megablox=true sparse_matmul=true (dropless). Differs: steps=15 and no checkpoints
# (a speed run); moe_dispatch=gather, this project's name for pure FSDP's per-layer gathering of the experts.
MODEL_KEYS=(model_name=deepseek3-671b steps=15 per_device_batch_size=6 max_target_length=8192
  remat_policy=custom decoder_layer_input=offload out_proj=offload megablox=true sparse_matmul=true capacity_factor=-1
  moe_dispatch=gather enable_checkpointing=false)
LIBTPU_INIT_ARGS="--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true --xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
source "$(dirname "$0")/../published_run.sh"
