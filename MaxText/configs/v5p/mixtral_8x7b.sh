#!/usr/bin/env bash
# Mixtral 8x7B on v5p-256 (upstream published 52.56% MFU, 2,909 tokens/s per chip: docs/reference/models/tiering.md,
# tpu-recipes training/v5p/Mixtral-8X7B-Maxtext).
#
# Train, on every host of the slice:
#   bash MaxText/configs/v5p/mixtral_8x7b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket [DATASET_PATH=gs://my-tfds-dir]
# Check from any host (a CPU is enough) that it compiles and fits, and its step-time estimate:
#   bash MaxText/configs/v5p/mixtral_8x7b.sh EXECUTABLE=train_compile M_COMPILE_TOPOLOGY=v5p-256
# Published keys: per_device_batch_size=36, 4096 tokens, bf16 weights, flash attention, megablox grouped matmuls
# (sparse_matmul=true, dropless). Differs: steps=15 and no checkpoints (a speed run); ici_fsdp_parallelism is left
# at its default (-1: every device), as the recipe's pure FSDP.
MODEL_KEYS=(model_name=mixtral-8x7b steps=15 per_device_batch_size=36 max_target_length=4096 weight_dtype=bfloat16
  attention=flash remat_policy=full megablox=true sparse_matmul=true capacity_factor=-1 enable_checkpointing=false)
LIBTPU_INIT_ARGS="--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true --xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
source "$(dirname "$0")/../published_run.sh"
