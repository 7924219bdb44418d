"""A process of a 2-process job (2 CPU devices each) SIGKILLed in the middle of a step, or while an asynchronous save
is in flight: the other one exits 75 within distributed_heartbeat_timeout with one line naming it and saves nothing;
the same command resumes from the newest complete checkpoint with the losses of an uninterrupted run, bitwise."""

import os
import re
import signal
import sys
import time

import pytest

from MaxText.runtime import fault_injection, peer_monitor
from MaxText.tests.helpers import TRAIN_PY, finish_processes, read_metrics, start_cpu_processes, tiny_args

STEPS = 9
TIMEOUT_S = 10  # distributed_heartbeat_timeout


def _command(tmp_path, run_name, *flags):
  args = tiny_args(
    f"base_output_directory={tmp_path}",
    f"metrics_file={tmp_path / run_name}.jsonl",
    f"steps={STEPS}",
    "checkpoint_period=3",
    "learning_rate=1e-2",
    "per_device_batch_size=1",
    f"distributed_heartbeat_timeout={TIMEOUT_S}",
    *flags,
  )
  return [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", f"run_name={run_name}", *args]


def _run(command, rank_env=None):
  codes, outputs = finish_processes(start_cpu_processes(command, devices_per_process=2, rank_env=rank_env), timeout=300)
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
  return outputs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("reference")
  _run(_command(tmp_path, "reference"))
  return read_metrics(tmp_path / "reference.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize(
  "fault,flags,newest",
  [
    ("kill_in_step:7", ["async_checkpointing=false"], 6),  # step 6 was saved before step 7 started
    ("kill_during_save:6", [], 3),  # the save of step 6 was in flight: it never commits
  ],
)
def test_a_killed_process_ends_the_other_with_one_line_and_the_same_command_resumes(
  tmp_path, reference, fault, flags, newest
):
  command = _command(tmp_path, "run", *flags)
  procs = start_cpu_processes(command, devices_per_process=2, rank_env={1: {fault_injection.ENV: fault}})
  try:
    procs[1].wait(timeout=300)
    killed = time.monotonic()
    assert procs[1].returncode == -signal.SIGKILL, procs[1].communicate()[0][-3000:]
    output = procs[0].communicate(timeout=3 * TIMEOUT_S)[0]
    took = time.monotonic() - killed
  finally:
    for p in procs:
      p.kill()
  print(f"the survivor exited {procs[0].returncode} {took:.1f} s after its peer was killed")
  assert procs[0].returncode == peer_monitor.EXIT_STATUS, output[-3000:]
  assert took < TIMEOUT_S, output[-3000:]
  last = output.strip().splitlines()[-1]
  assert re.fullmatch(
    rf"Error: lost process 1 of 2 \(no heartbeat for \d+ s, distributed_heartbeat_timeout={TIMEOUT_S}\) in step \d+; "
    r"stopping without a save \(a step or save in flight is incomplete\)\. Rerun the same command to resume from the "
    rf"newest complete checkpoint, of step {newest}\.",
    last,
  ), last
  assert "Traceback" not in output and "before exiting" not in output  # nothing saved on the way out
  committed = sorted(int(name) for name in os.listdir(tmp_path / "run" / "checkpoints") if name.isdigit())
  assert committed[-1] == newest, committed

  outputs = _run(command)  # the same command, on both processes
  assert f"Restored the checkpoint of step {newest} " in outputs[0]
  got = read_metrics(tmp_path / "run.jsonl")
  assert [m["step"] for m in got] == list(range(STEPS))
  assert [m["learning/loss"] for m in got] == [m["learning/loss"] for m in reference]  # bitwise


class _Store:
  """jax.distributed's key-value store, as the monitors of several processes share it."""

  def __init__(self):
    self.values = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    assert allow_overwrite
    self.values[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in sorted(self.values.items()) if k.startswith(prefix)]


class _Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def _monitors(count, clock, store, exits, timeout_s=TIMEOUT_S):
  return [
    peer_monitor.PeerMonitor(
      store, index, count, timeout_s, clock=clock, exit_fn=lambda status, i=index: exits.append((i, status))
    )
    for index in range(count)
  ]


def test_a_silent_process_is_lost_after_the_threshold_and_every_survivor_leaves_with_one_line(capsys):
  clock, store, exits = _Clock(), _Store(), []
  timeout_s = 2  # process 0 waits up to 2 intervals (real time) for process 1 to read the verdict
  monitors = _monitors(3, clock, store, exits, timeout_s)
  interval, threshold = peer_monitor.timings(timeout_s)
  assert threshold + 2 * interval < timeout_s
  monitors[0].step = 12
  monitors[0].resume_note = lambda: "Rerun the same command to resume from the newest complete checkpoint, of step 10."
  for _ in range(3):  # all beat
    clock.now += interval
    for m in monitors:
      m.tick()
  died = clock.now  # process 2 stops beating
  while not exits and clock.now < died + timeout_s:
    clock.now += interval
    for m in monitors[:2]:
      m.tick()
  # Process 0 judged, then process 1 read its verdict in the same round (process 0 saw the last beat a round late).
  assert exits == [(0, 75), (1, 75)] and threshold < clock.now - died <= threshold + 2 * interval + 1e-9
  assert store.values[f"{peer_monitor.ALIVE_DIR}1"] == peer_monitor.LEAVING
  lines = capsys.readouterr().err.strip().splitlines()
  lost = rf"Error: lost process 2 of 3 \(no heartbeat for \d+ s, distributed_heartbeat_timeout={timeout_s}\)"
  assert re.fullmatch(
    lost + r" in step 12; stopping without a save \(a step or save in flight is incomplete\)\. Rerun the same command "
    r"to resume from the newest complete checkpoint, of step 10\.",
    lines[0],
  ), lines
  assert re.fullmatch(lost + r"; stopping without a save \(a step or save in flight is incomplete\)\.", lines[1]), lines
  for _ in range(3):  # a monitor that left stays silent (the real one has ended its process)
    clock.now += interval
    monitors[0].tick()
  assert len(exits) == 2 and not capsys.readouterr().err


def test_a_process_that_finished_is_not_lost_and_beating_ones_never_are():
  clock, store, exits = _Clock(), _Store(), []
  monitors = _monitors(2, clock, store, exits)
  for _ in range(5 * TIMEOUT_S):
    clock.now += 1
    for m in monitors:
      m.tick()
  monitors[1].finished()
  for _ in range(5 * TIMEOUT_S):
    clock.now += 1
    monitors[0].tick()
  assert exits == []


def test_the_store_gone_for_longer_than_the_threshold_names_process_0(capsys):
  class Gone(_Store):
    def key_value_set(self, key, value, allow_overwrite=False):
      raise RuntimeError("UNAVAILABLE: connection reset")

  clock, exits = _Clock(), []
  monitor = _monitors(2, clock, Gone(), exits)[1]
  for _ in range(2 * TIMEOUT_S):
    clock.now += 1
    monitor.tick()
  assert exits == [(1, 75)]
  assert capsys.readouterr().err.startswith("Error: lost process 0 of 2 (jax.distributed's coordinator")


def test_only_runtime_errors_wait_for_the_verdict():
  class JaxRuntimeError(Exception):
    pass

  monitor = _monitors(2, _Clock(), _Store(), [])[0]
  monitor.timeout_s = 0.05
  monitor.interval = 0.01
  started = time.monotonic()
  monitor.wait_for_verdict(ValueError("not from a collective"))
  assert time.monotonic() - started < 0.04
  try:
    raise RuntimeError("while saving") from JaxRuntimeError("Connection closed by peer")
  except RuntimeError as error:
    monitor.wait_for_verdict(error)  # no verdict comes: it returns after the timeout
  assert time.monotonic() - started >= 0.05


def test_a_process_that_stops_with_an_error_is_lost_to_the_others_at_once(capsys):
  clock, store, exits = _Clock(), _Store(), []
  monitors = _monitors(3, clock, store, exits, timeout_s=1)
  for m in monitors:
    m.tick()
  monitors[2].failed()  # its own error line is printed; it tells the others and exits
  monitors[2].tick()  # it reports nothing more
  while not exits and clock.now < 200:  # the others are told after a grace, in which they may meet the error too
    clock.now += monitors[0].interval
    for m in monitors[:2]:
      m.tick()
  grace, interval = monitors[0].grace, monitors[0].interval
  assert exits == [(0, 75), (1, 75)] and grace < clock.now - 100 <= grace + 2 * interval + 1e-9
  lines = capsys.readouterr().err.strip().splitlines()
  assert all(line.startswith("Error: lost process 2 of 3 (it stopped with an error: see its output)") for line in lines)
  assert len(lines) == 2

  clock, store, exits = _Clock(), _Store(), []
  monitors = _monitors(2, clock, store, exits, timeout_s=1)
  monitors[0].failed()  # process 0 (the store's host) waits a grace, then for the others to read its verdict
  monitors[1].tick()
  assert exits == [(1, 75)]
  assert capsys.readouterr().err.startswith("Error: lost process 0 of 2 (it stopped with an error: see its output)")
