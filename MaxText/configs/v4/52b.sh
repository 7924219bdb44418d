#!/usr/bin/env bash
# 52B parameters on any number of v4-384 slices (upstream published 154 TFLOP/s per chip, 56.0% MFU, on 1 x v4-384;
# 162 on 2 slices).
#
# Train, on every host of the slices:
#   bash MaxText/configs/v4/52b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket [DATASET_PATH=gs://my-tfds-dir]
# Check from any host (a CPU is enough) that it compiles and fits, before renting the chips:
#   bash MaxText/configs/v4/52b.sh EXECUTABLE=train_compile M_COMPILE_TOPOLOGY=v4-384 M_COMPILE_TOPOLOGY_NUM_SLICES=2
MODEL_KEYS=(enable_checkpointing=false steps=10 ici_fsdp_parallelism=192 ici_tensor_parallelism=1
  per_device_batch_size=7 remat_policy=full base_num_decoder_layers=32 base_emb_dim=12288 base_mlp_dim=49152
  base_num_query_heads=32 base_num_kv_heads=32 learning_rate=1e-8)
LIBTPU_INIT_ARGS="--xla_enable_async_all_gather=true TPU_MEGACORE=MEGACORE_DENSE"
source "$(dirname "$0")/../published_run.sh"
