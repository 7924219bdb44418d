#!/usr/bin/env bash
# DeepSeek-V3 671B on v5p-1024 (upstream published 90.7 s per step, 152.4 TFLOP/s per chip: benchmarks/
# maxtext_v5p_model_configs.py deepseek3_671b_v5p_1024, tpu-recipes training/v5p/DeepSeek3-671B-MaxText).
#
# Train, on every host of the slice:
#   bash MaxText/configs/v5p/deepseek3_671b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket [DATASET_PATH=gs://my-tfds-dir]
# Check from any host (a CPU is enough) that it compiles and fits, and its step-time estimate:
#   bash MaxText/configs/v5p/deepseek3_671b.sh EXECUTABLE=train_compile M_COMPILE_TOPOLOGY=v5p-1024
# Published keys: pure FSDP, per_device_batch_size=6, 8192 tokens, bf16 activations and f32 weights,
# remat_policy=custom with decoder_layer_input and out_proj offloaded to host memory, megablox=true sparse_matmul=true
# (dropless). Differs:
# - steps=15 and no checkpoints (a speed run);
# - moe_dispatch=gather, this project's name for pure FSDP's per-layer gathering of the experts;
# - param_scan_axis=0 (upstream's default is 1): the layer axis first, so the scan slices a layer out of each
#   stacked f32 weight without relayout copies; with 1 the compiler needs 95.77 GiB of temporaries, 0.03 GiB over;
# - no LIBTPU_INIT_ARGS: the published run's 32 XLA flags raise the temporaries to 96.6 GiB (0.9 GiB over), most of
#   it from --xla_tpu_scoped_vmem_limit_kib=81920; without them the program fits (estimate 84.9 s a step, published
#   90.7 s).
MODEL_KEYS=(model_name=deepseek3-671b steps=15 per_device_batch_size=6 max_target_length=8192 dtype=bfloat16
  weight_dtype=float32 remat_policy=custom decoder_layer_input=offload out_proj=offload megablox=true sparse_matmul=true
  capacity_factor=-1 moe_dispatch=gather param_scan_axis=0 enable_checkpointing=false)
LIBTPU_INIT_ARGS=""
source "$(dirname "$0")/../published_run.sh"
