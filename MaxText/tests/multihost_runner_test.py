"""multihost_runner.py against a real sshd on 127.0.0.1 (keys made per test session, nothing in ~/.ssh or
/etc/ssh), and against a fake gcloud for TPU VMs: output per worker, the distributed environment, a failing
worker stopping the others' remote processes, quoting, and one-line errors."""

import getpass
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import uuid

import portpicker
import pytest

from MaxText.tests.helpers import REPO_ROOT, read_metrics, tiny_args

RUNNER = os.path.join(REPO_ROOT, "multihost_runner.py")
SSHD = "/usr/sbin/sshd"


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 10) -> None:
  deadline = time.time() + timeout_s
  while time.time() < deadline and proc.poll() is None:
    try:
      socket.create_connection(("127.0.0.1", port), timeout=1).close()
      return
    except OSError:
      time.sleep(0.1)
  raise RuntimeError(f"sshd did not start on port {port}")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
  """An sshd on 127.0.0.1 that lets this user in with a key of its own; the runner's ssh flags to reach it."""
  if not os.path.exists(SSHD):
    pytest.skip(f"{SSHD} is missing (apt-get install openssh-server)")
  root = tmp_path_factory.mktemp("sshd")
  for name in ("host_key", "user_key"):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True)
  shutil.copy(root / "user_key.pub", root / "authorized_keys")
  (root / "sshd_config").write_text(
    f"ListenAddress 127.0.0.1\nHostKey {root}/host_key\nAuthorizedKeysFile {root}/authorized_keys\n"
    f"PidFile {root}/sshd.pid\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
    "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nMaxStartups 50\nLogLevel ERROR\n"
    "Subsystem sftp /usr/lib/openssh/sftp-server\n"
  )
  if os.geteuid() == 0:
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation folder
  port = portpicker.pick_unused_port()
  proc = subprocess.Popen([SSHD, "-D", "-f", str(root / "sshd_config"), "-p", str(port), "-E", str(root / "sshd.log")])
  try:
    _wait_for_port(port, proc)
    yield [f"--SSH_KEY={root}/user_key", f"--SSH_PORT={port}", f"--SSH_OPTION=UserKnownHostsFile={root}/known_hosts"]
  finally:
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def run_name():
  """A run name of its own; its folders (~/RUN_NAME on the workers, /tmp/RUN_NAME here) are removed afterwards."""
  name = f"launcher-test-{uuid.uuid4().hex[:8]}"
  yield name
  for folder in (os.path.expanduser(f"~{getpass.getuser()}/{name}"), f"/tmp/{name}"):
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def code_dir(tmp_path):
  code = tmp_path / "code dir; $(touch pwned)"  # a local path is never shell code
  code.mkdir()
  (code / "marker.txt").write_text("copied\n")
  return code


def run_runner(*flags, env=None, timeout=120) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, RUNNER, *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False
  )


def worker_lines(stdout: str, rank: int) -> list[str]:
  prefix = f"[worker {rank}] "
  return [line[len(prefix) :] for line in stdout.splitlines() if line.startswith(prefix)]


def test_command_runs_in_each_workers_copy_with_its_rank(sshd, run_name, code_dir):
  # Quotes, $(...) and a would-be break-out of the quoting reach the worker's bash exactly as written.
  command = """printf '%s|' "it's" "$(echo sub)" '$HOME' "$NODE_RANK/$NNODES" "$JAX_COORDINATOR_ADDRESS"; cat marker.txt
echo '; touch pwned; echo '"""
  result = run_runner(
    *sshd, "--HOSTS=127.0.0.1,127.0.0.1", f"--SCRIPT_DIR={code_dir}", f"--RUN_NAME={run_name}", f"--COMMAND={command}"
  )
  assert result.returncode == 0, result.stderr
  for rank in range(2):
    lines = worker_lines(result.stdout, rank)
    assert lines == [f"it's|sub|$HOME|{rank}/2|127.0.0.1:8476|copied", "; touch pwned; echo "]
    with open(f"/tmp/{run_name}/worker_{rank}.log", encoding="utf-8") as f:
      assert f.read().splitlines() == lines
    assert os.listdir(os.path.expanduser(f"~/{run_name}/worker_{rank}")) == ["marker.txt"]
  assert not (code_dir / "pwned").exists() and not os.path.exists(os.path.expanduser(f"~/{run_name}/worker_0/pwned"))
  # The tarballs are gone, here and on the workers.
  assert sorted(os.listdir(f"/tmp/{run_name}")) == ["worker_0.log", "worker_1.log"]
  assert sorted(os.listdir(os.path.expanduser(f"~/{run_name}"))) == ["worker_0", "worker_1"]
  assert not any(name.startswith(run_name) for name in os.listdir(os.path.expanduser("~")) if name != run_name)

  # The folders of that run, reused without a copy.
  again = run_runner(
    *sshd, "--HOSTS=127.0.0.1", "--USE_EXISTING_FOLDER=True", f"--RUN_NAME={run_name}", "--COMMAND=cat marker.txt"
  )
  assert again.returncode == 0 and worker_lines(again.stdout, 0) == ["copied"], again.stderr


def test_a_failing_worker_stops_the_others_on_their_hosts(sshd, run_name, code_dir):
  marker = f"sleep {600 + uuid.uuid4().int % 10_000}"  # in the command line of worker 0's processes
  command = f'echo "rank $NODE_RANK up"; if [ "$NODE_RANK" = 1 ]; then sleep 1; exit 3; fi; {marker}'
  start = time.time()
  result = run_runner(
    *sshd, "--HOSTS=127.0.0.1,127.0.0.1", f"--SCRIPT_DIR={code_dir}", f"--RUN_NAME={run_name}", f"--COMMAND={command}"
  )
  assert time.time() - start < 30
  assert result.returncode == 3
  assert worker_lines(result.stdout, 0)[0] == "rank 0 up"  # then bash's "Terminated"
  assert "worker 1 (127.0.0.1) failed with exit code 3" in result.stderr
  left = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True, check=False).stdout
  assert left == "", f"worker 0's processes still run: {left}"


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--RUN_NAME=x;touch /tmp/pwned", "--HOSTS=127.0.0.1"], "RUN_NAME='x;touch /tmp/pwned' is not a safe folder name"),
    (["--RUN_NAME=../x", "--HOSTS=127.0.0.1"], "RUN_NAME='../x' is not a safe folder name"),
    (["--HOSTFILE=/nonexistent/hosts"], "cannot read HOSTFILE=/nonexistent/hosts"),
    (["--HOSTS=,"], "no workers"),
    (["--HOSTS=h1", "--TPU_PREFIX=tpu"], "not both"),
    (["--HOSTS=-oProxyCommand=touch_pwned"], "host '-oProxyCommand=touch_pwned' is not a host name"),
    (["--HOSTS=h1", "--SSH_USER=a b"], "SSH_USER='a b' is not a user name"),
    (["--TPU_PREFIX=my-tpu"], "gcloud is not installed"),
  ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, flags, message):
  env = {**os.environ, "PATH": str(tmp_path)}  # no gcloud, ssh or tar: nothing may get that far
  result = run_runner(*flags, "--COMMAND=touch /tmp/pwned", env=env)
  assert result.returncode == 2
  assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
  assert result.stdout == ""


def test_an_unreachable_host_is_named(tmp_path, code_dir):
  closed_port = portpicker.pick_unused_port()
  result = run_runner(
    "--HOSTS=127.0.0.1",
    f"--SSH_PORT={closed_port}",
    f"--SCRIPT_DIR={code_dir}",
    "--RUN_NAME=launcher-test-unreachable",
    "--COMMAND=true",
  )
  shutil.rmtree("/tmp/launcher-test-unreachable", ignore_errors=True)
  assert result.returncode == 2
  assert f"cannot copy the code to worker 0 (127.0.0.1): ssh: connect to host 127.0.0.1 port {closed_port}" in result.stderr


FAKE_GCLOUD = r"""#!PYTHON
# A stand-in for gcloud: two TPU slices of two workers; ssh and scp act on a local folder per worker.
import json, os, shutil, subprocess, sys
args = sys.argv[1:]
root = os.environ["FAKE_TPU_ROOT"]
with open(os.path.join(root, "calls.jsonl"), "a") as f:
  f.write(json.dumps(args) + "\n")
flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
if args[:4] == ["compute", "tpus", "tpu-vm", "list"]:
  print("my-tpu-1\nmy-tpu-0\nmy-tpu-other")
elif args[:4] == ["compute", "tpus", "tpu-vm", "describe"]:
  print(f"10.0.{args[4][-1]}.1\n10.0.{args[4][-1]}.2")
elif args[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
  name, path = args[5].split(":", 1)
  home = os.path.join(root, name, flags["worker"])
  os.makedirs(home, exist_ok=True)
  shutil.copy(args[4], os.path.join(home, path))
elif args[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
  home = os.path.join(root, args[4], flags["worker"])
  sys.exit(subprocess.call(["sh", "-c", flags["command"]], cwd=home))
else:
  sys.exit(f"fake gcloud: unexpected {args}")
"""


def test_tpu_prefix_finds_the_slices_and_sets_each_workers_environment(tmp_path, run_name, code_dir):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "gcloud").write_text(FAKE_GCLOUD.replace("PYTHON", sys.executable))
  (bin_dir / "sudo").write_text("#!/bin/sh\nexit 0\n")  # the TPU clean-up must not touch this machine
  for tool in ("gcloud", "sudo"):
    (bin_dir / tool).chmod(0o755)
  env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_TPU_ROOT": str(tmp_path)}
  command = (
    'echo "$NODE_RANK $NNODES $JAX_COORDINATOR_ADDRESS $MEGASCALE_SLICE_ID $MEGASCALE_COORDINATOR_ADDRESS"; cat marker.txt'
  )
  flags = ["--TPU_PREFIX=my-tpu", "--PROJECT=proj", "--ZONE=zone-a", "--INTERNAL_IP=true"]
  result = run_runner(*flags, f"--SCRIPT_DIR={code_dir}", f"--RUN_NAME={run_name}", f"--COMMAND={command}", env=env)
  assert result.returncode == 0, result.stderr
  for rank in range(4):
    assert worker_lines(result.stdout, rank) == [f"{rank} 4 10.0.0.1:8476 {rank // 2} 10.0.0.1:8080", "copied"]
  calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
  assert calls[0][:4] == ["compute", "tpus", "tpu-vm", "list"] and "--filter=name~my-tpu" in calls[0]
  assert [c[4] for c in calls if c[3] == "describe"] == ["my-tpu-0", "my-tpu-1"]  # my-tpu-other is no slice
  for call in calls[3:]:  # the copies and the runs
    assert {"--project=proj", "--zone=zone-a", "--internal-ip", "--strict-host-key-checking=no"} <= set(call)
  assert sorted(c[4] + " " + c[5] for c in calls if c[3] == "ssh") == [
    "my-tpu-0 --worker=0",
    "my-tpu-0 --worker=1",
    "my-tpu-1 --worker=0",
    "my-tpu-1 --worker=1",
  ]


@pytest.mark.slow
def test_two_workers_train_as_one_two_process_job(sshd, run_name, tmp_path):
  metrics = tmp_path / "metrics.jsonl"
  env = ["XLA_FLAGS=--xla_force_host_platform_device_count=4", "JAX_PLATFORMS=cpu"]
  train = [sys.executable, "MaxText/train.py", "MaxText/configs/base.yml", f"run_name={run_name}"]
  train += tiny_args(f"base_output_directory={tmp_path}", f"metrics_file={metrics}", "steps=5")
  port = portpicker.pick_unused_port()
  result = run_runner(
    *sshd,
    "--HOSTS=127.0.0.1,127.0.0.1",
    f"--RUN_NAME={run_name}",
    f"--COORDINATOR_PORT={port}",
    f"--COMMAND={shlex.join(env + train)}",
    timeout=900,
  )
  assert result.returncode == 0, result.stderr + result.stdout[-3000:]
  assert worker_lines(result.stdout, 0) and worker_lines(result.stdout, 1)
  with open(f"/tmp/{run_name}/worker_1.log", encoding="utf-8") as f:
    assert "jax.distributed ready: process 1 of 2" in f.read()
  assert [m["step"] for m in read_metrics(metrics)] == [0, 1, 2, 3, 4]
