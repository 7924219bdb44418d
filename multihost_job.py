"""Creates TPU capacity through a queued resource and runs one command on every worker of it.

  python3 multihost_job.py --BUCKET_NAME=my-bucket --TPU_TYPE=v5litepod-16 --NUM_SLICES=2 \\
    --COMMAND="bash setup.sh DEVICE=tpu && python3 MaxText/train.py MaxText/configs/base.yml run_name=\\$RUN_NAME ..."
  python3 multihost_job.py ... --dry-run   # print the commands, run none

The code folder (--SCRIPT_DIR) is packed and copied to gs://BUCKET_NAME/BUCKET_DIR/RUN_NAME/code.tar.gz, then
one queued resource named RUN_NAME asks for NUM_SLICES slices (named RUN_NAME, or RUN_NAME-0, -1, ...) with a
startup script. On each worker that script fetches and unpacks the code into ~/RUN_NAME/code, makes a venv
when it can, runs COMMAND there (RUN_NAME is set in its environment), and uploads its log to
gs://.../RUN_NAME/logs/slice_S_worker_W.log every 5 minutes and at the end. Ten minutes after the command ends,
worker 0 of slice 0 deletes the queued resource, and with it the TPUs.

--dry-run prints the commands it would run, one a line (tar, gsutil, gcloud: stdout holds nothing else), and
writes the startup script they name to /tmp/RUN_NAME/startup_script.sh; without --PROJECT/--ZONE and gcloud
defaults, YOUR_PROJECT and YOUR_ZONE stand in. Bad flags exit with 2; a failing command with 1.
"""

import datetime
import getpass
import os
import re
import sys

from MaxText.errors import UserError
from MaxText.launchers import commands, queued_job


def parse_flags(argv):
  login = re.sub(r"[^a-z0-9-]", "-", getpass.getuser().lower())
  default_run = f"{login}-{datetime.datetime.now().strftime('%Y-%m-%d-%H-%M-%S')}"
  p = commands.FlagParser(prog="multihost_job.py", description=__doc__.split("\n\n", maxsplit=1)[0])
  p.add_argument("--COMMAND", required=True, help="the shell command each worker runs (include bash setup.sh)")
  p.add_argument("--BUCKET_NAME", required=True, help="GCS bucket for the code and the logs (gs:// optional)")
  p.add_argument("--BUCKET_DIR", default="", help="folder in the bucket")
  p.add_argument("--TPU_TYPE", default="v4-8")
  p.add_argument("--VERSION", default="tpu-ubuntu2204-base", help="TPU runtime version")
  p.add_argument("--NUM_SLICES", type=int, default=2)
  p.add_argument("--SCRIPT_DIR", default=os.getcwd(), help="the code folder")
  p.add_argument("--RUN_NAME", default=default_run if default_run[0].isalpha() else f"run-{default_run}")
  p.add_argument("--PROJECT", default="", help="default: gcloud's")
  p.add_argument("--ZONE", default="", help="default: gcloud's")
  p.add_argument("--CQR_EXTRA_ARGS", default="", help="more flags for `gcloud ... queued-resources create`")
  p.add_argument("--ENABLE_AUTOCHECKPOINT", default="False", help="true: save a checkpoint before maintenance")
  p.add_argument("--dry-run", action="store_true", help="print the commands and write the startup script only")
  return p.parse_args(argv)


def main(argv=None) -> int:
  try:
    args = parse_flags(argv)
  except UserError as e:
    queued_job.say(str(e))
    return 2
  return queued_job.submit(args)


if __name__ == "__main__":
  sys.exit(main())
