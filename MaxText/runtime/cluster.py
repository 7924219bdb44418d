"""jax.distributed from the cluster environment: the one set-up that train, decode and compile do first.

With jax_distributed_init=auto, jax.distributed is initialised when the environment describes a
multi-process job:
  - JAX_COORDINATOR_ADDRESS (host or host:port; JAX_COORDINATOR_PORT gives the port when the address has
    none, as Vertex AI sets them) or JAX_COORDINATOR_IP, with NNODES and NODE_RANK: GPU nodes
    (Vertex AI, A3 Mega scripts, multihost_runner.py --HOSTS), or CPU processes in tests.
  - SLURM with more than one task, Kubernetes indexed Jobs, or hardware=gpu_multiprocess: JAX's own
    cluster detection.
  - A TPU VM (a host with TPU chips), or TPU_WORKER_HOSTNAMES / MEGASCALE_COORDINATOR_ADDRESS: JAX's
    TPU cluster detection (a single-host TPU VM becomes a 1-process job).
jax_distributed_init=always forces JAX's cluster detection where none of these show (e.g. TPU VMs
outside GKE whose environment says nothing); never skips it.

A coordinator that cannot be reached, or processes that never join, end the process with one line naming
the coordinator within distributed_init_timeout seconds: JAX itself would abort with a C++ stack trace. Once the job
is up, a process that dies ends the others with one line within distributed_heartbeat_timeout seconds
(peer_monitor.py).
"""

import glob
import inspect
import os
import socket
import sys
import threading
import time

import jax

from MaxText import max_logging
from MaxText.errors import ConfigError
from MaxText.runtime import peer_monitor

DEFAULT_COORDINATOR_PORT = 1234
# JAX's own deadline is set later than ours, so that our message, not its abort, reports a timeout.
_JAX_DEADLINE_MARGIN_S = 60


def _int_env(environ, name: str) -> int:
  try:
    return int(environ[name])
  except KeyError:
    raise ConfigError(
      f"{name} is not set, but JAX_COORDINATOR_ADDRESS asks for a multi-process job (set NNODES and NODE_RANK)"
    ) from None
  except ValueError:
    raise ConfigError(f"{name}={environ[name]} must be an integer") from None


def has_tpu_chips() -> bool:
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _explicit_coordinator(environ) -> dict | None:
  """coordinator_address / num_processes / process_id from the JAX_COORDINATOR_* variables, or None."""
  address = environ.get("JAX_COORDINATOR_ADDRESS") or environ.get("JAX_COORDINATOR_IP")
  if not address:
    return None
  if ":" not in address.rsplit("]", 1)[-1]:  # no port (an IPv6 literal is written [addr]:port)
    address = f"{address}:{environ.get('JAX_COORDINATOR_PORT') or DEFAULT_COORDINATOR_PORT}"
  num_processes, process_id = _int_env(environ, "NNODES"), _int_env(environ, "NODE_RANK")
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ConfigError(f"NODE_RANK={process_id} must be in [0, NNODES={num_processes})")
  return {"coordinator_address": address, "num_processes": num_processes, "process_id": process_id}


def _detected_by_jax(hardware: str, environ) -> bool:
  """Whether the environment is one of the multi-process clusters that JAX's own detection handles."""
  if hardware == "gpu_multiprocess" or int(environ.get("SLURM_NTASKS", "1") or 1) > 1:
    return True
  if environ.get("KUBERNETES_SERVICE_HOST") and environ.get("JOB_COMPLETION_INDEX"):
    return True
  if len([h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
    return True
  if environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
    return True
  return hardware in ("auto", "tpu") and has_tpu_chips() and not environ.get("JAX_PLATFORMS")


def cluster_kwargs(mode: str, hardware: str, environ) -> dict | None:
  """The jax.distributed.initialize arguments for this environment ({} = JAX's detection), or None to skip.

  Args:
    mode: jax_distributed_init: auto, always or never.
    hardware: the hardware key (gpu_multiprocess asks for JAX's detection).
    environ: the process environment.
  """
  if mode == "never":
    return None
  explicit = _explicit_coordinator(environ)
  if explicit is not None:
    return explicit
  if mode == "always" or _detected_by_jax(hardware, environ):
    return {}
  return None


def _reachable(address: str, deadline: float) -> bool:
  """Whether a TCP connection to host:port opens before the deadline (retrying: process 0 may start later)."""
  host, port = address.rsplit(":", 1)
  host = host.strip("[]")
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=max(0.1, min(5.0, deadline - time.time()))):
        return True
    except OSError:
      if time.time() >= deadline:
        return False
      time.sleep(1)


def _fail(message: str) -> None:
  """Ends the process at once with one line: the main thread may be blocked inside JAX's C++ client."""
  print(f"Error: {message}", file=sys.stderr, flush=True)
  os._exit(2)  # pylint: disable=protected-access


def _heartbeat_kwargs(heartbeat_timeout_s: int) -> dict:
  """JAX's heartbeat timeout, later than peer_monitor's, where this jax's initialize takes one."""
  if "heartbeat_timeout_seconds" not in inspect.signature(jax.distributed.initialize).parameters:
    return {}
  return {"heartbeat_timeout_seconds": peer_monitor.jax_heartbeat_timeout(heartbeat_timeout_s)}


def initialize(mode: str, hardware: str, timeout_s: int, environ=None, heartbeat_timeout_s: int = 60) -> None:
  """Initialises jax.distributed when the environment asks for it (see the module doc); no-op otherwise.

  Args:
    mode: jax_distributed_init (auto, always, never).
    hardware: the hardware key.
    timeout_s: distributed_init_timeout: seconds to reach the coordinator and for every process to join.
    environ: the process environment (default os.environ).
    heartbeat_timeout_s: distributed_heartbeat_timeout: seconds after which a silent process is lost (peer_monitor).
  """
  environ = os.environ if environ is None else environ
  kwargs = cluster_kwargs(mode, hardware, environ)
  if kwargs is None or jax.distributed.is_initialized():
    return
  address = kwargs.get("coordinator_address")
  who = f"process {kwargs['process_id']} of {kwargs['num_processes']}" if address else "this process"
  where = f"the coordinator at {address}" if address else "the coordinator that JAX's cluster detection chose"
  max_logging.log(f"Initialising jax.distributed: {who}, {where} (waiting up to {timeout_s} s)")
  deadline = time.time() + timeout_s
  if address and kwargs["process_id"] != 0 and not _reachable(address, deadline):
    _fail(
      f"jax.distributed: {who} could not reach {where} within {timeout_s} s (distributed_init_timeout). "
      "Is process 0 (NODE_RANK=0) running, and is JAX_COORDINATOR_ADDRESS its address and a port open between hosts?"
    )

  done = threading.Event()

  def watchdog():
    if not done.wait(max(1.0, deadline - time.time())):
      _fail(
        f"jax.distributed: {who} did not finish joining {where} within {timeout_s} s (distributed_init_timeout): "
        "not every process of the job connected. Check that all of them started, with the same coordinator, "
        "the same process count (NNODES) and a process id (NODE_RANK) of their own."
      )

  threading.Thread(target=watchdog, name="jax-distributed-init-watchdog", daemon=True).start()
  try:
    jax.distributed.initialize(
      **kwargs, initialization_timeout=timeout_s + _JAX_DEADLINE_MARGIN_S, **_heartbeat_kwargs(heartbeat_timeout_s)
    )
  except (ValueError, RuntimeError) as e:  # e.g. JAX's detection found no cluster under jax_distributed_init=always
    hint = "" if address else " (no cluster found: set JAX_COORDINATOR_ADDRESS, NNODES and NODE_RANK)"
    raise ConfigError(f"jax.distributed could not start ({who}, {where}): {e}{hint}") from None
  finally:
    done.set()
  max_logging.log(f"jax.distributed ready: process {jax.process_index()} of {jax.process_count()}")
  peer_monitor.start(heartbeat_timeout_s)
  gpus_per_node = environ.get("GPUS_PER_NODE")
  if gpus_per_node and gpus_per_node.isdigit() and jax.local_device_count() != int(gpus_per_node):
    max_logging.warn(
      f"GPUS_PER_NODE={gpus_per_node} but this process has {jax.local_device_count()} local devices "
      f"({jax.local_devices()[0].device_kind}); check the node type or CUDA_VISIBLE_DEVICES"
    )
