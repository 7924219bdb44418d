#!/usr/bin/env bash
# 32B parameters on any number of v5e-256 slices (upstream published 113 TFLOP/s per chip, 57.3% MFU, on 2 x v5e-256).
#
# Train, on every host of the slices:
#   bash MaxText/configs/v5e/32b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket [DATASET_PATH=gs://my-tfds-dir]
# Check from any host (a CPU is enough) that it compiles and fits, before renting the chips:
#   bash MaxText/configs/v5e/32b.sh EXECUTABLE=train_compile M_COMPILE_TOPOLOGY=v5e-256 M_COMPILE_TOPOLOGY_NUM_SLICES=2
MODEL_KEYS=(steps=15 per_device_batch_size=4 enable_checkpointing=false remat_policy=full global_parameter_scale=32
  max_target_length=2048 use_iota_embed=true reuse_example_batch=1 attention=flash)
LIBTPU_INIT_ARGS="--xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true --xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true --xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
source "$(dirname "$0")/../published_run.sh"
