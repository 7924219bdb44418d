"""Runs one command on every worker of an existing cluster: TPU VMs found by name, or hosts reached by ssh.

  # TPU VMs named my-tpu (one slice), or my-tpu-0, my-tpu-1, ... (one VM a slice):
  python3 multihost_runner.py --TPU_PREFIX=my-tpu --COMMAND="bash setup.sh && python3 MaxText/train.py ..."
  # GPU or CPU hosts (or --HOSTFILE=hosts.txt, one host a line); worker 0 is the first host:
  python3 multihost_runner.py --HOSTS=10.0.0.1,10.0.0.2 --SSH_USER=me --COMMAND="python3 MaxText/train.py ..."

The code folder (--SCRIPT_DIR, default: the current folder) is copied to ~/RUN_NAME/worker_N on each worker,
one folder a worker since two workers may share a home directory; --USE_EXISTING_FOLDER=true reuses the
folders of an earlier run of the same RUN_NAME. COMMAND runs there under bash with JAX_COORDINATOR_ADDRESS
(worker 0's address and --COORDINATOR_PORT), NNODES and NODE_RANK set: MaxText initialises jax.distributed
from them (several TPU slices also get the MEGASCALE_* variables). Each worker's output streams to the console
as "[worker N] ..." and to /tmp/RUN_NAME/worker_N.log.

When a worker fails, the runner names it, stops the others (their whole process groups on the workers, not
only the local ssh) and exits with the failed worker's exit code. Bad flags, missing tools or an unreachable
worker exit with 2 before anything runs.
"""

import datetime
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

from MaxText import launch_commands as lc
from MaxText.errors import UserError

DEFAULT_COORDINATOR_PORT = 8476  # JAX's own port for TPU clusters
MEGASCALE_PORT = 8080
PREPARE_TIMEOUT_S = 300
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


def parse_flags(argv):
  p = lc.FlagParser(prog="multihost_runner.py", description=__doc__.split("\n\n", maxsplit=1)[0])
  p.add_argument("--COMMAND", required=True, help="the shell command each worker runs in the code folder")
  p.add_argument("--TPU_PREFIX", default="", help="TPU VM name, or the prefix of slices named PREFIX-<N>")
  p.add_argument("--HOSTS", default="", help="comma-separated ssh hosts; worker 0 is the first")
  p.add_argument("--HOSTFILE", default="", help="a file of ssh hosts, one a line ('#' starts a comment)")
  p.add_argument("--SCRIPT_DIR", default=os.getcwd(), help="the code folder copied to the workers")
  p.add_argument("--RUN_NAME", default=datetime.datetime.now().strftime("%Y-%m-%d-%H-%M-%S"))
  p.add_argument("--USE_EXISTING_FOLDER", default="False", help="true: run in the folder an earlier run copied")
  p.add_argument("--INTERNAL_IP", default="False", help="true: reach TPU VMs by their internal IP")
  p.add_argument("--PROJECT", default="", help="TPU project (default: gcloud's)")
  p.add_argument("--ZONE", default="", help="TPU zone (default: gcloud's)")
  p.add_argument("--SSH_USER", default="", help="user on the ssh hosts (default: ssh's)")
  p.add_argument("--SSH_KEY", default="", help="private key for the ssh hosts")
  p.add_argument("--SSH_PORT", type=int, default=0, help="ssh port of the hosts (default: ssh's)")
  p.add_argument("--SSH_OPTION", action="append", default=[], help="an ssh -o option, e.g. UserKnownHostsFile=...")
  p.add_argument("--COORDINATOR_PORT", type=int, default=DEFAULT_COORDINATOR_PORT, help="jax.distributed's port")
  return p.parse_args(argv)


def _say(message: str) -> None:
  print(f"multihost_runner: {message}", file=sys.stderr, flush=True)


def run_parallel(commands: list[list[str]], timeout_s: float) -> list[tuple[int | None, str, str]]:
  """Runs the commands side by side; (exit code or None if still running at the deadline, stdout, stderr) each."""
  try:
    procs = [
      subprocess.Popen(c, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for c in commands
    ]
  except FileNotFoundError as e:
    raise UserError(f"{e.filename} is not installed or not on PATH") from None
  deadline = time.time() + timeout_s
  results = []
  for proc in procs:
    try:
      out, err = proc.communicate(timeout=max(0.0, deadline - time.time()))
      results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
      results.append((None, out, err))
  return results


def _reason(stderr: str) -> str:
  """The line of a tool's error output that says what went wrong: its first, not counting warnings."""
  lines = [line.strip() for line in stderr.splitlines() if line.strip() and not line.startswith("Warning:")]
  return lines[0] if lines else "no message"


def _gcloud_lines(command: list[str]) -> list[str]:
  [(code, out, err)] = run_parallel([command], PREPARE_TIMEOUT_S)
  if code != 0:
    raise UserError(f"`{shlex.join(command[:6])} ...` failed: {_reason(err)}")
  return [line.strip() for line in out.splitlines() if line.strip()]


def tpu_workers(prefix: str, project: str, zone: str, internal_ip: bool) -> tuple[list, list[int]]:
  """The workers of TPU VM PREFIX, or of slices PREFIX-0, PREFIX-1, ...; and each worker's slice index."""
  lc.require_gcloud("to find the TPU VMs of --TPU_PREFIX (or give ssh hosts with --HOSTS)")
  lc.check_gce_name("TPU_PREFIX", prefix)
  project = project or lc.gcloud_default("project")
  zone = zone or lc.gcloud_default("compute/zone")
  if not project or not zone:
    raise UserError("give --PROJECT and --ZONE, or set gcloud's defaults (gcloud config set project/compute/zone)")
  names = _gcloud_lines(lc.tpu_list_command(prefix, project, zone))
  slices = [prefix] if prefix in names else [n for n in names if re.fullmatch(rf"{re.escape(prefix)}-\d+", n)]
  if not slices:
    raise UserError(f"no TPU VM named {prefix} or {prefix}-<N> in project {project}, zone {zone}")
  slices.sort(key=lambda n: int(n.rsplit("-", 1)[1]) if n != prefix else 0)
  workers, slice_ids = [], []
  for slice_id, name in enumerate(slices):
    ips = _gcloud_lines(lc.tpu_ips_command(name, project, zone))
    workers += [lc.TpuWorker(name, i, ip, project, zone, internal_ip) for i, ip in enumerate(ips)]
    slice_ids += [slice_id] * len(ips)
  return workers, slice_ids


def read_hosts(hosts: str, hostfile: str) -> list[str]:
  if hosts and hostfile:
    raise UserError("give --HOSTS or --HOSTFILE, not both")
  if not hostfile:
    return [h.strip() for h in hosts.split(",") if h.strip()]
  try:
    with open(hostfile, encoding="utf-8") as f:
      lines = [line.split("#", 1)[0].strip() for line in f]
  except OSError as e:
    raise UserError(f"cannot read HOSTFILE={hostfile}: {e.strerror}") from None
  return [line for line in lines if line]


def find_workers(args) -> tuple[list, list[int]]:
  """The workers, worker 0 first, and the slice index of each (0 for ssh hosts)."""
  if args.TPU_PREFIX and (args.HOSTS or args.HOSTFILE):
    raise UserError("give --TPU_PREFIX (TPU VMs) or --HOSTS/--HOSTFILE (ssh hosts), not both")
  if args.TPU_PREFIX:
    return tpu_workers(args.TPU_PREFIX, args.PROJECT, args.ZONE, lc.parse_bool(args.INTERNAL_IP))
  hosts = read_hosts(args.HOSTS, args.HOSTFILE)
  if not hosts:
    raise UserError("no workers: give --TPU_PREFIX, or ssh hosts with --HOSTS or a non-empty --HOSTFILE")
  if args.SSH_KEY and not os.path.isfile(args.SSH_KEY):
    raise UserError(f"SSH_KEY={args.SSH_KEY} does not exist")
  options = tuple(args.SSH_OPTION)
  return [lc.SshHost(h, args.SSH_USER, args.SSH_KEY, args.SSH_PORT, options) for h in hosts], [0] * len(hosts)


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


def worker_folder(run_name: str, rank: int) -> str:
  """The code folder of a worker, relative to its home directory."""
  return f"{run_name}/worker_{rank}"


def worker_tarball(run_name: str, rank: int) -> str:
  return f"{run_name}-worker_{rank}.tar.gz"


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


def prepare_workers(workers, run_name: str, script_dir: str, log_dir: str) -> None:
  """Packs SCRIPT_DIR and copies it to every worker (worker_script unpacks it), or, with no script_dir, checks
  that each worker has its folder from an earlier run. Names the first worker that cannot be reached."""
  tarball = os.path.join(log_dir, "code.tar.gz")
  if script_dir:
    [(code, _, err)] = run_parallel([lc.tar_command(script_dir, tarball)], PREPARE_TIMEOUT_S)
    if code != 0:
      raise UserError(f"cannot pack SCRIPT_DIR={script_dir}: {_reason(err)}")
    commands = [w.copy_to(tarball, worker_tarball(run_name, r)) for r, w in enumerate(workers)]
  else:
    commands = [w.ssh(f"test -d {shlex.quote(worker_folder(run_name, r))}") for r, w in enumerate(workers)]
  results = run_parallel(commands, PREPARE_TIMEOUT_S)
  if script_dir:
    os.remove(tarball)
  for rank, (code, _, err) in enumerate(results):
    who = f"worker {rank} ({workers[rank]})"
    if code is None:
      hint = (
        " (from outside the VPC, are --INTERNAL_IP and the firewall right?)"
        if isinstance(workers[rank], lc.TpuWorker)
        else ""
      )
      raise UserError(f"{who} did not answer within {PREPARE_TIMEOUT_S} s{hint}")
    if code == 1 and not script_dir:
      raise UserError(f"{who} has no folder ~/{worker_folder(run_name, rank)}: run once without --USE_EXISTING_FOLDER")
    if code != 0:
      raise UserError(f"cannot {'copy the code to' if script_dir else 'reach'} {who}: {_reason(err)}")


def worker_commands(args, workers, slice_ids: list[int], copied: bool) -> list[list[str]]:
  """The ssh (or gcloud ssh) command of each worker."""
  free_tpu = isinstance(workers[0], lc.TpuWorker)
  commands = []
  for rank, worker in enumerate(workers):
    env = worker_env(workers, slice_ids, rank, args.COORDINATOR_PORT)
    tarball = worker_tarball(args.RUN_NAME, rank) if copied else ""
    script = worker_script(args.COMMAND, worker_folder(args.RUN_NAME, rank), env, tarball, free_tpu)
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
    _say("interrupted: stopping every worker")
    stop_workers(procs)
    return 130
  if failed is not None:
    code = procs[failed].returncode
    _say(f"worker {failed} ({workers[failed]}) failed with exit code {code}; stopping the other workers")
    stop_workers(procs)
  for stream in streams:
    stream.join(timeout=5)
  if failed is not None:
    _say(f"failed: worker {failed} ({workers[failed]}), exit code {code}; logs in {log_dir}")
    return code if 0 < code < 256 else 1
  _say(f"all {len(workers)} workers finished; logs in {log_dir}")
  return 0


def _interrupt(signum, frame):
  raise KeyboardInterrupt


def main(argv=None) -> int:
  try:
    args = parse_flags(argv)
    run_name = lc.check_run_name(args.RUN_NAME)
    copy = not lc.parse_bool(args.USE_EXISTING_FOLDER)
    if copy and not os.path.isdir(args.SCRIPT_DIR):
      raise UserError(f"SCRIPT_DIR={args.SCRIPT_DIR} is not a folder")
    workers, slice_ids = find_workers(args)
    log_dir = os.path.join("/tmp", run_name)
    os.makedirs(log_dir, exist_ok=True)
    _say(f"run {run_name} on {len(workers)} worker(s): " + "; ".join(str(w) for w in workers))
    prepare_workers(workers, run_name, args.SCRIPT_DIR if copy else "", log_dir)
  except UserError as e:
    _say(str(e))
    return 2
  signal.signal(signal.SIGTERM, _interrupt)
  return run_workers(workers, worker_commands(args, workers, slice_ids, copy), log_dir)


if __name__ == "__main__":
  sys.exit(main())
