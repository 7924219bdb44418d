"""The workers of an existing cluster, for multihost_runner.py: TPU VMs found by name, or hosts reached by ssh;
and the copy of the code folder that each worker runs in (~/RUN_NAME/worker_N).

Every failure here is a UserError that names the worker or the flag: nothing has run on any worker yet.
"""

import os
import re
import shlex
import subprocess
import time

from MaxText.errors import UserError
from MaxText.launchers import commands as lc

PREPARE_TIMEOUT_S = 300


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
  """The ssh hosts of --HOSTS (comma-separated) or --HOSTFILE (one a line, '#' starts a comment)."""
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
  """The workers, worker 0 first, and the slice index of each (0 for ssh hosts).

  Args:
    args: multihost_runner.py's flags (TPU_PREFIX, PROJECT, ZONE, INTERNAL_IP; or HOSTS/HOSTFILE and SSH_*).
  """
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


def worker_folder(run_name: str, rank: int) -> str:
  """The code folder of a worker, relative to its home directory."""
  return f"{run_name}/worker_{rank}"


def worker_tarball(run_name: str, rank: int) -> str:
  """The copied code of a worker, in its home directory until the worker's script unpacks it."""
  return f"{run_name}-worker_{rank}.tar.gz"


def prepare_workers(workers, run_name: str, script_dir: str, log_dir: str) -> None:
  """Packs SCRIPT_DIR and copies it to every worker (the worker's script unpacks it), or, with no script_dir,
  checks that each worker has its folder from an earlier run. Names the first worker that cannot be reached."""
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
