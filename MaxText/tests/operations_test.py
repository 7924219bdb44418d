"""Operations of long runs: the on-demand profiler server and Orbax's checkpoint event log."""

import re
import socket

import pytest

from MaxText.diagnostics import loop as diagnostics_loop
from MaxText.tests.helpers import run_python, run_train, tiny_config


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_enable_jax_profiler_serves_traces_on_its_port_while_the_loop_runs(capsys):
  port = _free_port()
  diagnostics = diagnostics_loop.LoopDiagnostics(tiny_config("enable_jax_profiler=true", f"jax_profiler_port={port}"), 0)
  try:
    with socket.create_connection(("127.0.0.1", port), timeout=5):
      pass  # the server accepts: a client (jax.collect_profile, TensorBoard) can ask it for a trace
    assert f"Profiler server on port {port} (process 0): capture a trace" in capsys.readouterr().out
  finally:
    diagnostics.close()


def test_a_profiler_server_that_cannot_start_is_a_warning_not_a_failure(capsys):
  """jax runs one profiler server per process: a second one (a second run in one process) cannot start."""
  port = _free_port()
  first = diagnostics_loop.LoopDiagnostics(tiny_config("enable_jax_profiler=true", f"jax_profiler_port={port}"), 0)
  try:
    second = diagnostics_loop.LoopDiagnostics(tiny_config("enable_jax_profiler=true", f"jax_profiler_port={port}"), 0)
    second.close()
  finally:
    first.close()
  assert first.profiler_server is not None and second.profiler_server is None
  assert f"enable_jax_profiler: no profiler server on port {port}" in capsys.readouterr().err


def test_the_checkpoint_standard_logger_logs_each_save_and_restore(tmp_path):
  flags = ("checkpoint_period=2", "enable_checkpoint_standard_logger=true")
  # No Google Cloud credentials here: the cloud logger says so in one line, and the standard one goes on alone.
  saved, _ = run_train(tmp_path, "log", "steps=3", *flags, "enable_checkpoint_cloud_logger=true")
  assert saved.returncode == 0, saved.stderr[-2000:]
  assert "enable_checkpoint_cloud_logger: no Google Cloud credentials here" in saved.stderr
  events = [line for line in saved.stdout.splitlines() if line.startswith("Orbax checkpoint event: {")]
  assert len(events) == 2 and all('"event_type": "save"' in e and '"step": ' in e for e in events)  # steps 0, 2
  restored, _ = run_train(tmp_path, "log", "steps=4", *flags)
  assert restored.returncode == 0, restored.stderr[-2000:]
  assert any('"event_type": "restore"' in line for line in restored.stdout.splitlines())
  quiet, _ = run_train(tmp_path, "quiet", "steps=1")
  assert "Orbax checkpoint event" not in quiet.stdout


def test_the_cloud_logger_without_its_package_is_one_line(monkeypatch, capsys):
  import sys  # pylint: disable=import-outside-toplevel

  from MaxText.checkpoints import checkpoint_loggers  # pylint: disable=import-outside-toplevel

  for module in ("google.cloud.logging", "orbax.checkpoint._src.logging.cloud_logger"):
    monkeypatch.setitem(sys.modules, module, None)  # as if google-cloud-logging were not installed
  assert checkpoint_loggers.cloud_logger("run") is None
  assert "the google-cloud-logging package is not installed (pip install google-cloud-logging)" in capsys.readouterr().err


def _wandb_history(run_file) -> list[dict]:
  """The history records of an offline W&B run file: LevelDB-log blocks of protobuf Records after a 7-byte header
  (wandb 0.31 has no Python reader of its own)."""
  import json  # pylint: disable=import-outside-toplevel
  import struct  # pylint: disable=import-outside-toplevel

  from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel

  data, pos, block, records, pending = run_file.read_bytes(), 7, 32768, [], b""
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
    chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
    if kind == 1:  # a whole record
      records.append(chunk)
    elif kind in (2, 3):  # its first or middle part
      pending += chunk
    elif kind == 4:  # its last part
      records.append(pending + chunk)
      pending = b""
  history = []
  for raw in records:
    record = wandb_internal_pb2.Record()
    record.ParseFromString(raw)
    if record.WhichOneof("record_type") == "history":
      history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
  return history


def test_wandb_offline_writes_the_runs_step_and_eval_metrics(tmp_path):
  pytest.importorskip("wandb")
  result, metrics = run_train(
    tmp_path, "wb", "steps=4", "enable_wandb=true", "eval_interval=2", "eval_steps=1", env={"WANDB_MODE": "offline"}
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert "Weights & Biases: run wb (" in result.stdout
  run_files = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
  assert len(run_files) == 1
  history = _wandb_history(run_files[0])
  assert [h["_step"] for h in history] == [0, 1, 2, 3]
  assert [h["learning/loss"] for h in history] == [m["learning/loss"] for m in metrics]
  assert [h["_step"] for h in history if "eval/loss" in h] == [1, 3]


def test_enable_wandb_without_wandb_is_one_line(tmp_path):
  fake = tmp_path / "no_wandb" / "wandb"
  fake.mkdir(parents=True)
  (fake / "__init__.py").write_text("raise ImportError('not installed')\n")
  result, _ = run_train(tmp_path, "nowb", "steps=1", "enable_wandb=true", env={"PYTHONPATH": str(fake.parent)})
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert "enable_wandb=true needs the wandb package: pip install wandb" in result.stderr


def test_goodput_events_map_to_ml_goodput_measurements_records():
  """What goodput_cloud sends: ml-goodput-measurement's own GoodputRecorder, over a stand-in for its Cloud Logging
  writer (no Cloud Logging here), gets each local event as the entries its calculator reads."""
  from ml_goodput_measurement import goodput as library  # pylint: disable=import-outside-toplevel

  from MaxText.runtime import goodput_cloud  # pylint: disable=import-outside-toplevel

  class Entries:
    def __init__(self):
      self.written = []

    def write_cloud_logging_entry(self, entry):
      self.written.append(entry)

    def flush(self):
      pass

  entries = Entries()
  mirror = goodput_cloud.CloudMirror(library.GoodputRecorder("job", "goodput", logging_enabled=True, cloud_logger=entries))
  mirror.event("job_start", 100.0, {})
  mirror.event("phase", 110.0, {"name": "compile", "seconds": 8.0})
  mirror.event("step", 112.0, {"step": 0, "seconds": 2.0, "data_seconds": 0.5})
  mirror.event("phase", 113.0, {"name": "checkpoint_save", "seconds": 1.0})
  mirror.event("job_end", 120.0, {})
  mirror.close()
  flat = {(k, v) for entry in entries.written for k, v in entry.items() if k != "job_name"}
  assert ("job_start_time", 100.0) in flat and ("job_end_time", 120.0) in flat
  assert ("step_count", 0) in flat and ("step_start_time", 110.0) in flat
  assert ("training_prep_start_time", 102.0) in flat and ("training_prep_end_time", 110.0) in flat
  assert ("data_loading_start_time", 110.0) in flat and ("data_loading_end_time", 110.5) in flat
  assert ("custom_badput_event_type", "checkpoint_save") in flat


def test_goodput_of_a_run_killed_once_and_resumed(tmp_path):
  """Killed while saving step 6 (checkpoints 0 and 3 are complete), then resumed from 3: steps 4-6 ran twice."""
  from MaxText.runtime import goodput  # pylint: disable=import-outside-toplevel

  flags = ("steps=9", "checkpoint_period=3", "enable_goodput_recording=true")
  killed, _ = run_train(tmp_path, "gp", *flags, env={"MAXTEXT_FAULT_INJECTION": "kill_during_save:6"})
  assert killed.returncode != 0
  resumed, _ = run_train(tmp_path, "gp", *flags)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "Restored the checkpoint of step 3" in resumed.stdout
  assert "enable_goodput_recording: events go to the local file only (no Google Cloud credentials" in resumed.stdout
  events = goodput.read(tmp_path / "gp" / goodput.EVENTS)
  report = goodput.report(events)
  assert report.attempts == 2 and report.lost_steps == 3  # steps 4, 5 and 6 of the killed attempt
  assert 0 < report.goodput < 1 and report.badput["lost"] > 0 and report.badput["compile"] > 0
  assert report.badput["restore"] > 0 and report.badput["checkpoint_save"] > 0
  assert report.productive + sum(report.badput.values()) == pytest.approx(report.wall, rel=1e-6)
  assert f"Goodput {100 * report.goodput:.1f}% over 2 attempt(s)" in resumed.stdout  # the end-of-run report
  cli = run_python(["MaxText/runtime/goodput.py", str(tmp_path / "gp")])
  assert cli.returncode == 0 and "badput, steps lost to a restart: " in cli.stdout and ", 3 step(s)" in cli.stdout
  missing = run_python(["MaxText/runtime/goodput.py", str(tmp_path / "nothing")])
  assert missing.returncode == 2 and "was the run recorded with enable_goodput_recording=true?" in missing.stderr


def test_monitor_goodput_logs_the_goodput_so_far(tmp_path):
  flags = ("steps=4", "enable_goodput_recording=true", "monitor_goodput=true", "goodput_upload_interval_seconds=1")
  result, _ = run_train(tmp_path, "mon", *flags, env={"MAXTEXT_FAULT_INJECTION": ""})
  assert result.returncode == 0, result.stderr[-2000:]
  assert re.search(r"^Goodput so far: \d+\.\d%$", result.stdout, re.M)


def test_goodput_recording_needs_a_local_run_directory():
  from MaxText.errors import UserError  # pylint: disable=import-outside-toplevel
  from MaxText.runtime import goodput  # pylint: disable=import-outside-toplevel

  with pytest.raises(UserError, match=r"appends its events to a local file, and the run directory gs://b/r is not local"):
    goodput.Recorder("gs://b/r")
