#!/usr/bin/env bash
# 22B parameters on any number of v4-128 slices (upstream published 156 TFLOP/s per chip, 56.7% MFU, on 1 x v4-128;
# 146-152 on 2-8 slices).
#
# Train, on every host of the slices:
#   bash MaxText/configs/v4/22b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket [DATASET_PATH=gs://my-tfds-dir]
# Check from any host (a CPU is enough) that it compiles and fits, before renting the chips:
#   bash MaxText/configs/v4/22b.sh EXECUTABLE=train_compile M_COMPILE_TOPOLOGY=v4-128 M_COMPILE_TOPOLOGY_NUM_SLICES=2
MODEL_KEYS=(ici_fsdp_parallelism=64 steps=10 per_device_batch_size=13 remat_policy=full base_emb_dim=6144
  base_num_kv_heads=24 base_num_query_heads=24 base_mlp_dim=24576 base_num_decoder_layers=48)
LIBTPU_INIT_ARGS="--xla_enable_async_all_gather=true TPU_MEGACORE=MEGACORE_DENSE"
source "$(dirname "$0")/../published_run.sh"
