"""decode.py and the KV cache: cached logits equal a full forward pass for every family; stops, errors and
the real entry point (after a real training run, and on 8 forced CPU devices)."""

import os
import re
import sys

import numpy as np
import pytest

from MaxText import decode
from MaxText.errors import UserError
from MaxText.generation import prefill_decode
from MaxText.tests.helpers import (
  BASE_YML,
  finish_processes,
  run_python,
  run_train,
  start_cpu_processes,
  tiny_args,
  tiny_config,
)
from MaxText.tests.tiny_models import (
  DECODE_KEYS,
  DECODE_PROMPT,
  DEEPSEEK,
  FAMILIES,
  decode_with_logits,
  full_forward_logits,
)

DECODE_PY = os.path.join("MaxText", "decode.py")
# float32 everywhere: the cache path computes the same sums over the same keys in another shape.
ATOL = 1e-5
_MOE_ARGS = ["num_experts=4", "num_experts_per_tok=2"]
FAMILY_ARGS = dict(
  FAMILIES, default=[], mixtral=_MOE_ARGS, qwen3_moe=[*FAMILIES["qwen3"], *_MOE_ARGS], deepseek=DEEPSEEK[1:]
)
_OUTPUT_LINE = re.compile(r"^Input `(.*)` -> `(.*)`$", re.M)


def _check_cache_equals_recompute(config):
  model, params, device_mesh, result = decode_with_logits(config)
  assert result.tokens.shape == (2, config.max_target_length - config.max_prefill_predict_length)
  full = full_forward_logits(config, model, params, device_mesh, DECODE_PROMPT, result.tokens)
  np.testing.assert_allclose(result.logits, full, atol=ATOL, rtol=0)
  np.testing.assert_array_equal(result.tokens, full.argmax(-1))  # greedy = argmax of the full recompute
  return np.abs(result.logits - full).max()


_QUICK = ("llama2", "mistral", "gemma", "gemma2", "gemma3", "deepseek")


@pytest.mark.parametrize(
  "family", [f if f in _QUICK else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILY_ARGS)]
)
def test_cached_logits_equal_full_forward(family):
  """Mistral's and Gemma 2's window (5) is shorter than prompt + generation (22 tokens)."""
  config = tiny_config(f"decoder_block={family}", *FAMILY_ARGS[family], *DECODE_KEYS, "dataset_type=synthetic")
  print(f"{family}: max |cached - full| = {_check_cache_equals_recompute(config):.2e}")


def test_cached_logits_equal_full_forward_unscanned_with_remat():
  config = tiny_config(
    "decoder_block=mistral",
    *FAMILIES["mistral"],
    *DECODE_KEYS,
    "scan_layers=false",
    "remat_policy=full",
    "dataset_type=synthetic",
  )
  _check_cache_equals_recompute(config)


def test_rows_stop_at_an_end_token():
  config = tiny_config(*DECODE_KEYS, "dataset_type=synthetic")
  _, _, _, greedy = decode_with_logits(config)
  assert greedy.tokens.shape[1] == 16
  end = int(greedy.tokens[0, 3])  # the 4th token becomes an end token: every row ends there (greedy rows agree)
  _, _, _, stopped = decode_with_logits(config, end_ids=(end,))
  first_end = list(greedy.tokens[0]).index(end)
  assert stopped.tokens.shape[1] == first_end + 1  # the loop stops once every row has ended
  assert prefill_decode.completion(stopped.tokens[0], (end,)) == list(greedy.tokens[0, :first_end])


def test_end_tokens_include_llama3_end_of_turn(tmp_path):
  from MaxText.input_pipeline.tokenizer import TikTokenTokenizer  # pylint: disable=import-outside-toplevel

  ranks = tmp_path / "tokenizer.tiktoken"
  ranks.write_text("".join(f"{__import__('base64').b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
  tokenizer = TikTokenTokenizer(str(ranks), add_bos=True, add_eos=False)
  ids = prefill_decode.end_token_ids(tokenizer)
  assert tokenizer.token_id("<|eot_id|>") in ids and tokenizer.token_id("<|end_of_text|>") in ids
  assert tokenizer.eos_id in ids and len(ids) == 2  # EOS is <|end_of_text|>


def _decode_args(*args):
  return ["decode.py", BASE_YML, "run_name=decode_test", *tiny_args(*DECODE_KEYS, "dataset_type=synthetic", *args)]


@pytest.mark.parametrize(
  "args, message",
  [
    (["prompt="], "prompt is empty"),
    (["max_target_length=8"], "max_target_length=8 must exceed max_prefill_predict_length=8"),
    (["max_prefill_predict_length=2"], "the prompt is 5 tokens long but max_prefill_predict_length=2"),
    (["tokenizer_path=/nonexistent/tokenizer"], "tokenizer_path=/nonexistent/tokenizer does not exist"),
  ],
)
def test_clear_errors(args, message, tmp_path):
  with pytest.raises(UserError, match=re.escape(message)):
    decode.main(_decode_args(f"base_output_directory={tmp_path}", *args))


def _decode_py(*args, env=None):
  result = run_python([DECODE_PY, "MaxText/configs/base.yml", *tiny_args(*DECODE_KEYS, *args)], env_extra=env)
  return result, _OUTPUT_LINE.findall(result.stdout)


def test_error_is_one_line_and_exit_2(tmp_path):
  result, _ = _decode_py("run_name=x", f"base_output_directory={tmp_path}", "max_prefill_predict_length=2")
  assert result.returncode == 2, result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith("Error: the prompt is 5 tokens long")
  assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  """A tiny llama2 trained for 3 steps on the embedded corpus, checkpointed at its last step (2)."""
  tmp_path = tmp_path_factory.mktemp("decode_run")
  result, _ = run_train(tmp_path, "trained", "steps=3", "checkpoint_period=100", "async_checkpointing=false")
  assert result.returncode == 0, result.stderr[-3000:]
  return tmp_path


def test_decode_py_after_training(trained_run):
  items = trained_run / "trained" / "checkpoints" / "2" / "items"
  assert items.is_dir()
  result, lines = _decode_py("run_name=d", f"base_output_directory={trained_run}", f"load_parameters_path={items}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert lines == [("I love to", lines[0][1])] * 2  # one line per row; greedy rows agree
  assert re.search(r"^Prefill: .* ms per generated token .* generated tokens/s$", result.stdout, re.M), result.stdout
  assert "random" not in result.stderr + result.stdout
  assert "Metadata file does not exist" not in result.stderr  # Orbax's warning for an items directory, kept out
  # With no load path, the same run_name decodes that run's latest checkpoint, and says which.
  same, same_lines = _decode_py("run_name=trained", f"base_output_directory={trained_run}")
  assert same.returncode == 0, same.stderr[-3000:]
  assert f"Decoding the latest checkpoint of run trained: {items}" in same.stdout + same.stderr
  assert same_lines == lines
  # A full train state's params (load_full_state_path) decode the same (autoregressive_decode_assert checks it).
  full, full_lines = _decode_py(
    "run_name=d",
    f"base_output_directory={trained_run}",
    f"load_full_state_path={items}",
    f"autoregressive_decode_assert={lines[0][1]}",
  )
  assert full.returncode == 0, full.stderr[-3000:]
  assert full_lines == lines


def test_checkpoint_of_another_model_is_a_clear_error(trained_run):
  items = trained_run / "trained" / "checkpoints" / "2" / "items"
  result, _ = _decode_py(
    "run_name=d", f"base_output_directory={trained_run}", f"load_parameters_path={items}", "base_emb_dim=64"
  )
  assert result.returncode == 2
  assert "does not fit the model" in result.stderr.strip().splitlines()[-1] and "Traceback" not in result.stderr


def test_random_params_warn_and_still_decode(tmp_path):
  result, lines = _decode_py(
    "run_name=fresh", f"base_output_directory={tmp_path}", "dataset_type=synthetic", "autoregressive_decode_assert=no"
  )
  assert "the output is random" in result.stdout + result.stderr
  assert len(lines) == 2
  assert result.returncode == 2 and "Error: generated text mismatch" in result.stderr  # the assert key's check


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", [[], ["ici_fsdp_parallelism=4", "ici_autoregressive_parallelism=2"]])
def test_eight_devices_give_the_one_device_outputs(tmp_path, parallelism):
  """8 rows on one device, then one row per device: the batch (fsdp) and the heads (autoregressive) sharded."""
  args = ("run_name=fresh", f"base_output_directory={tmp_path}", "dataset_type=synthetic")
  one, one_lines = _decode_py(*args, "per_device_batch_size=8")
  eight, eight_lines = _decode_py(
    *args, "per_device_batch_size=1", *parallelism, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  )
  assert one.returncode == 0 and eight.returncode == 0, one.stderr[-2000:] + eight.stderr[-2000:]
  assert "Mesh: 8 devices" in eight.stdout + eight.stderr
  assert len(one_lines) == 8 and eight_lines == one_lines


@pytest.mark.slow
def test_two_processes_give_the_one_device_outputs_printed_once(tmp_path):
  """2 processes x 4 devices (one slice each: the rows split across processes) sample what 1 device does."""
  args = ("run_name=fresh", f"base_output_directory={tmp_path}", "dataset_type=synthetic")
  one, one_lines = _decode_py(*args, "per_device_batch_size=8")
  command = [
    sys.executable,
    DECODE_PY,
    "MaxText/configs/base.yml",
    *tiny_args(*DECODE_KEYS, *args, "per_device_batch_size=1"),
  ]
  codes, outputs = finish_processes(start_cpu_processes(command))
  assert one.returncode == 0 and codes == [0, 0], one.stderr[-2000:] + "\n".join(o[-2000:] for o in outputs)
  assert "Mesh: 8 devices in 2 slices" in outputs[0]
  assert _OUTPUT_LINE.findall(outputs[0]) == one_lines and len(one_lines) == 8
  assert _OUTPUT_LINE.findall(outputs[1]) == []  # info lines print on process 0 only
