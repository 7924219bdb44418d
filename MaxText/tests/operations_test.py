"""Operations of long runs: the on-demand profiler server and Orbax's checkpoint event log."""

import socket

from MaxText.diagnostics import loop as diagnostics_loop
from MaxText.tests.helpers import run_train, tiny_config


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
  saved, _ = run_train(tmp_path, "log", "steps=3", *flags)
  assert saved.returncode == 0, saved.stderr[-2000:]
  events = [line for line in saved.stdout.splitlines() if line.startswith("Orbax checkpoint event: {")]
  assert len(events) == 2 and all('"event_type": "save"' in e and '"step": ' in e for e in events)  # steps 0, 2
  restored, _ = run_train(tmp_path, "log", "steps=4", *flags)
  assert restored.returncode == 0, restored.stderr[-2000:]
  assert any('"event_type": "restore"' in line for line in restored.stdout.splitlines())
  quiet, _ = run_train(tmp_path, "quiet", "steps=1")
  assert "Orbax checkpoint event" not in quiet.stdout
