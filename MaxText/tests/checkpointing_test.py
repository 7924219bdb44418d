"""Checkpoints: exact resume, completed runs, preemption, damaged checkpoints, model mismatches, loading."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from MaxText.checkpoints import checkpointing
from MaxText.errors import UserError
from MaxText.runtime import preemption
from MaxText.tests.helpers import REPO_ROOT, TRAIN_PY, read_metrics, run_train, tiny_args, tiny_config


def _ok(result):
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _losses(metrics):
  return [m["learning/loss"] for m in metrics]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted 10-step run (checkpoints at 0, 3, 6, 9)."""
  tmp = tmp_path_factory.mktemp("reference")
  _, metrics = run_train(tmp, "ref", "steps=10", "checkpoint_period=3")
  assert [m["step"] for m in metrics] == list(range(10))
  return tmp, metrics


def test_raising_steps_continues_exactly_where_it_stopped(tmp_path, reference):
  _, ref = reference
  _ok(run_train(tmp_path, "grow", "steps=5", "checkpoint_period=3", "learning_rate_schedule_steps=10")[0])
  assert sorted(os.listdir(tmp_path / "grow" / "checkpoints")) == ["0", "3", "4"]
  result, metrics = run_train(tmp_path, "grow", "steps=10", "checkpoint_period=3", "learning_rate_schedule_steps=10")
  _ok(result)
  assert "Restored the checkpoint of step 4" in result.stdout
  assert [m["step"] for m in metrics] == list(range(10))  # the file continues without a hole or a repeat
  assert _losses(metrics) == _losses(ref)  # bitwise


@pytest.mark.slow
def test_upstream_checkpointing_flow_without_a_save_on_completion(tmp_path):
  """Upstream's test_checkpointing.sh: the same 5-step command twice; the second restores step 3 and trains step 4."""
  args = ("steps=5", "checkpoint_period=3", "save_checkpoint_on_completion=false")
  _, first = run_train(tmp_path, "upstream", *args, metrics_name="first")
  assert sorted(os.listdir(tmp_path / "upstream" / "checkpoints")) == ["0", "3"]
  result, second = run_train(tmp_path, "upstream", *args, metrics_name="second")
  _ok(result)
  assert "Restored the checkpoint of step 3" in result.stdout
  assert [m["step"] for m in second] == [4]
  assert _losses(second) == _losses(first)[4:]  # bitwise


def test_a_finished_run_says_so_and_exits_zero(tmp_path):
  _ok(run_train(tmp_path, "done", "steps=3")[0])
  result, metrics = run_train(tmp_path, "done", "steps=3")
  _ok(result)
  assert "already complete: 3 of steps=3 done" in result.stdout
  assert len(metrics) == 3


def test_a_first_ctrl_c_says_what_happens_and_a_second_interrupts(capsys):
  watcher = preemption.PreemptionWatcher()
  try:
    watcher._on_signal(signal.SIGINT, None)  # pylint: disable=protected-access
    assert watcher.should_stop(0)
    assert "Ctrl-C again interrupts at once" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  finally:
    watcher.close()


def test_sigterm_saves_the_current_step_and_exits_zero(tmp_path, reference):
  _, ref = reference
  metrics_path = tmp_path / "term.jsonl"
  argv = [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", "run_name=term"]
  argv += tiny_args(f"base_output_directory={tmp_path}", f"metrics_file={metrics_path}", "learning_rate=1e-2")
  argv += ["checkpoint_period=1000", "learning_rate_schedule_steps=10", "steps=100000"]
  proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while (
    proc.poll() is None and time.time() < deadline and len(read_metrics(metrics_path) if metrics_path.exists() else []) < 3
  ):
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  stdout, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 0, stderr[-3000:]
  last = int(read_metrics(metrics_path)[-1]["step"])
  assert f"Stopping because received SIGTERM: the last step is {last}; saved the checkpoint of step {last}" in stdout
  assert str(last) in os.listdir(tmp_path / "term" / "checkpoints")
  result, metrics = run_train(
    tmp_path, "term", f"steps={last + 3}", "checkpoint_period=1000", "learning_rate_schedule_steps=10", metrics_name="term"
  )
  _ok(result)
  assert f"Restored the checkpoint of step {last}" in result.stdout
  assert [m["step"] for m in metrics] == list(range(last + 3))  # continues at last + 1, no hole, no repeat
  assert _losses(metrics)[:10] == _losses(ref)[: min(10, last + 3)]


@pytest.mark.parametrize("damage", ["truncate_data", "truncate_metadata", "delete_metadata"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, reference, damage):
  _, ref = reference
  _ok(run_train(tmp_path, "dmg", "steps=8", "checkpoint_period=3", "learning_rate_schedule_steps=10")[0])
  items = tmp_path / "dmg" / "checkpoints" / "7" / "items"
  if damage == "truncate_data":
    for root, _, files in os.walk(items / "ocdbt.process_0"):
      for name in files:
        with open(os.path.join(root, name), "r+b") as f:
          f.truncate(10)
  elif damage == "truncate_metadata":
    os.truncate(items / "_METADATA", 100)
  else:
    os.remove(items / "_METADATA")
  result, metrics = run_train(tmp_path, "dmg", "steps=10", "checkpoint_period=3", "learning_rate_schedule_steps=10")
  _ok(result)
  assert "checkpoint of step 7" in result.stderr and "is unreadable" in result.stderr
  assert "Restored the checkpoint of step 6" in result.stdout
  assert os.listdir(tmp_path / "dmg" / "corrupted_checkpoints")  # moved aside, not deleted
  assert _losses(metrics) == _losses(ref)


def _obeying_file_permissions() -> list[str]:
  """A command prefix under which file permissions apply: root ignores them unless it gives up the
  capabilities that override them."""
  if os.geteuid() != 0:
    return []
  prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
  if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"], check=False).returncode != 0:
    pytest.skip("running as root without setpriv: cannot make a file unreadable")
  return prefix


def test_an_unreadable_latest_checkpoint_stops_the_run_and_moves_nothing(tmp_path):
  _ok(run_train(tmp_path, "perm", "steps=5", "checkpoint_period=2")[0])
  metadata = tmp_path / "perm" / "checkpoints" / "4" / "items" / "_METADATA"
  argv = [*_obeying_file_permissions(), sys.executable, TRAIN_PY, "MaxText/configs/base.yml", "run_name=perm"]
  argv += tiny_args(f"base_output_directory={tmp_path}", "steps=7", "checkpoint_period=2")
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  os.chmod(metadata, 0)  # what a wrong owner or a storage permission error gives: the files are fine
  try:
    result = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
  finally:
    os.chmod(metadata, 0o644)
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, lines
  assert lines[0].startswith(f"Error: cannot read the checkpoint {tmp_path}/perm/checkpoints/4 (PermissionError: ")
  assert "nothing was moved" in lines[0]
  assert sorted(os.listdir(tmp_path / "perm" / "checkpoints"), key=int) == ["0", "2", "4"]
  assert not os.path.exists(tmp_path / "perm" / "corrupted_checkpoints")


@pytest.mark.parametrize(
  "change,expected",
  [
    ("base_num_decoder_layers=3", "params/decoder/layers/mlp/wi_0/kernel: checkpoint (32, 2, 64) vs model (32, 3, 64)"),
    ("scan_layers=false", "params/decoder/layers_0/mlp/wi_0/kernel: in the model, not in the checkpoint"),
  ],
)
def test_a_checkpoint_of_another_model_is_a_clear_error(tmp_path, change, expected):
  _ok(run_train(tmp_path, "mm", "steps=2")[0])
  result, _ = run_train(tmp_path, "mm", "steps=4", change)
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "does not fit the model" in lines[0] and expected in lines[0], lines


def test_load_parameters_and_full_state(tmp_path, reference):
  ref_dir, ref = reference
  items = ref_dir / "ref" / "checkpoints" / "9" / "items"
  relative = os.path.relpath(items, REPO_ROOT)  # from the cwd of train.py (Orbax itself reads absolute paths only)
  result, tuned = run_train(tmp_path, "tune", "steps=2", f"load_parameters_path={relative}")
  _ok(result)
  assert "Loaded parameters from" in result.stdout
  assert [m["step"] for m in tuned] == [0, 1]
  assert tuned[0]["learning/loss"] < ref[0]["learning/loss"] - 0.05  # trained params, fresh optimizer
  result, full = run_train(tmp_path, "full", "steps=12", f"load_full_state_path={items}")
  _ok(result)
  assert [m["step"] for m in full] == [10, 11]
  result, _ = run_train(tmp_path, "bad", "steps=2", f"load_parameters_path={tmp_path}/nothing")
  assert result.returncode == 2 and "load_parameters_path=" in result.stderr and "does not exist" in result.stderr


@pytest.mark.slow  # two 8-device train.py runs: about 20 s of the unit suite on 2 cores
def test_restore_onto_a_different_mesh(tmp_path):
  eight = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  four = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  common = ["steps=6", "checkpoint_period=3", "learning_rate_schedule_steps=6", "base_num_kv_heads=4"]
  _, ref = run_train(tmp_path, "mesh_ref", *common, "per_device_batch_size=1", env=eight)
  _ok(run_train(tmp_path, "mesh", "steps=4", *common[1:], "per_device_batch_size=1", env=eight, metrics_name="m8")[0])
  # 8 devices of fsdp -> 4 devices of tensor parallelism, same global batch of 8 rows.
  result, metrics = run_train(
    tmp_path,
    "mesh",
    *common,
    "per_device_batch_size=2",
    "ici_fsdp_parallelism=1",
    "ici_tensor_parallelism=4",
    env=four,
    metrics_name="m4",
  )
  _ok(result)
  assert "Restored the checkpoint of step 3" in result.stdout
  assert [m["step"] for m in metrics] == [4, 5]
  np.testing.assert_allclose(_losses(metrics), _losses(ref)[4:], rtol=1e-5)


def test_load_paths_that_are_not_training_checkpoints(tmp_path, reference):
  ref_dir, _ = reference
  step_dir = ref_dir / "ref" / "checkpoints" / "9"  # the step directory instead of its items
  result, _ = run_train(tmp_path, "wrong", "steps=2", f"load_full_state_path={step_dir}")
  assert result.returncode == 2 and "is not an Orbax checkpoint's items directory" in result.stderr
  params_only = tmp_path / "params_only"
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  restored = ocp.PyTreeCheckpointer().restore(str(step_dir / "items"))
  ocp.PyTreeCheckpointer().save(str(params_only), {"params": restored["params"]})
  result, _ = run_train(tmp_path, "ponly", "steps=2", f"load_full_state_path={params_only}")
  assert result.returncode == 2 and "holds params only (no optimizer state); use load_parameters_path" in result.stderr


def test_resuming_with_another_dataset_type_is_a_clear_error(tmp_path):
  _ok(run_train(tmp_path, "kind", "steps=2", "dataset_type=synthetic")[0])
  result, _ = run_train(tmp_path, "kind", "steps=4")
  assert result.returncode == 2
  assert "data position is for dataset_type=synthetic, this run reads dataset_type=embedded" in result.stderr
  assert "or data_position_on_resume=reset restores the model and optimizer" in result.stderr
  result, metrics = run_train(tmp_path, "kind", "steps=4", "data_position_on_resume=reset")
  _ok(result)
  assert "Restored the checkpoint of step 1" in result.stdout and "the data position is not" in result.stdout
  assert [m["step"] for m in metrics] == [0, 1, 2, 3]


def test_a_grain_run_continues_on_tfds_with_a_reset_data_position(tmp_path):
  """Upstream's test_checkpoint_compatibility.sh: train on Grain (the ArrayRecord files of a TFDS dataset), then go on
  with dataset_type=tfds (its TFRecord twin). Refused by default; data_position_on_resume=reset restores the model and
  optimizer and reads tfds from its start."""
  from MaxText.input_pipeline import sample_datasets  # pylint: disable=import-outside-toplevel

  flags = {k: v.split() for k, v in sample_datasets.write_all(str(tmp_path / "data"), limit=60).items()}
  _ok(run_train(tmp_path, "compat", "steps=3", "checkpoint_period=2", *flags["grain (TFDS files)"])[0])
  result, _ = run_train(tmp_path, "compat", "steps=5", *flags["tfds (TFRecord)"])
  assert result.returncode == 2
  assert "data position is for dataset_type=grain, this run reads dataset_type=tfds" in result.stderr
  result, metrics = run_train(tmp_path, "compat", "steps=5", *flags["tfds (TFRecord)"], "data_position_on_resume=reset")
  _ok(result)
  assert "Restored the checkpoint of step 2" in result.stdout
  assert "data_position_on_resume=reset: the model and optimizer are restored; the data position is not" in result.stdout
  resumed = [m for m in metrics if m["step"] >= 3]
  assert [m["step"] for m in resumed] == [3, 4] and all(np.isfinite(m["learning/loss"]) for m in resumed)


def test_a_data_position_of_another_dataset_type_of_the_same_kind_is_refused():
  """grain and embedded both resume by rows: the saved dataset_type tells them apart."""
  config = tiny_config()  # embedded
  grain_state = {"kind": "rows", "rows": {}, "dataset_type": "grain"}
  with pytest.raises(UserError, match="data position is for dataset_type=grain, this run reads dataset_type=embedded"):
    checkpointing.restore_data_position(config, None, grain_state)
  checkpointing.restore_data_position(config.replace(data_position_on_resume="reset"), None, grain_state)  # no error


def test_data_used_up_with_a_checkpoint_every_step(tmp_path):
  from MaxText.input_pipeline import sample_datasets  # pylint: disable=import-outside-toplevel

  files = sample_datasets.write_array_records(
    str(tmp_path / "small"), [f"document {i} " * 10 for i in range(40)], num_shards=1
  )
  result, metrics = run_train(
    tmp_path,
    "every",
    "steps=100000",
    "checkpoint_period=1",
    "num_epoch=1",
    "dataset_type=grain",
    f"grain_train_files={files[0]}",
  )
  _ok(result)
  assert "Stopping because the training data is used up (num_epoch=1)" in result.stdout
  last = int(metrics[-1]["step"])
  assert f"the last step is {last};" in result.stdout
  assert max(int(d) for d in os.listdir(tmp_path / "every" / "checkpoints")) == last
