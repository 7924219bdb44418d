"""JAX process set-up that entry points do first: jax.distributed from the cluster, and the compile cache.

jax.distributed is only initialised when the environment describes a multi-process job:
  - JAX_COORDINATOR_ADDRESS (host[:port]) with NNODES and NODE_RANK: GPU nodes, or CPU processes in tests.
  - JAX_COORDINATOR_IP / JAX_COORDINATOR_PORT with NNODES and NODE_RANK: the upstream GPU variables.
  - SLURM with more than one task, or hardware=gpu_multiprocess: JAX's own cluster auto-detection.
  - A TPU slice with several hosts (TPU_WORKER_HOSTNAMES lists more than one) or a multislice job.
"""

import glob
import importlib.util
import os

import jax

from MaxText import max_logging
from MaxText.errors import ConfigError

DEFAULT_COORDINATOR_PORT = 1234


def _int_env(environ, name: str) -> int:
  try:
    return int(environ[name])
  except KeyError:
    raise ConfigError(
      f"{name} is not set, but JAX_COORDINATOR_ADDRESS asks for a multi-process job (set NNODES and NODE_RANK)"
    ) from None
  except ValueError:
    raise ConfigError(f"{name}={environ[name]} must be an integer") from None


def _cluster_kwargs(hardware: str, environ) -> dict | None:
  """The jax.distributed.initialize arguments the environment asks for, or None for a single process."""
  address = environ.get("JAX_COORDINATOR_ADDRESS")
  if not address and environ.get("JAX_COORDINATOR_IP"):
    address = f"{environ['JAX_COORDINATOR_IP']}:{environ.get('JAX_COORDINATOR_PORT', DEFAULT_COORDINATOR_PORT)}"
  if address:
    if ":" not in address:
      address = f"{address}:{DEFAULT_COORDINATOR_PORT}"
    return {
      "coordinator_address": address,
      "num_processes": _int_env(environ, "NNODES"),
      "process_id": _int_env(environ, "NODE_RANK"),
    }
  if hardware == "gpu_multiprocess" or int(environ.get("SLURM_NTASKS", "1") or 1) > 1:
    return {}
  if len([h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1 or environ.get(
    "MEGASCALE_COORDINATOR_ADDRESS"
  ):
    return {}
  return None


def _has_tpu_chips() -> bool:
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def skip_absent_tpu(hardware: str, environ=None) -> None:
  """Keeps JAX off the TPU backend on a host without TPU chips where libtpu is installed.

  libtpu is installed on CPU hosts to compile for TPU targets (train_compile.py); JAX would still try to start
  a TPU there, printing errors and taking libtpu's lock file. Not when the user chose platforms (JAX_PLATFORMS)
  or hardware, or the host has GPUs.
  """
  environ = os.environ if environ is None else environ
  if environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or hardware not in ("auto", "cpu"):
    return
  if importlib.util.find_spec("libtpu") is None or _has_tpu_chips() or glob.glob("/dev/nvidia[0-9]*"):
    return
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel

  if not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")


def maybe_initialize_distributed(hardware: str, environ=None) -> None:
  """Initialises jax.distributed when the environment describes a multi-process job (see module doc)."""
  environ = os.environ if environ is None else environ
  kwargs = _cluster_kwargs(hardware, environ)
  if kwargs is None or jax.distributed.is_initialized():
    return
  max_logging.log(f"Initialising jax.distributed {kwargs or '(cluster auto-detection)'}")
  jax.distributed.initialize(**kwargs)
  max_logging.log(f"jax.distributed ready: process {jax.process_index()} of {jax.process_count()}")


def enable_compilation_cache(cache_dir: str) -> None:
  """Persistent compilation cache, so that a second start of the same program skips compilation."""
  if not cache_dir:
    return
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
