"""Training on 8 forced CPU devices: real sharding of params, and the same losses as on one device."""

import json

import numpy as np

from MaxText.tests.helpers import BASE_YML, run_python, tiny_args

# Runs train_loop in a fresh process (the device count is fixed at JAX start-up) and reports the
# per-device shard shape of every parameter next to the metrics file.
_CHILD = """
import json, sys
import jax
from MaxText import pyconfig, train
config = pyconfig.initialize(sys.argv[1:], required_keys=("run_name",))
state = train.train_loop(config)
leaves = jax.tree_util.tree_leaves_with_path(state.params)
shapes = {jax.tree_util.keystr(p): list(x.sharding.shard_shape(x.shape)) for p, x in leaves}
json.dump({"devices": jax.device_count(), "shard_shapes": shapes}, open(config.metrics_file + ".shapes.json", "w"))
"""


def _run(tmp_path, name, devices, *args):
  metrics = tmp_path / f"{name}.jsonl"
  overrides = tiny_args(
    f"base_output_directory={tmp_path}", "steps=5", "learning_rate=1e-2", f"metrics_file={metrics}", *args
  )
  argv = ["-c", _CHILD, "train", BASE_YML, f"run_name={name}", *overrides]
  result = run_python(
    argv, env_extra={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
  )
  assert result.returncode == 0, result.stderr[-3000:]
  with open(f"{metrics}.shapes.json", encoding="utf-8") as f:
    report = json.load(f)
  with open(metrics, encoding="utf-8") as f:
    lines = [json.loads(line) for line in f]
  return lines, report


def test_fsdp_tensor_sharding_matches_one_device_losses(tmp_path):
  one, one_report = _run(tmp_path, "one", 1, "per_device_batch_size=8")
  eight, report = _run(tmp_path, "eight", 8, "per_device_batch_size=1", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
  assert one_report["devices"] == 1 and report["devices"] == 8
  assert [m["learning/total_weights"] for m in eight] == [8 * 32] * 5
  np.testing.assert_allclose([m["learning/loss"] for m in eight], [m["learning/loss"] for m in one], rtol=1e-5)
  assert one[-1]["learning/loss"] < one[0]["learning/loss"]

  shards = report["shard_shapes"]
  # embed -> fsdp (4); heads, mlp, vocab -> tensor (2); the scanned layer axis is not sharded.
  assert shards["['token_embedder']['embedding']"] == [4096 // 2, 32 // 4]
  assert shards["['decoder']['layers']['self_attention']['query']['kernel']"] == [32 // 4, 2, 4 // 2, 8]
  assert shards["['decoder']['layers']['self_attention']['key']['kernel']"] == [32 // 4, 2, 2 // 2, 8]
  assert shards["['decoder']['layers']['self_attention']['out']['kernel']"] == [4 // 2, 2, 8, 32 // 4]
  assert shards["['decoder']['layers']['mlp']['wi_0']['kernel']"] == [32 // 4, 2, 64 // 2]
  assert shards["['decoder']['layers']['mlp']['wo']['kernel']"] == [64 // 2, 2, 32 // 4]
  assert shards["['decoder']['logits_dense']['kernel']"] == [32 // 4, 4096 // 2]
  assert one_report["shard_shapes"]["['token_embedder']['embedding']"] == [4096, 32]


def test_fractional_per_device_batch_trains_on_fewer_rows(tmp_path):
  lines, _ = _run(tmp_path, "frac", 8, "per_device_batch_size=0.25", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
  # 0.25 x 8 devices = 2 rows of 32 tokens per step.
  assert [m["learning/total_weights"] for m in lines] == [2 * 32] * 5
  assert lines[0]["perf/per_device_tokens"] == 0.25 * 32
