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
import sys

from MaxText.errors import UserError
from MaxText.launchers import commands, runner


def parse_flags(argv):
  p = commands.FlagParser(prog="multihost_runner.py", description=__doc__.split("\n\n", maxsplit=1)[0])
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
  p.add_argument("--COORDINATOR_PORT", type=int, default=runner.DEFAULT_COORDINATOR_PORT, help="jax.distributed's port")
  return p.parse_args(argv)


def main(argv=None) -> int:
  try:
    args = parse_flags(argv)
  except UserError as e:
    runner.say(str(e))
    return 2
  return runner.run(args)


if __name__ == "__main__":
  sys.exit(main())
