"""JAX process set-up that entry points do first (besides jax.distributed, see cluster.py): which backend
JAX starts on a host with libtpu but no TPU, and the compile cache."""

import glob
import importlib.util
import os

import jax

from MaxText.runtime.cluster import has_tpu_chips


def skip_absent_tpu(hardware: str, environ=None) -> None:
  """Keeps JAX off the TPU backend on a host without TPU chips where libtpu is installed.

  libtpu is installed on CPU hosts to compile for TPU targets (train_compile.py); JAX would still try to start
  a TPU there, printing errors and taking libtpu's lock file. Not when the user chose platforms (JAX_PLATFORMS)
  or hardware=tpu, or the host has GPUs.
  """
  environ = os.environ if environ is None else environ
  if environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or hardware == "tpu":
    return
  if importlib.util.find_spec("libtpu") is None or has_tpu_chips() or glob.glob("/dev/nvidia[0-9]*"):
    return
  if not backends_started():
    jax.config.update("jax_platforms", "cpu")


def backends_started() -> bool:
  """Whether JAX has started its backends in this process (after that, XLA_FLAGS and jax_platforms are read).

  JAX has no public API for this; should its private one move in a later release, say not started: the callers then
  set platforms or flags that JAX ignores at worst, instead of failing the run.
  """
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel

  started = getattr(xla_bridge, "backends_are_initialized", None)
  return bool(started()) if started is not None else False


def enable_compilation_cache(cache_dir: str) -> None:
  """Persistent compilation cache, so that a second start of the same program skips compilation."""
  if not cache_dir:
    return
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # a threshold the user sets wins
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
