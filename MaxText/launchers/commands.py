"""The commands that multihost_runner.py and multihost_job.py run: ssh, scp, gcloud, gsutil and tar.

Every builder returns an argument list that runs without a local shell. A command for a worker travels as one
string that the worker's shell reads, so every user value in it goes through shlex.quote. Names that become
folders, hosts or ssh arguments are checked against a pattern first: a host that starts with "-" would be an
ssh option, whatever the quoting. This module must not import jax: the launchers start in a fraction of a second.
"""

import argparse
import dataclasses
import re
import shlex
import shutil
import subprocess

from MaxText.errors import UserError

# Left out of the copied code folder: version control, caches, and earlier runs' outputs.
CODE_EXCLUDES = (".git", "tmp", "maxtext_output", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache", ".venv", "venv")

_TPU_VM = ("gcloud", "compute", "tpus", "tpu-vm")
_QUEUED_RESOURCES = ("gcloud", "alpha", "compute", "tpus", "queued-resources")
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_HOST = re.compile(r"[A-Za-z0-9_\[][A-Za-z0-9._:%\[\]-]*")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9._-]*")
_GCE_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
# The ssh options every plain ssh/scp call gets: never prompt (a prompt would hang a launcher), give up on an
# unreachable host after 10 s, notice a dead connection within a minute, and record a new host's key.
DEFAULT_SSH_OPTIONS = (
  "BatchMode=yes",
  "ConnectTimeout=10",
  "ServerAliveInterval=15",
  "ServerAliveCountMax=4",
  "StrictHostKeyChecking=accept-new",
)


class FlagParser(argparse.ArgumentParser):
  """argparse with one line for a bad flag (a UserError: exit status 2, no usage block)."""

  def error(self, message):
    raise UserError(f"{message} (see --help)")


def parse_bool(text: str) -> bool:
  """Upstream's bool flags are strings: "true" in any case is True, anything else False."""
  return str(text).lower() == "true"


def check_run_name(name: str, gce: bool = False) -> str:
  """The run name, if it is a safe folder name (or, with gce=True, a Google Cloud resource name)."""
  if gce and not _GCE_NAME.fullmatch(name):
    raise UserError(
      f"RUN_NAME={name!r} is not a valid queued resource name: lowercase letters, digits and '-', "
      "starting with a letter, at most 63 characters"
    )
  if not _RUN_NAME.fullmatch(name):
    raise UserError(
      f"RUN_NAME={name!r} is not a safe folder name: use letters, digits, '.', '_' and '-' (at most 100, "
      "starting with a letter or digit)"
    )
  return name


def check_gce_name(flag: str, name: str) -> str:
  if not _GCE_NAME.fullmatch(name):
    raise UserError(f"{flag}={name!r} is not a Google Cloud resource name (lowercase letters, digits and '-')")
  return name


def require_gcloud(why: str) -> str:
  path = shutil.which("gcloud")
  if not path:
    raise UserError(f"gcloud is not installed or not on PATH; it is needed {why}")
  return path


def gcloud_default(key: str) -> str:
  """A value of the gcloud config (`project`, `compute/zone`), or "" when unset or gcloud is missing."""
  if not shutil.which("gcloud"):
    return ""
  result = subprocess.run(["gcloud", "config", "get-value", key], capture_output=True, text=True, check=False)
  value = result.stdout.strip()
  return "" if result.returncode or value == "(unset)" else value


def gcloud_scope(project: str, zone: str) -> list[str]:
  return [f"--project={project}", f"--zone={zone}"]


def tar_command(script_dir: str, tarball: str) -> list[str]:
  """Packs the code folder (without CODE_EXCLUDES) into a gzipped tarball."""
  excludes = [f"--exclude={pattern}" for pattern in CODE_EXCLUDES]
  return ["tar", *excludes, "-czf", tarball, "-C", script_dir, "."]


def gsutil_cp_command(source: str, destination: str) -> list[str]:
  return ["gsutil", "-q", "cp", source, destination]


def tpu_list_command(prefix: str, project: str, zone: str) -> list[str]:
  """The names of the TPU VMs whose name contains the prefix, one a line."""
  return [*_TPU_VM, "list", f"--filter=name~{prefix}", "--format=value(name.basename())", *gcloud_scope(project, zone)]


def tpu_ips_command(tpu_name: str, project: str, zone: str) -> list[str]:
  """The internal IP of each worker of a TPU VM, one a line, worker 0 first."""
  endpoints = ["--flatten=networkEndpoints[]", "--format=value(networkEndpoints.ipAddress)"]
  return [*_TPU_VM, "describe", tpu_name, *endpoints, *gcloud_scope(project, zone)]


def queued_resource_create_command(
  name: str,
  tpu_type: str,
  version: str,
  num_slices: int,
  project: str,
  zone: str,
  startup_script: str,
  autocheckpoint: bool = False,
  extra_args: str = "",
) -> list[str]:
  """Asks for NUM_SLICES slices of TPU_TYPE (named RUN_NAME, or RUN_NAME-0, -1... for several)."""
  nodes = [f"--node-count={num_slices}", f"--node-prefix={name}"] if num_slices > 1 else [f"--node-id={name}"]
  return [
    *_QUEUED_RESOURCES,
    "create",
    name,
    f"--accelerator-type={tpu_type}",
    f"--runtime-version={version}",
    *nodes,
    *gcloud_scope(project, zone),
    f"--metadata-from-file=startup-script={startup_script}",
    *(["--autocheckpoint-enabled"] if autocheckpoint else []),
    *shlex.split(extra_args or ""),
  ]


def queued_resource_delete_command(name: str, project: str, zone: str) -> list[str]:
  return [*_QUEUED_RESOURCES, "delete", name, "--force", "--quiet", *gcloud_scope(project, zone)]


@dataclasses.dataclass(frozen=True)
class SshHost:
  """A worker reached with plain ssh/scp (GPU and CPU clusters)."""

  host: str
  user: str = ""
  key: str = ""
  port: int = 0
  options: tuple[str, ...] = ()

  def __post_init__(self):
    if not _HOST.fullmatch(self.host):
      raise UserError(f"host {self.host!r} is not a host name or IP address")
    if self.user and not _USER.fullmatch(self.user):
      raise UserError(f"SSH_USER={self.user!r} is not a user name")

  @property
  def address(self) -> str:
    """The address other workers reach this one at (the coordinator's host)."""
    return f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host

  def _options(self) -> list[str]:
    args = []
    # ssh keeps the first value it is given for an option: the user's come before the defaults.
    for option in (*self.options, *([f"User={self.user}"] if self.user else []), *DEFAULT_SSH_OPTIONS):
      args += ["-o", option]
    return args + (["-i", self.key] if self.key else [])

  def ssh(self, remote_command: str) -> list[str]:
    port = ["-p", str(self.port)] if self.port else []
    return ["ssh", *self._options(), *port, "--", self.host.strip("[]"), remote_command]

  def copy_to(self, local_path: str, remote_path: str) -> list[str]:
    port = ["-P", str(self.port)] if self.port else []
    return ["scp", *self._options(), *port, "--", local_path, f"{self.address}:{remote_path}"]

  def __str__(self):
    return self.host


@dataclasses.dataclass(frozen=True)
class TpuWorker:
  """One worker (host) of a TPU VM, reached through `gcloud compute tpus tpu-vm ssh/scp --worker=N`."""

  tpu_name: str
  worker: int
  ip: str
  project: str
  zone: str
  internal_ip: bool = False

  @property
  def address(self) -> str:
    return self.ip

  def _flags(self) -> list[str]:
    flags = [f"--worker={self.worker}", "--strict-host-key-checking=no", *gcloud_scope(self.project, self.zone)]
    return flags + (["--internal-ip"] if self.internal_ip else [])

  def ssh(self, remote_command: str) -> list[str]:
    return [*_TPU_VM, "ssh", self.tpu_name, *self._flags(), f"--command={remote_command}"]

  def copy_to(self, local_path: str, remote_path: str) -> list[str]:
    return [*_TPU_VM, "scp", local_path, f"{self.tpu_name}:{remote_path}", *self._flags()]

  def __str__(self):
    return f"{self.tpu_name} worker {self.worker}, {self.ip}"
