#!/usr/bin/env bash
# GRPO's worked run (docs/fine_tuning.md), on CPU in about two minutes: a tiny model SFT'd on a toy task with a
# checkable answer, then GRPO on it, and the reward curve as a plot. OUT (default /tmp/grpo_toy) gets the runs,
# their metrics files and reward.png.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/grpo_toy}
SEED=${SEED:-0}
MODEL="base_emb_dim=32 base_num_query_heads=4 base_num_kv_heads=2 head_dim=8 base_mlp_dim=64 base_num_decoder_layers=2
  vocab_size=320 max_target_length=32 per_device_batch_size=8 dtype=float32 enable_tensorboard=false
  tokenizer_path=$OUT/task/tokenizer dataset_type=hf hf_path=json warmup_steps_fraction=0 base_output_directory=$OUT"

# 1. The task: a tokenizer with a chat template, SFT chats (one answer in three right), prompts with their answers.
python3 end_to_end/grpo_toy/make_task.py "$OUT/task"
# 2. SFT: the model learns the format and guesses; 60 steps.
python3 MaxText/train.py MaxText/configs/base.yml run_name=sft $MODEL steps=60 learning_rate=1e-2 \
  use_sft=true "train_data_columns=['messages']" hf_train_files="$OUT/task/sft.jsonl" checkpoint_period=1000 \
  metrics_file="$OUT/sft.jsonl"
# 3. GRPO from the SFT checkpoint: 2 prompts x 4 completions a step, rewarded 1 for the right word; 40 steps.
python3 MaxText/train.py MaxText/configs/base.yml run_name=grpo $MODEL steps=40 learning_rate=5e-3 \
  load_parameters_path="$OUT/sft/checkpoints/59/items" enable_checkpointing=false \
  use_grpo=true num_generations=4 max_prefill_predict_length=24 use_chat_template=true \
  "train_data_columns=['prompt','answer']" hf_train_files="$OUT/task/prompts.jsonl" enable_data_shuffling=false \
  reward_functions_path="$OUT/task/rewards.py" reward_functions=exact \
  decode_sampling_strategy=weighted decode_sampling_seed="$SEED" metrics_file="$OUT/grpo.jsonl"
# 4. The reward curve (and the loss, learning rate, tokens/s).
python3 MaxText/plot_metrics.py "$OUT/grpo.jsonl" --metric rl/reward_mean --metric rl/kl --output "$OUT/reward.png" \
  --title "GRPO on the toy task (seed $SEED)"
