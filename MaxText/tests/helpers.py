"""Shared pieces of the tests: a tiny model config, running the real entry points in a subprocess, and the tiny data
and chat tokenizer several tests train on. (Tiny models of each family, Hugging Face reference models and in-process
computations on them: tiny_models.py.)"""

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import types

from MaxText import pyconfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE_YML = os.path.join(REPO_ROOT, "MaxText", "configs", "base.yml")
TRAIN_PY = os.path.join(REPO_ROOT, "MaxText", "train.py")

# One compilation cache for all test processes: the same tiny programs compile once per machine.
TEST_JAX_CACHE_DIR = os.path.join(tempfile.gettempdir(), "maxtext_test_jax_cache")

# A model small enough that a train step takes milliseconds on a CPU.
TINY_MODEL = [
  "base_emb_dim=32",
  "base_num_query_heads=4",
  "base_num_kv_heads=2",
  "head_dim=8",
  "base_mlp_dim=64",
  "base_num_decoder_layers=2",
  "vocab_size=4096",
  "max_target_length=32",
  "per_device_batch_size=2",
  "dtype=float32",
  f"jax_cache_dir={TEST_JAX_CACHE_DIR}",
  "enable_tensorboard=false",
]


def tiny_args(*args) -> list[str]:
  """TINY_MODEL with `key=value` args replacing its entries of the same key."""
  merged = dict(a.split("=", 1) for a in TINY_MODEL)
  merged.update(a.split("=", 1) for a in args)
  return [f"{k}={v}" for k, v in merged.items()]


def tiny_config(*args, tmp_path=None, **kwargs):
  """pyconfig.initialize for the tiny model; extra key=value args and typed kwargs override it."""
  out = [f"base_output_directory={tmp_path}"] if tmp_path else []
  return pyconfig.initialize(["test", BASE_YML, "run_name=test", *tiny_args(*out, *args)], environ={}, **kwargs)


def run_python(args, env_extra=None, timeout=600) -> subprocess.CompletedProcess:
  """Runs `python3 <args>` from the repo root with a clean M_* environment."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  env.update(env_extra or {})
  command = [sys.executable, *args]
  return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def read_metrics(path) -> list[dict]:
  """The lines of a metrics file (JSON lines), as dicts."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def run_entry_point(main, argv: list[str]) -> subprocess.CompletedProcess:
  """Runs an entry point's main(argv) in this process as its command line does (a UserError is one `Error:` line and
  status 2; another exception is its traceback and status 1), capturing what it prints: no new Python and JAX to
  start, which is most of a tiny run's time."""
  import io  # pylint: disable=import-outside-toplevel
  import traceback  # pylint: disable=import-outside-toplevel

  from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=import-outside-toplevel

  out, err, status = io.StringIO(), io.StringIO(), 0
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _in_repo_root():
    try:
      run_and_exit_on_user_error(main, argv)
    except SystemExit as e:
      status = e.code if isinstance(e.code, int) else 1
    except Exception:  # pylint: disable=broad-except  # as the process would: its traceback, status 1
      traceback.print_exc()
      status = 1
  return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _in_repo_root():
  previous = os.getcwd()
  os.chdir(REPO_ROOT)
  try:
    yield
  finally:
    os.chdir(previous)


def run_train(tmp_path, run_name, *args, env=None, metrics_name=None, own_process=False):
  """Runs train.py on the tiny model under tmp_path; returns (its result, metrics lines). In this process, unless
  `env` asks for an environment of its own (devices, faults, M_* keys) or `own_process` for process-wide settings (the
  compilation cache's directory, fault handlers): then `python3 MaxText/train.py`."""
  metrics = tmp_path / f"{metrics_name or run_name}.jsonl"
  argv = [TRAIN_PY, "MaxText/configs/base.yml", f"run_name={run_name}"]
  argv += tiny_args(f"base_output_directory={tmp_path}", f"metrics_file={metrics}", "learning_rate=1e-2", *args)
  if env or own_process:
    result = run_python(argv, env_extra=env)
  else:
    from MaxText import train  # pylint: disable=import-outside-toplevel

    assert not any(arg.startswith("jax_cache_dir=") for arg in args), "the cache directory is the process's: own_process"
    result = run_entry_point(train.main, argv)
  return result, (read_metrics(metrics) if metrics.exists() else [])


def cpu_env(devices: int, **extra) -> dict:
  """The environment of a test process with `devices` forced CPU devices (and a clean M_* environment)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu", **extra)
  return env


def start_cpu_processes(
  command, processes: int = 2, devices_per_process: int = 4, rank_env: dict | None = None
) -> list[subprocess.Popen]:
  """Starts `command` as a jax.distributed job of `processes` CPU processes on 127.0.0.1 (output: stdout).

  rank_env: {rank: {variable: value}}, extra environment of some processes.
  """
  import portpicker  # pylint: disable=import-outside-toplevel

  port = portpicker.pick_unused_port()
  cluster = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "NNODES": str(processes)}
  return [
    subprocess.Popen(
      command,
      cwd=REPO_ROOT,
      env=cpu_env(devices_per_process, **cluster, NODE_RANK=str(rank), **(rank_env or {}).get(rank, {})),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for rank in range(processes)
  ]


def finish_processes(procs, timeout: int = 600) -> tuple[list[int], list[str]]:
  """Waits for the processes (killing any left at the timeout); returns their exit codes and outputs."""
  try:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  return [p.returncode for p in procs], outputs


def token_batch(rows: int = 2, length: int = 32, seed: int = 0, segmentation=None) -> dict:
  """A train batch (every key of packing.BATCH_KEYS) of random tokens; `segmentation` (rows, length) marks padding 0."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  tokens = jax.random.randint(jax.random.PRNGKey(seed), (rows, length + 1), 0, 4096)
  positions = jnp.broadcast_to(jnp.arange(length), (rows, length))
  segmentation = jnp.ones((rows, length), jnp.int32) if segmentation is None else segmentation
  return {
    "inputs": tokens[:, :-1],
    "inputs_position": positions,
    "inputs_segmentation": segmentation,
    "targets": tokens[:, 1:],
    "targets_position": positions,
    "targets_segmentation": segmentation,
  }


# ---- kill and resume: a train.py run SIGKILLed when its metrics reach a step ----------------------------------------

KILL_RESUME_STEPS = 40  # the steps of kill_resume_command's run


def kill_resume_command(tmp_path, run_name, per_device_batch, *extra) -> list[str]:
  """The train.py command of a KILL_RESUME_STEPS-step run checkpointed every 10 steps, its metrics in tmp_path."""
  args = tiny_args(
    f"base_output_directory={tmp_path}",
    f"metrics_file={tmp_path / run_name}.jsonl",
    f"steps={KILL_RESUME_STEPS}",
    "checkpoint_period=10",
    "learning_rate=1e-2",
    "base_emb_dim=64",
    "base_mlp_dim=256",
    "max_target_length=64",
    f"per_device_batch_size={per_device_batch}",
    *extra,
  )
  return [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", f"run_name={run_name}", *args]


def _steps_done(metrics_path) -> int:
  return len(read_metrics(metrics_path)) if metrics_path.exists() else 0


def launch_run(command, devices, kill_at_step=None, fault=None):
  """Runs the command; SIGKILLs it once the metrics file reaches kill_at_step. Returns (exit code, stderr)."""
  from MaxText.runtime import fault_injection  # pylint: disable=import-outside-toplevel

  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  if fault:
    env[fault_injection.ENV] = fault
  metrics_path = pathlib.Path(next(a.split("=", 1)[1] for a in command if a.startswith("metrics_file=")))
  proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  if kill_at_step is not None:
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and _steps_done(metrics_path) < kill_at_step:
      time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
  _, stderr = proc.communicate(timeout=600)
  return proc.returncode, stderr


# ---- chat data, preference data and their tokenizer -----------------------------------------------------------------
# The SFT, DPO, LoRA and data-error tests', and the loss gate's: loss_gate_reference.json's recorded figures depend on
# them (change them and re-record the gate: python3 -m MaxText.tests.loss_gate_test --record).

CHATML = (
  "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
  "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
  "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = "hello there how are you the cat sat on the mat a dog ran far what is two plus two four yes no maybe"
CONVERSATIONS = [
  [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "how are you"}],
  [
    {"role": "system", "content": "you are a cat"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "yes or no"},
    {"role": "assistant", "content": "maybe the dog ran far"},
  ],
  [
    {"role": "user", "content": "the cat"},
    {"role": "assistant", "content": "sat on the mat"},
    {"role": "user", "content": "a dog"},
    {"role": "assistant", "content": "ran far"},
  ],
]
# A preference the model can learn: the chosen answers are the right ones.
PAIRS = [
  {"prompt": "what is two plus two", "chosen": "four", "rejected": "the cat sat on the mat"},
  {"prompt": "hello there", "chosen": "how are you", "rejected": "no"},
  {"prompt": "the cat", "chosen": "sat on the mat", "rejected": "ran far"},
  {"prompt": "a dog", "chosen": "ran far", "rejected": "maybe yes"},
]


def build_chat_tokenizer(directory, template: str = CHATML) -> str:
  """A byte-level BPE tokenizer of about 320 tokens with the chat template, saved as transformers saves one."""
  import transformers  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel

  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, initial_alphabet=alphabet)
  tok.train_from_iterator([WORDS, "user assistant system"] * 4, trainer)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
  fast.chat_template = template
  fast.save_pretrained(str(directory))
  return str(directory)


def sft_decoder_config(tokenizer_path, **overrides):
  """A stand-in config holding the keys SftDecoder reads (completion-only chat, 64 tokens), with `overrides`."""
  keys = dict(
    train_data_columns=["messages"],
    train_data_column="text",
    sft_train_on_completion_only=True,
    max_target_length=64,
    tokenizer_path=tokenizer_path,
    chat_template="",
    add_bos=True,
    add_eos=True,
    use_chat_template=False,
  )
  return types.SimpleNamespace(**{**keys, **overrides})


def chat_sft_losses(tmp_path, run_name: str, tokenizer_path: str, *args) -> list[float]:
  """The losses of 30 completion-only SFT steps of train.py on CONVERSATIONS as jsonl (hf), with `args` added."""
  data = tmp_path / "chat.jsonl"
  with open(data, "w", encoding="utf-8") as f:
    for i in range(64):
      f.write(json.dumps({"messages": CONVERSATIONS[i % len(CONVERSATIONS)]}) + "\n")
  result, metrics = run_train(
    tmp_path,
    run_name,
    "steps=30",
    "use_sft=true",
    "sft_train_on_completion_only=true",
    "train_data_columns=['messages']",
    f"tokenizer_path={tokenizer_path}",
    "vocab_size=320",
    "max_target_length=64",
    "dataset_type=hf",
    "hf_path=json",
    f"hf_train_files={data}",
    "enable_checkpointing=false",
    *args,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  losses = [m["learning/loss"] if "learning/loss" in m else m["loss"] for m in metrics]
  assert len(losses) == 30
  return losses


# ---- tiny runs' keys and files (sharded_runs.py's runs: the loss gate, the interaction test) -------------------------

ALL_GEMMS_STATS_YAML = """
all_gemms:
  enabled: true
  layers:
    layer_types: [qkv, attention_out, fc1, fc2]
  collect_tensor_stats:
    enabled: true
    type: [min, max, mean, std, l2_norm, cur_amax]
    tensors: [activation, gradient, weight]
    freq: 1
"""
# Chat data ({tokenizer}: build_chat_tokenizer's) read as json by the hf pipeline.
CHAT_DATA = [
  "dataset_type=hf",
  "hf_path=json",
  "enable_data_shuffling=false",
  "tokenizer_path={tokenizer}",
  "vocab_size=320",
]
# A DPO run on PAIRS ({pairs}) with the chat tokenizer ({tokenizer}).
DPO = [
  "use_dpo=true",
  "dpo_beta=0.1",
  "train_data_columns=['prompt','chosen','rejected']",
  "use_chat_template=true",
  "max_target_length=64",
  *CHAT_DATA,
  "hf_train_files={pairs}",
]
# Every attention projection and dense MLP kernel of the decoder layers.
LORA_MODULES = "decoder/layers/(self_attention/(query|key|value|out)|mlp/(wi_0|wi_1|wo))"
LORA = ["enable_lora=true", "lora_rank=4", "lora_alpha=8", f"lora_module_path={LORA_MODULES}"]


def write_jsonl(path, records, repeats: int) -> str:
  """Writes `records` `repeats` times over as JSON lines to path; returns the path."""
  path.write_text("".join(json.dumps(r) + "\n" for _ in range(repeats) for r in records), encoding="utf-8")
  return str(path)


def run_args(tmp_path, name: str, steps: int, files: dict, *extra) -> list[str]:
  """A tiny run's train.py args for sharded_runs.py: `steps` steps at learning_rate=1e-2, no warmup, no checkpoints,
  its metrics in tmp_path/<name>.jsonl; extra's {placeholders} filled from `files` (write_data_files)."""
  return tiny_args(
    f"run_name={name.replace('.', '_')}",
    f"base_output_directory={tmp_path}",
    f"metrics_file={tmp_path / name}.jsonl",
    f"steps={steps}",
    "learning_rate=1e-2",
    "warmup_steps_fraction=0",
    "enable_checkpointing=false",
    *[a.format(**files) for a in extra],
  )


def write_data_files(tmp_path) -> dict:
  """{stats_yaml, tokenizer, pairs, chat}: the files the runs' {placeholders} name, written under tmp_path."""
  files = {"stats_yaml": tmp_path / "stats.yml"}
  files["stats_yaml"].write_text(ALL_GEMMS_STATS_YAML)
  files["tokenizer"] = build_chat_tokenizer(tmp_path / "chatml")
  files["pairs"] = write_jsonl(tmp_path / "pairs.jsonl", PAIRS, repeats=16)
  files["chat"] = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS], repeats=32)
  return files


def lora_run(tmp_path, hf_dir: str, *args, stops=(3,)):
  """hf_dir converted, then LoRA steps on it with `args` (the LoRA keys among them), a train.py run to each step
  count of `stops` (each resuming the last): (model.yml, base params, run dir, the last run's process)."""
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel

  converter.to_maxtext(hf_dir, str(tmp_path / "maxtext"))
  model_yml, base_params = str(tmp_path / "maxtext" / converter.MODEL_YML), str(tmp_path / "maxtext" / "params")
  common = [
    TRAIN_PY,
    model_yml,
    "run_name=lora",
    f"base_output_directory={tmp_path}",
    f"load_parameters_path={base_params}",
    "learning_rate=1e-2",
    "warmup_steps_fraction=0",
    "dataset_type=synthetic",
    "per_device_batch_size=2",
    "max_target_length=32",
    "dtype=float32",
    "enable_tensorboard=false",
    "checkpoint_period=3",
    *args,
  ]
  for steps in stops:
    result = run_python([*common, f"steps={steps}"])
    assert result.returncode == 0, result.stderr[-3000:]
  return model_yml, base_params, str(tmp_path / "lora"), result


def param_count(model_name: str, *overrides) -> int:
  """The number of params of a preset (with key=value overrides), from the model's abstract init."""
  import math  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.layers import models  # pylint: disable=import-outside-toplevel

  config = pyconfig.initialize(["test", BASE_YML, "run_name=test", f"model_name={model_name}", *overrides], environ={})
  tokens = jax.numpy.zeros((1, 8), jax.numpy.int32)
  shapes = jax.eval_shape(models.Transformer(config).init, jax.random.PRNGKey(0), tokens, tokens)
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
