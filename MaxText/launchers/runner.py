"""Runs one command on every worker of a cluster, for multihost_runner.py.

Each worker runs COMMAND in its copy of the code with the distributed environment MaxText reads
(JAX_COORDINATOR_ADDRESS, NNODES, NODE_RANK; MEGASCALE_* for several TPU slices). Its output streams to the
console as "[worker N] ..." and to LOG_DIR/worker_N.log. The first worker to fail stops the others: their whole
process groups on the workers, not only the local ssh.
"""

import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from MaxText.errors import UserError
from MaxText.launchers import commands as lc
from MaxText.launchers import workers as workers_lib

DEFAULT_COORDINATOR_PORT = 8476  # JAX's own port for TPU clusters
MEGASCALE_PORT = 8080
STOP_GRACE_S = 10  # the workers' watcher sends TERM, then KILL 5 s later

# The job runs in a process group of its own. When the runner closes this connection's input (another worker
# failed, Ctrl-C, or the runner died) the watcher ends that whole group: TERM, then KILL 5 s later. Without
# it, closing ssh would leave the job running on the worker. The script and the watcher run under sh, which
# reads no start-up files (bash started by sshd reads ~/.bashrc); COMMAND runs under bash.
_RUN_JOB = """\
setsid bash -c "$command" </dev/null 2>&1 &
job=$!
exec 3<&0
setsid sh -c 'cat <&3 >/dev/null; kill -TERM "-$1"; sleep 5; kill -KILL "-$1"' watcher "$job" </dev/null >/dev/null 2>&1 &
watcher=$!
exec 3<&-
wait "$job"
status=$?
kill -TERM "-$watcher" 2>/dev/null
exit "$status"
"""

# A TPU is held by one process: end whatever an earlier run left on the chips, and libtpu's lock file.
_FREE_TPU = (
  "pids=$(sudo -n lsof -t /dev/accel* /dev/vfio/[0-9]* 2>/dev/null | sort -u); "
  'if [ -n "$pids" ]; then sudo -n kill -9 $pids; fi; sudo -n rm -f /tmp/libtpu_lockfile'
)


def say(message: str) -> None:
  """One line on stderr, prefixed with the launcher's name."""
  print(f"multihost_runner: {message}", file=sys.stderr, flush=True)


def worker_env(workers, slice_ids: list[int], rank: int, port: int) -> dict[str, str]:
  """The distributed environment of worker `rank`: what MaxText's jax.distributed set-up reads."""
  env = {"JAX_COORDINATOR_ADDRESS": f"{workers[0].address}:{port}", "NNODES": str(len(workers)), "NODE_RANK": str(rank)}
  if max(slice_ids) > 0:  # several TPU slices talk over the data-center network through libtpu's megascale
    env |= {
      "MEGASCALE_COORDINATOR_ADDRESS": f"{workers[0].address}:{MEGASCALE_PORT}",
      "MEGASCALE_NUM_SLICES": str(max(slice_ids) + 1),
      "MEGASCALE_PORT": str(MEGASCALE_PORT),
      "MEGASCALE_SLICE_ID": str(slice_ids[rank]),
    }
  return env


def worker_script(command: str, folder: str, env: dict[str, str], tarball: str = "", free_tpu: bool = False) -> str:
  """The remote command of a worker: unpack the code (if copied), cd, export env, run COMMAND as a killable job."""
  q = shlex.quote
  lines = []
  if tarball:
    lines.append(f"mkdir -p {q(folder)} && tar -xzf {q(tarball)} -C {q(folder)} && rm -f {q(tarball)} || exit 1")
  lines.append(f"cd {q(folder)} || exit 1")
  if free_tpu:
    lines.append(_FREE_TPU)
  lines.append("export " + " ".join(f"{k}={q(v)}" for k, v in env.items()))
  lines.append(f"command={q(command)}")
  return "sh -c " + q("\n".join(lines) + "\n" + _RUN_JOB)


def worker_commands(args, workers, slice_ids: list[int], copied: bool) -> list[list[str]]:
  """The ssh (or gcloud ssh) command of each worker."""
  free_tpu = isinstance(workers[0], lc.TpuWorker)
  commands = []
  for rank, worker in enumerate(workers):
    env = worker_env(workers, slice_ids, rank, args.COORDINATOR_PORT)
    tarball = workers_lib.worker_tarball(args.RUN_NAME, rank) if copied else ""
    script = worker_script(args.COMMAND, workers_lib.worker_folder(args.RUN_NAME, rank), env, tarball, free_tpu)
    commands.append(worker.ssh(script))
  return commands


def _stream(pipe, prefix: str, log_path: str, lock: threading.Lock) -> None:
  """Copies a worker's output to its log file and, prefixed, to the console, line by line."""
  with open(log_path, "wb") as log:
    for line in iter(pipe.readline, b""):
      log.write(line)
      log.flush()
      text = line.decode("utf-8", errors="replace")
      with lock:
        sys.stdout.write(prefix + text + ("" if text.endswith("\n") else "\n"))
        sys.stdout.flush()


def _first_failure(procs) -> int | None:
  """Waits until every worker succeeded (None) or one failed (its rank)."""
  while True:
    codes = [p.poll() for p in procs]
    failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
    if failed:
      return failed[0]
    if all(code == 0 for code in codes):
      return None
    time.sleep(0.1)


def stop_workers(procs) -> None:
  """Ends the input of every running worker connection (its watcher then kills the job's process group), then
  kills the local ssh/gcloud of any that has not ended within STOP_GRACE_S: that closes the connection too."""
  running = [p for p in procs if p.poll() is None]
  for proc in running:
    try:
      proc.stdin.close()
    except OSError:
      pass
  deadline = time.time() + STOP_GRACE_S
  for proc in running:
    try:
      proc.wait(timeout=max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()


def run_workers(workers, commands: list[list[str]], log_dir: str) -> int:
  """Runs each worker's command, streaming its output; the first failure stops the others. Returns the exit code."""
  lock = threading.Lock()
  procs, streams = [], []
  for rank, command in enumerate(commands):
    # A session of its own: Ctrl-C reaches the runner, which stops the workers, not each ssh on its own.
    proc = subprocess.Popen(
      command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    log_path = os.path.join(log_dir, f"worker_{rank}.log")
    stream = threading.Thread(target=_stream, args=(proc.stdout, f"[worker {rank}] ", log_path, lock), daemon=True)
    stream.start()
    procs.append(proc)
    streams.append(stream)
  try:
    failed = _first_failure(procs)
  except KeyboardInterrupt:
    say("interrupted: stopping every worker")
    stop_workers(procs)
    return 130
  if failed is not None:
    code = procs[failed].returncode
    say(f"worker {failed} ({workers[failed]}) failed with exit code {code}; stopping the other workers")
    stop_workers(procs)
  for stream in streams:
    stream.join(timeout=5)
  if failed is not None:
    say(f"failed: worker {failed} ({workers[failed]}), exit code {code}; logs in {log_dir}")
    return code if 0 < code < 256 else 1
  say(f"all {len(workers)} workers finished; logs in {log_dir}")
  return 0


def _interrupt(signum, frame):
  raise KeyboardInterrupt


def run(args) -> int:
  """Finds the workers, copies the code to them and runs COMMAND on each. Returns the exit code: the failed
  worker's, 130 when interrupted, or 2 (with one line that says why) when nothing could run.

  Args:
    args: multihost_runner.py's flags (its parse_flags).
  """
  try:
    run_name = lc.check_run_name(args.RUN_NAME)
    copy = not lc.parse_bool(args.USE_EXISTING_FOLDER)
    if copy and not os.path.isdir(args.SCRIPT_DIR):
      raise UserError(f"SCRIPT_DIR={args.SCRIPT_DIR} is not a folder")
    workers, slice_ids = workers_lib.find_workers(args)
    log_dir = os.path.join("/tmp", run_name)
    os.makedirs(log_dir, exist_ok=True)
    say(f"run {run_name} on {len(workers)} worker(s): " + "; ".join(str(w) for w in workers))
    workers_lib.prepare_workers(workers, run_name, args.SCRIPT_DIR if copy else "", log_dir)
  except UserError as e:
    say(str(e))
    return 2
  signal.signal(signal.SIGTERM, _interrupt)
  return run_workers(workers, worker_commands(args, workers, slice_ids, copy), log_dir)
