"""The real `python3 MaxText/train.py` on a tiny model: log line, metrics file, TensorBoard, repeatability."""

import glob
import os
import re
import struct

import pytest
from tensorboardX.proto import event_pb2

from MaxText.tests.helpers import run_train

LOG_LINE = re.compile(
  r"^completed step: (\d+), seconds: \d+\.\d{3}, TFLOP/s/device: \d+\.\d{3}, Tokens/s/device: \d+\.\d{3}, "
  r"total_weights: (\d+), loss: (\d+\.\d{3})(, .*)?$"
)
GRAD_NORM = re.compile(r", grad_norm: (\d+\.\d{3})")
UPSTREAM_KEYS = {
  "step",
  "run_name",
  "learning/loss",
  "learning/total_weights",
  "learning/grad_norm",
  "learning/raw_grad_norm",
  "learning/param_norm",
  "learning/current_learning_rate",
  "perf/step_time_seconds",
  "perf/per_device_tflops",
  "perf/per_device_tflops_per_sec",
  "perf/per_device_tokens",
  "perf/per_device_tokens_per_sec",
}


def _train(tmp_path, run_name, *args, env=None, own_process=False):
  result, metrics = run_train(tmp_path, run_name, *args, env=env, own_process=own_process)
  assert result.returncode == 0, result.stderr[-3000:]
  return result, metrics


def _tensorboard_scalars(directory) -> dict:
  """{tag: [values]} read from the TFRecord event files that tensorboardX wrote."""
  scalars = {}
  for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
    with open(path, "rb") as f:
      data = f.read()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset : offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append(value.simple_value)
  return scalars


def test_train_logs_every_step_everywhere(tmp_path):
  result, metrics = _train(tmp_path, "logs", "steps=6", "enable_tensorboard=true", "gradient_clipping_threshold=1.0")
  lines = [m for m in map(LOG_LINE.match, result.stdout.splitlines()) if m]
  assert [int(m.group(1)) for m in lines] == list(range(6))
  assert all(int(m.group(2)) == 2 * 32 for m in lines)
  assert [float(m.group(3)) for m in lines] == [round(m["learning/loss"], 3) for m in metrics]
  # The console shows the gradient norm before clipping; the metrics file keeps both.
  console_norms = [float(GRAD_NORM.search(m.group(0)).group(1)) for m in lines]
  assert console_norms == [round(m["learning/raw_grad_norm"], 3) for m in metrics]
  assert [m["learning/grad_norm"] for m in metrics] == [min(m["learning/raw_grad_norm"], 1.0) for m in metrics]
  assert max(console_norms) > 1.0  # clipping was active (gradient_clipping_threshold=1.0)
  assert all(UPSTREAM_KEYS | {"learning/update_norm"} <= set(m) for m in metrics)
  assert [m["step"] for m in metrics] == [float(s) for s in range(6)]
  assert metrics[-1]["learning/loss"] < metrics[0]["learning/loss"]
  scalars = _tensorboard_scalars(tmp_path / "logs" / "tensorboard")
  assert len(scalars["learning/loss"]) == 6 and len(scalars["perf/per_device_tokens_per_sec"]) == 6
  assert os.path.isfile(tmp_path / "logs" / "config.yml")
  assert "steps: 6  # command line" in (tmp_path / "logs" / "config.yml").read_text()


@pytest.mark.slow
def test_same_command_gives_the_same_losses_and_seeds_change_them(tmp_path):
  _, first = _train(tmp_path, "a", "steps=3")
  _, again = _train(tmp_path, "b", "steps=3")
  _, reseeded_data = _train(tmp_path, "c", "steps=3", "data_shuffle_seed=1")
  _, reseeded_init = _train(tmp_path, "d", "steps=3", "init_weights_seed=1")
  losses = [[m["learning/loss"] for m in run] for run in (first, again, reseeded_data, reseeded_init)]
  assert losses[0] == losses[1]
  assert losses[2] != losses[0] and losses[3] != losses[0]


@pytest.mark.parametrize("extra", [["dataset_type=synthetic"], ["gradient_accumulation_steps=2"], ["decoder_block=default"]])
def test_variants_train(tmp_path, extra):
  _, metrics = _train(tmp_path, "variant", "steps=3", *extra)
  assert len(metrics) == 3 and all(m["learning/loss"] > 0 for m in metrics)


def test_compilation_cache_is_written(tmp_path):
  cache = tmp_path / "jax_cache"
  _train(tmp_path, "cached", "steps=2", f"jax_cache_dir={cache}", own_process=True)
  assert os.listdir(cache)
