"""multihost_job.py: the commands --dry-run prints, argument by argument, and its startup script run for real
against stand-ins for the metadata server, gsutil and gcloud (no Google Cloud needed)."""

import os
import shlex
import shutil
import subprocess
import sys
import tarfile

import pytest

from MaxText.tests.helpers import REPO_ROOT

JOB = os.path.join(REPO_ROOT, "multihost_job.py")
RUN = "launcher-job-test"


@pytest.fixture(autouse=True)
def _remove_local_run_folder():
  yield
  shutil.rmtree(f"/tmp/{RUN}", ignore_errors=True)


def run_job(*flags, env=None) -> subprocess.CompletedProcess:
  command = [sys.executable, JOB, *flags]
  return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=env, check=False)


def dry_run(code_dir, *flags, env=None):
  base = [f"--RUN_NAME={RUN}", "--BUCKET_NAME=gs://my-bucket", f"--SCRIPT_DIR={code_dir}", "--dry-run"]
  return run_job(*base, *flags, env=env)


@pytest.fixture
def code_dir(tmp_path):
  code = tmp_path / "code dir's"
  code.mkdir()
  (code / "marker.txt").write_text("fetched\n")
  for junk in (".git", "maxtext_output", "__pycache__"):
    (code / junk).mkdir()
    (code / junk / "junk").write_text("")
  return code


def test_dry_run_prints_each_command_with_its_arguments_intact(code_dir):
  bucket_dir = "runs/a b;$(touch /tmp/pwned)"
  result = dry_run(
    code_dir,
    f"--BUCKET_DIR={bucket_dir}",
    "--PROJECT=proj",
    "--ZONE=us-central2-b",
    "--TPU_TYPE=v5litepod-16",
    "--NUM_SLICES=2",
    "--ENABLE_AUTOCHECKPOINT=True",
    '--CQR_EXTRA_ARGS=--best-effort --description="two words"',
    "--COMMAND=echo hi",
  )
  assert result.returncode == 0, result.stderr
  tar, copy, create = [shlex.split(line) for line in result.stdout.splitlines()]
  tarball, script = f"/tmp/{RUN}/code.tar.gz", f"/tmp/{RUN}/startup_script.sh"
  assert tar[0] == "tar" and tar[-5:] == ["-czf", tarball, "-C", str(code_dir), "."]
  assert {"--exclude=.git", "--exclude=maxtext_output", "--exclude=__pycache__"} <= set(tar)
  assert copy == ["gsutil", "-q", "cp", tarball, f"gs://my-bucket/{bucket_dir}/{RUN}/code.tar.gz"]
  assert create == [
    *"gcloud alpha compute tpus queued-resources create".split(),
    RUN,
    "--accelerator-type=v5litepod-16",
    "--runtime-version=tpu-ubuntu2204-base",
    "--node-count=2",
    f"--node-prefix={RUN}",
    "--project=proj",
    "--zone=us-central2-b",
    f"--metadata-from-file=startup-script={script}",
    "--autocheckpoint-enabled",
    "--best-effort",
    "--description=two words",
  ]
  assert f"the startup script is {script}" in result.stderr
  assert not os.path.exists(tarball) and not os.path.exists("/tmp/pwned")
  subprocess.run(["bash", "-n", script], check=True)


def test_one_slice_is_a_node_id_and_missing_project_gets_placeholders(tmp_path, code_dir):
  env = {**os.environ, "PATH": str(tmp_path)}  # no gcloud
  result = dry_run(code_dir, "--NUM_SLICES=1", "--COMMAND=true", env=env)
  assert result.returncode == 0, result.stderr
  create = shlex.split(result.stdout.splitlines()[-1])
  assert f"--node-id={RUN}" in create and "--node-count=1" not in create
  assert {"--project=YOUR_PROJECT", "--zone=YOUR_ZONE"} <= set(create)
  assert "YOUR_PROJECT / YOUR_ZONE stand in" in result.stderr


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--RUN_NAME=x;touch /tmp/pwned"], "RUN_NAME='x;touch /tmp/pwned' is not a valid queued resource name"),
    (["--RUN_NAME=Upper"], "RUN_NAME='Upper' is not a valid queued resource name"),
    (["--BUCKET_NAME=gs://a b"], "BUCKET_NAME='a b' is not a GCS bucket name"),
    (["--NUM_SLICES=0"], "NUM_SLICES=0 must be at least 1"),
    (["--SCRIPT_DIR=/nonexistent"], "SCRIPT_DIR=/nonexistent is not a folder"),
    (["--CQR_EXTRA_ARGS=--x='open"], "cannot be split into flags"),
    (["--PROJECT=p", "--ZONE=z"], "gcloud is not installed"),  # a real run (no --dry-run) needs gcloud
  ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, flags, message):
  env = {**os.environ, "PATH": str(tmp_path)}
  base = [f"--RUN_NAME={RUN}", "--BUCKET_NAME=b1", f"--SCRIPT_DIR={tmp_path}", "--COMMAND=touch /tmp/pwned"]
  result = run_job(*base, *flags, env=env)
  assert result.returncode == 2
  assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
  assert result.stdout == "" and not os.path.exists("/tmp/pwned")


# Stand-ins on PATH for the startup script: the metadata server, a bucket in a folder, gcloud, a venv, and a
# `sleep` that skips the 10 minutes worker 0 waits before deleting the TPUs.
STUBS = {
  "curl": """#!/bin/sh\nprintf "WORKER_ID: '0'\\nMEGASCALE_SLICE_ID: '0'\\nZONE: 'z'\\n"\n""",
  "gsutil": """#!/bin/sh\n[ "$1 $2" = "-q cp" ] || exit 9\nsrc=$(echo "$3" | sed "s|^gs://|$FAKE_GCS/|")
dst=$(echo "$4" | sed "s|^gs://|$FAKE_GCS/|")\nmkdir -p "$(dirname "$dst")" && cp "$src" "$dst"\n""",
  "gcloud": """#!/bin/sh\nfor a in "$@"; do echo "$a"; done > "$FAKE_GCS/gcloud_args"\n""",
  "python3": """#!/bin/sh\n[ "$1 $2" = "-m venv" ] || exit 9
mkdir -p "$3/bin" && echo "export VIRTUAL_ENV=$3" > "$3/bin/activate"\n""",
  "sleep": """#!/bin/sh\n[ "$1" = 600 ] || exec /bin/sleep "$@"\n""",
}


def test_startup_script_runs_the_command_literally_and_uploads_the_log(tmp_path, code_dir):
  # Quotes, $(...) and a would-be break-out of the quoting reach the worker's bash exactly as written.
  command = """printf '%s|' "it's" "$(echo sub)" '$HOME' "$RUN_NAME" "$VIRTUAL_ENV"; cat marker.txt
echo '; touch pwned; echo '"""
  result = dry_run(code_dir, "--PROJECT=proj; touch pwned", "--ZONE=z", f"--COMMAND={command}")
  assert result.returncode == 0, result.stderr
  tar, copy, _ = [shlex.split(line) for line in result.stdout.splitlines()]
  # What the real run does before the TPUs start: pack the code and copy it to the (stand-in) bucket.
  gcs, home, stubs = tmp_path / "gcs", tmp_path / "home", tmp_path / "bin"
  for folder in (gcs, home, stubs):
    folder.mkdir()
  subprocess.run(tar, check=True)
  with tarfile.open(tar[-4]) as packed:
    assert sorted(packed.getnames()) == [".", "./marker.txt"]  # no .git, maxtext_output, __pycache__
  for name, text in STUBS.items():
    (stubs / name).write_text(text)
    (stubs / name).chmod(0o755)
  env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(home), "FAKE_GCS": str(gcs)}
  subprocess.run(copy, env=env, check=True)

  subprocess.run(["bash", f"/tmp/{RUN}/startup_script.sh"], env=env, cwd=tmp_path, check=True, timeout=60)
  log = (gcs / "my-bucket" / RUN / "logs" / "slice_0_worker_0.log").read_text().splitlines()
  venv = home / RUN / "venv"
  assert log == [
    f"it's|sub|$HOME|{RUN}|{venv}|fetched",
    "; touch pwned; echo ",
    "multihost_job: COMMAND exited with 0 on slice 0 worker 0",
  ]
  assert not list(tmp_path.rglob("pwned"))
  # Worker 0 of slice 0 deletes the queued resource at the end, the project still one argument.
  deleted = (gcs / "gcloud_args").read_text().splitlines()
  assert deleted == [
    *"alpha compute tpus queued-resources delete".split(),
    RUN,
    "--force",
    "--quiet",
    "--project=proj; touch pwned",
    "--zone=z",
  ]
