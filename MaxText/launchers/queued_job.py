"""A queued resource of TPU slices that runs one command on every worker, for multihost_job.py.

The code folder is packed and copied to gs://BUCKET_NAME/BUCKET_DIR/RUN_NAME/code.tar.gz; the queued resource
named RUN_NAME asks for NUM_SLICES slices with a startup script that, on each worker, fetches the code, runs
COMMAND in a venv when it can, uploads the worker's log now and then, and (worker 0 of slice 0, ten minutes
after the command ends) deletes the queued resource.
"""

import os
import re
import shlex
import subprocess
import sys

from MaxText.errors import UserError
from MaxText.launchers import commands as lc

_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,221}")
LOG_UPLOAD_PERIOD_S = 300
DELETE_DELAY_S = 600  # the other workers upload their logs before worker 0 deletes the TPUs

# The startup script's fixed part; `configure` (the run's values, quoted) and the commands are put in front.
_STARTUP_BODY = r"""
metadata() {
  curl -sf -H "Metadata-Flavor: Google" "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}
tpu_env() {  # tpu-env holds lines like WORKER_ID: '3'
  metadata tpu-env | sed -n "s/^$1: '\(.*\)'\$/\1/p"
}
WORKER_ID=$(tpu_env WORKER_ID)
SLICE_ID=$(tpu_env MEGASCALE_SLICE_ID)
WORKER_ID=${WORKER_ID:-0}
SLICE_ID=${SLICE_ID:-0}
WORK_DIR="${HOME:-/root}/$RUN_NAME"
LOG_NAME="slice_${SLICE_ID}_worker_${WORKER_ID}.log"
LOG="$WORK_DIR/$LOG_NAME"
mkdir -p "$WORK_DIR/code" && cd "$WORK_DIR" || exit 1
export RUN_NAME

fetch_code() {
  for attempt in 1 2 3 4 5 6 7 8 9 10; do
    download_code && tar -xzf code.tar.gz -C code && return 0
    echo "multihost_job: fetching the code failed (attempt $attempt of 10)"
    sleep 10
  done
  return 1
}

# Uploads the log now and then; `kill $uploader` ends it and its sleep.
( trap 'kill "$pause" 2>/dev/null; exit' TERM
  while :; do sleep "$LOG_UPLOAD_PERIOD_S" & pause=$!; wait "$pause"; upload_log; done ) &
uploader=$!
if fetch_code >>"$LOG" 2>&1; then
  cd code
  ulimit -n 100000 2>/dev/null
  if python3 -m venv "$WORK_DIR/venv" >>"$LOG" 2>&1; then
    . "$WORK_DIR/venv/bin/activate"
  else
    echo "multihost_job: no venv (python3 -m venv failed); using the system python3" >>"$LOG"
  fi
  bash -c "$COMMAND" >>"$LOG" 2>&1
  status=$?
else
  status=1
fi
echo "multihost_job: COMMAND exited with $status on slice $SLICE_ID worker $WORKER_ID" >>"$LOG"
kill "$uploader" 2>/dev/null
upload_log
if [ "$SLICE_ID" = 0 ] && [ "$WORKER_ID" = 0 ]; then
  sleep "$DELETE_DELAY_S"
  delete_queued_resource
fi
"""


def say(message: str) -> None:
  """One line on stderr, prefixed with the launcher's name."""
  print(f"multihost_job: {message}", file=sys.stderr, flush=True)


def check_flags(args) -> None:
  """Checks the flags and fills in the project and zone (placeholders under --dry-run)."""
  lc.check_run_name(args.RUN_NAME, gce=True)
  args.BUCKET_NAME = args.BUCKET_NAME.removeprefix("gs://").strip("/")
  if not _BUCKET.fullmatch(args.BUCKET_NAME):
    raise UserError(f"BUCKET_NAME={args.BUCKET_NAME!r} is not a GCS bucket name")
  if args.NUM_SLICES < 1:
    raise UserError(f"NUM_SLICES={args.NUM_SLICES} must be at least 1")
  if not os.path.isdir(args.SCRIPT_DIR):
    raise UserError(f"SCRIPT_DIR={args.SCRIPT_DIR} is not a folder")
  try:
    shlex.split(args.CQR_EXTRA_ARGS)
  except ValueError as e:
    raise UserError(f"CQR_EXTRA_ARGS={args.CQR_EXTRA_ARGS!r} cannot be split into flags: {e}") from None
  if not args.dry_run:
    lc.require_gcloud("to create the queued resource")
  args.PROJECT = args.PROJECT or lc.gcloud_default("project")
  args.ZONE = args.ZONE or lc.gcloud_default("compute/zone")
  if args.dry_run and not (args.PROJECT and args.ZONE):
    say("no --PROJECT/--ZONE and no gcloud default: YOUR_PROJECT / YOUR_ZONE stand in below")
    args.PROJECT, args.ZONE = args.PROJECT or "YOUR_PROJECT", args.ZONE or "YOUR_ZONE"
  if not (args.PROJECT and args.ZONE):
    raise UserError("give --PROJECT and --ZONE, or set gcloud's defaults (gcloud config set project/compute/zone)")


def gcs_run_dir(args) -> str:
  """gs://BUCKET_NAME/BUCKET_DIR/RUN_NAME: the code and the workers' logs."""
  parts = [args.BUCKET_NAME, args.BUCKET_DIR.strip("/"), args.RUN_NAME]
  return "gs://" + "/".join(p for p in parts if p)


def startup_script(args) -> str:
  """The script each worker runs at boot; every value from the flags in it is quoted."""
  q, gcs = shlex.quote, gcs_run_dir(args)
  delete = lc.queued_resource_delete_command(args.RUN_NAME, args.PROJECT, args.ZONE)
  configure = f"""#!/bin/bash
# Written by multihost_job.py for run {args.RUN_NAME}: fetch the code, run COMMAND, upload the log.
RUN_NAME={q(args.RUN_NAME)}
COMMAND={q(args.COMMAND)}
LOG_UPLOAD_PERIOD_S={LOG_UPLOAD_PERIOD_S}
DELETE_DELAY_S={DELETE_DELAY_S}
download_code() {{ {shlex.join(lc.gsutil_cp_command(f"{gcs}/code.tar.gz", "code.tar.gz"))}; }}
upload_log() {{ gsutil -q cp "$LOG" {q(gcs + "/logs/")}"$LOG_NAME"; }}
delete_queued_resource() {{ {shlex.join(delete)}; }}
"""
  return configure + _STARTUP_BODY


def job_commands(args, tarball: str, script_path: str) -> list[list[str]]:
  """Pack the code, copy it to the bucket, ask for the TPUs."""
  create = lc.queued_resource_create_command(
    args.RUN_NAME,
    args.TPU_TYPE,
    args.VERSION,
    args.NUM_SLICES,
    args.PROJECT,
    args.ZONE,
    script_path,
    autocheckpoint=lc.parse_bool(args.ENABLE_AUTOCHECKPOINT),
    extra_args=args.CQR_EXTRA_ARGS,
  )
  copy = lc.gsutil_cp_command(tarball, f"{gcs_run_dir(args)}/code.tar.gz")
  return [lc.tar_command(args.SCRIPT_DIR, tarball), copy, create]


def run_commands(commands: list[list[str]]) -> int:
  """Runs the commands in turn, each line on stderr first; 1 at the first that fails, else 0."""
  for command in commands:
    say(f"running: {shlex.join(command)}")
    try:
      code = subprocess.run(command, check=False).returncode
    except FileNotFoundError:
      raise UserError(f"{command[0]} is not installed or not on PATH") from None
    if code != 0:
      say(f"failed with exit code {code}: {shlex.join(command)}")
      return 1
  return 0


def submit(args) -> int:
  """Checks the flags, writes the startup script, and packs and copies the code and asks for the TPUs (with
  --dry-run, prints those commands instead). Returns the exit code: 1 when a command failed, 2 (with one line
  that says why) for bad flags or a missing tool.

  Args:
    args: multihost_job.py's flags (its parse_flags).
  """
  try:
    check_flags(args)
    local_dir = os.path.join("/tmp", args.RUN_NAME)
    os.makedirs(local_dir, exist_ok=True)
    tarball, script_path = os.path.join(local_dir, "code.tar.gz"), os.path.join(local_dir, "startup_script.sh")
    with open(script_path, "w", encoding="utf-8") as f:
      f.write(startup_script(args))
    commands = job_commands(args, tarball, script_path)
    if args.dry_run:
      print("\n".join(shlex.join(c) for c in commands), flush=True)
      say(f"dry run: nothing was run; the startup script is {script_path}")
      return 0
    code = run_commands(commands)
  except UserError as e:
    say(str(e))
    return 2
  if os.path.exists(tarball):
    os.remove(tarball)
  if code == 0:
    scope = shlex.join(lc.gcloud_scope(args.PROJECT, args.ZONE))
    say(f"asked for {args.NUM_SLICES} x {args.TPU_TYPE} as queued resource {args.RUN_NAME}")
    say(f"its state: gcloud alpha compute tpus queued-resources list {scope}")
    say(f"logs: {gcs_run_dir(args)}/logs/ (each worker's, every {LOG_UPLOAD_PERIOD_S // 60} minutes and at the end)")
  return code
