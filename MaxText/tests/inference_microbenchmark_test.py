"""MaxText/inference_microbenchmark.py: prefill at each length and the decode step, timed, with upstream's JSON."""

import json

import pytest

from MaxText import inference_microbenchmark
from MaxText.errors import UserError
from MaxText.tests.helpers import run_python, tiny_args, tiny_config

SCRIPT = "MaxText/inference_microbenchmark.py"


def test_it_times_prefill_and_generate_and_writes_upstreams_json(tmp_path):
  log = tmp_path / "results.json"
  args = tiny_args(
    f"base_output_directory={tmp_path}",
    "max_target_length=64",
    "inference_microbenchmark_prefill_lengths=8,16",
    "inference_microbenchmark_loop_iters=3",
    f"inference_microbenchmark_log_file_path={log}",
    "inference_microbenchmark_stages=prefill,insert,generate",  # upstream's scripts name insert
  )
  result = run_python([SCRIPT, "MaxText/configs/base.yml", "run_name=mb", *args])
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads(log.read_text())
  assert set(results["Prefill"]) == {"8", "16"}
  for prefill in results["Prefill"].values():
    assert prefill["prefill_time_in_ms"] > 0 and prefill["prefill_tflops_per_sec_per_device"] > 0
  # twice the tokens: about twice the FLOPs (the attention part grows faster)
  assert 2 <= results["Prefill"]["16"]["prefill_total_tflops"] / results["Prefill"]["8"]["prefill_total_tflops"] < 2.2
  ar = results["AutoRegressive"]
  assert ar["global_batch_size"] == 2 and ar["step_in_ms"] > 0
  assert ar["total_throughput_tokens_per_second"] == pytest.approx(2 / (ar["step_in_ms"] / 1e3))
  assert "Prefill length 16:" in result.stdout and "AutoRegressive:" in result.stdout
  assert "Stage insert: prefill writes the decode cache itself here" in result.stdout


@pytest.mark.parametrize(
  "arg, message",
  [
    ("inference_microbenchmark_prefill_lengths=8,x", "must be comma-separated lengths in [1, max_target_length=32]"),
    ("inference_microbenchmark_prefill_lengths=64", "must be comma-separated lengths in [1, max_target_length=32]"),
    ("inference_microbenchmark_stages=prefill,decode", "must be stages among prefill, insert, generate"),
    ("inference_microbenchmark_loop_iters=40", "generate steps after a 8-token prompt need max_target_length >= 49"),
  ],
)
def test_wrong_keys_are_one_line(arg, message):
  config = tiny_config("inference_microbenchmark_prefill_lengths=8", arg)
  with pytest.raises(UserError) as error:
    inference_microbenchmark.parse_keys(config)
  assert message in str(error.value) and "\n" not in str(error.value)
