"""GRPO's loop in train.py (features/grpo.py's host_batch, grpo_rollouts.py): the rollouts reused between rounds, the
metrics, the samples file, one-line errors for bad prompts, a killed run resumed bitwise, and learning a toy task."""

import importlib.util
import json
import os
import signal
import subprocess

import numpy as np
import pytest

from MaxText.tests.helpers import (
  BASE_YML,
  LORA,
  REPO_ROOT,
  TRAIN_PY,
  cpu_env,
  launch_run,
  read_metrics,
  run_python,
  run_train,
  tiny_args,
  write_jsonl,
)

# The worked run's toy task (docs/fine_tuning.md): each prompt has one right word; the SFT data answers it one time in
# three. Its rewards.py gains two rewards here.
_spec = importlib.util.spec_from_file_location(
  "make_task", os.path.join(REPO_ROOT, "end_to_end", "grpo_toy", "make_task.py")
)
make_task = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_task)
LENGTH_REWARD = """

def length(prompts, completions, completion_ids, **columns):
  return [len(ids) / 8 for ids in completion_ids]


def odd_start(prompts, completions, completion_ids, **columns):
  return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """{tokenizer, prompts, sft, rewards}: the chat tokenizer, the task's prompts and SFT data, the reward functions."""
  root = tmp_path_factory.mktemp("grpo")
  make_task.main(str(root))
  with open(root / "rewards.py", "a", encoding="utf-8") as f:
    f.write(LENGTH_REWARD)
  names = ("tokenizer", "prompts.jsonl", "sft.jsonl", "rewards.py")
  return {name.split(".")[0]: str(root / name) for name in names}


def grpo_args(files, *extra) -> list[str]:
  """A GRPO run of the tiny model on the task's prompts (chat template), 8 completions: 2 prompts x 4."""
  return [
    "use_grpo=true",
    "num_generations=4",
    "per_device_batch_size=8",
    "vocab_size=320",
    "max_target_length=32",
    "max_prefill_predict_length=24",
    "train_data_columns=['prompt','answer']",
    "use_chat_template=true",
    f"tokenizer_path={files['tokenizer']}",
    "dataset_type=hf",
    "hf_path=json",
    f"hf_train_files={files['prompts']}",
    "enable_data_shuffling=false",
    f"reward_functions_path={files['rewards']}",
    "eval_interval=-1",
    "warmup_steps_fraction=0",
    "decode_sampling_strategy=weighted",
    *extra,
  ]


@pytest.mark.slow  # about 15 s
def test_rounds_reuse_their_rollouts_and_log_the_rewards(files, tmp_path):
  """num_iterations=2 with 2 microbatches: steps 0 and 1 train on one round's completions (equal rewards and lengths,
  the ratio moves off 1 at the second), step 2 samples anew; the length reward equals the logged completion length
  (the reward function's own count, one token fewer for each completion that ended), and completions.txt holds the
  round of step 0."""
  args = grpo_args(files, "steps=3", "num_iterations=2", "gradient_accumulation_steps=2", "per_device_batch_size=4")
  args += ["reward_functions=length,exact", "reward_weights=[1.0,0.0]", "grpo_samples_interval=2", "grpo_beta=0.04"]
  result, metrics = run_train(tmp_path, "loop", *args, "enable_checkpointing=false")
  assert result.returncode == 0, result.stderr[-3000:]
  assert [m["step"] for m in metrics] == [0, 1, 2]
  first, second, third = metrics
  for key in ("rl/reward_mean", "rl/reward_std", "rl/rewards/length", "rl/rewards/exact", "rl/completion_length"):
    assert first[key] == second[key], key
  assert first["rl/kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference at step 0
  assert first["rl/rewards/length"] == pytest.approx(first["rl/reward_mean"])
  ended = first["rl/completion_length"] - 8 * first["rl/reward_mean"]  # the share of completions that ended
  assert 0.0 <= ended <= 1.0 + 1e-6
  assert third["rl/completion_length"] != first["rl/completion_length"] or third["rl/reward_std"] != first["rl/reward_std"]
  samples = (tmp_path / "loop" / "completions.txt").read_text(encoding="utf-8")
  assert samples.startswith("=== step 0: prompt\n<|im_start|>user\n") and "=== step 2" in samples


def test_a_prompt_longer_than_max_prefill_predict_length_is_one_line(files, tmp_path):
  result, _ = run_train(
    tmp_path, "long", *grpo_args(files, "steps=1", "reward_functions=exact"), "max_prefill_predict_length=4"
  )
  assert result.returncode == 2, result.stderr[-2000:]
  (line,) = [line for line in result.stderr.splitlines() + result.stdout.splitlines() if line.startswith("Error:")]
  assert "tokens long but max_prefill_predict_length=4" in line and "what is two plus two" in line


def _command(files, tmp_path, name, *extra) -> list[str]:
  import sys  # pylint: disable=import-outside-toplevel

  args = tiny_args(
    f"base_output_directory={tmp_path}",
    f"metrics_file={tmp_path / name}.jsonl",
    *grpo_args(files, "reward_functions=exact,length", "learning_rate=1e-2", *extra),
  )
  return [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", f"run_name={name}", *args]


@pytest.mark.slow
def test_a_killed_run_resumes_bitwise(files, tmp_path):
  """Killed mid-round (num_iterations=2, checkpoints every 3 steps: a resume starts between a round's steps) and
  resumed: the losses, rewards and KL equal an uninterrupted run's bitwise (the rollouts and the key are state)."""
  extra = ("steps=12", "checkpoint_period=3", "num_iterations=2", "grpo_beta=0.04")
  code, stderr = launch_run(_command(files, tmp_path, "whole", *extra), 1)
  assert code == 0, stderr[-3000:]
  killed = _command(files, tmp_path, "killed", *extra)
  code, stderr = launch_run(killed, 1, kill_at_step=5)
  assert code == -signal.SIGKILL, f"the run was meant to be killed mid-way: {code} {stderr[-2000:]}"
  code, stderr = launch_run(killed, 1)
  assert code == 0, stderr[-3000:]
  expected = {m["step"]: m for m in read_metrics(tmp_path / "whole.jsonl")}
  got = {m["step"]: m for m in read_metrics(tmp_path / "killed.jsonl")}  # the resumed steps overwrite the killed ones
  assert sorted(got) == list(range(12))
  for key in ("learning/loss", "rl/reward_mean", "rl/kl", "rl/completion_length", "learning/grad_norm"):
    assert [got[s][key] for s in range(12)] == [expected[s][key] for s in range(12)], key


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_raises_the_reward_of_an_sft_model(tmp_path, seed):
  """The docs' worked run (end_to_end/grpo_toy/run.sh): after SFT (one answer in three right), 40 GRPO steps; the
  mean reward of the last 10 steps beats the first 10's by at least 0.2, and the reward curve is plotted."""
  result = subprocess.run(
    ["bash", os.path.join(REPO_ROOT, "end_to_end", "grpo_toy", "run.sh"), str(tmp_path)],
    env={**cpu_env(1), "SEED": str(seed)},
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  rewards = [m["rl/reward_mean"] for m in read_metrics(tmp_path / "grpo.jsonl")]
  print("rewards", json.dumps(np.round(rewards, 3).tolist()))
  assert len(rewards) == 40 and np.mean(rewards[-10:]) >= np.mean(rewards[:10]) + 0.2, rewards
  assert (tmp_path / "reward.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow  # about 40 s
def test_grpo_trains_lora_adapters_and_its_checkpoint_decodes_and_exports(files, tmp_path):
  """GRPO on LoRA's adapters (the reference: the base), and a full GRPO run's checkpoint read by decode.py and
  convert_checkpoint.py to_hf like any other."""
  result, metrics = run_train(tmp_path, "lora", *grpo_args(files, "steps=2", "reward_functions=exact", *LORA))
  assert result.returncode == 0, result.stderr[-2000:]
  assert len(metrics) == 2 and all(np.isfinite(m["learning/loss"]) and m["rl/kl"] >= 0 for m in metrics)
  args = grpo_args(files, "steps=2", "reward_functions=exact", "enable_checkpointing=true", "checkpoint_period=1")
  result, _ = run_train(tmp_path, "full", *args)
  assert result.returncode == 0, result.stderr[-2000:]
  decode_args = tiny_args(
    f"base_output_directory={tmp_path}",
    "run_name=decoded",
    f"load_parameters_path={tmp_path / 'full' / 'checkpoints' / '1' / 'items'}",
    "vocab_size=320",
    f"tokenizer_path={files['tokenizer']}",
    "max_target_length=32",
    "max_prefill_predict_length=16",
    'prompt="how are"',
  )
  decoded = run_python([f"{REPO_ROOT}/MaxText/decode.py", BASE_YML, *decode_args])
  assert decoded.returncode == 0 and 'Input `"how are"` ->' in decoded.stdout, decoded.stderr[-2000:]
  exported = run_python(
    [
      f"{REPO_ROOT}/MaxText/convert_checkpoint.py",
      "to_hf",
      "--maxtext_dir",
      str(tmp_path / "full"),
      "--output_dir",
      str(tmp_path / "hf"),
    ]
  )
  assert exported.returncode == 0, exported.stderr[-2000:]
  assert (tmp_path / "hf" / "config.json").exists() and list((tmp_path / "hf").glob("*.safetensors"))


# nf4's blocks of 64 input rows split over fsdp 4 where every dense kernel's input is 256 rows.
QLORA_NF4 = ["lora_weight_qtype=nf4", "base_emb_dim=256", "base_mlp_dim=256"]


@pytest.mark.slow  # about 40 s
@pytest.mark.parametrize(
  "extra",
  [["ici_fsdp_parallelism=8"], ["ici_tensor_parallelism=2", *LORA, *QLORA_NF4]],
  ids=["fsdp", "fsdp x tensor, QLoRA"],
)
def test_grpo_on_8_devices_equals_one_device(files, tmp_path, extra):
  """Generation and training on the same 8-device mesh: the drawn completions, their rewards and the losses (two
  iterations a round: the sampler's log-probs are the old policy's) are those of the same 32 rows on 1 device, also
  on QLoRA's adapters over an fsdp x tensor mesh.

  A row's draws depend on its place in the global batch, and the data pipeline orders a batch's records by batch
  shard, so here every record holds the same prompt: any layout's batch is then the same rows in the same order."""
  with open(files["prompts"], encoding="utf-8") as f:
    prompt = json.loads(f.readline())
  one_prompt = write_jsonl(tmp_path / "one_prompt.jsonl", [prompt], repeats=64)
  runs = {}
  for name, devices, rows in (("one", 1, 32), ("eight", 8, 4)):
    mesh = [a for a in extra if a.startswith("ici_")] if devices == 8 else []
    others = [a for a in extra if not a.startswith("ici_")]
    args = grpo_args(files, "steps=3", "reward_functions=odd_start", "num_iterations=2", *others, *mesh)
    args += [f"per_device_batch_size={rows}", f"hf_train_files={one_prompt}"]
    result, metrics = run_train(tmp_path, name, *args, env=cpu_env(devices))
    assert result.returncode == 0, result.stderr[-2000:]
    runs[name] = [(m["learning/loss"], m["rl/reward_mean"], m["rl/completion_length"], m["rl/kl"]) for m in metrics]
  assert abs(runs["one"][1][0]) > 1e-4  # the rewards differ within the groups: the loss has a gradient
  np.testing.assert_allclose(runs["eight"], runs["one"], rtol=1e-5, atol=1e-7)
