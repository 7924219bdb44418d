"""Profiles of chosen train steps: profiler=xplane (jax.profiler) or nsys (NVIDIA Nsight Systems' capture range);
and, with enable_jax_profiler, a profiler server that a user captures from while the run goes on (start_server).

xplane writes <tensorboard_dir>/plugins/profile/<time>/<host>.xplane.pb, the layout that TensorBoard's profile
plugin and the standalone XProf server (package xprof) list as a run. nsys calls cudaProfilerStart/Stop through
ctypes (JAX has no API for them): they bound what `nsys profile --capture-range=cudaProfilerApi` records.

Steps skip_first_n_steps_for_profiler .. + profiler_steps - 1 (counted from the run's first step, as upstream) are
profiled, on process 0 only unless upload_all_profiler_results. The devices are synced before the first and after the
last profiled step, so that the profile holds exactly those steps.
"""

import ctypes
import glob
import os

import jax

from MaxText import max_logging

_CUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


def load_cudart():
  """CUDA's runtime library through ctypes, or None where there is none (dlopen finds the one JAX loaded first)."""
  candidates = list(_CUDART_NAMES)
  try:  # the pip wheels of jax[cuda12] keep it in the nvidia-cuda-runtime package, outside the loader's path
    import nvidia.cuda_runtime  # pylint: disable=import-outside-toplevel

    for path in nvidia.cuda_runtime.__path__:
      candidates += sorted(glob.glob(os.path.join(path, "lib", "libcudart.so*")))
  except ImportError:
    pass
  for name in candidates:
    try:
      return ctypes.CDLL(name)
    except OSError:
      continue
  return None


def start_server(config):
  """enable_jax_profiler: jax's profiler server on jax_profiler_port for the rest of the process, so that a trace can
  be captured on demand; None when off, or when the port cannot be taken (a warning: the run goes on)."""
  if not config.enable_jax_profiler:
    return None
  port = config.jax_profiler_port
  try:
    server = jax.profiler.start_server(port)
  except Exception as e:  # pylint: disable=broad-except  # the port is taken, or the profiler is missing
    max_logging.warn(f"enable_jax_profiler: no profiler server on port {port}: {' '.join(str(e).split())[:200]}")
    return None
  max_logging.log(
    f"Profiler server on port {port} (process {jax.process_index()}): capture a trace while the run goes on with "
    f"`python3 -m jax.collect_profile {port} 2000 --log_dir DIR`, or TensorBoard's profile plugin (Capture profile, "
    f"localhost:{port})"
  )
  return server


class Profiler:
  """Starts and stops the chosen profiler around the chosen steps of the loop."""

  def __init__(self, config, start_step: int):
    """Args: config: the run's Config (profiler keys, steps, tensorboard_dir); start_step: the loop's first step."""
    self.mode = config.profiler
    self.directory = config.tensorboard_dir
    self.first = start_step + config.skip_first_n_steps_for_profiler
    self.last = min(self.first + config.profiler_steps - 1, config.steps - 1)
    self._here = bool(self.mode) and (config.upload_all_profiler_results or jax.process_index() == 0)
    self._running = False
    self._reached = None  # the last profiled step that finished
    self._cudart = None
    if self.mode and self.first >= config.steps:
      max_logging.warn(
        f"profiler={self.mode}: no step to profile: this run starts at step {start_step} and "
        f"skip_first_n_steps_for_profiler={config.skip_first_n_steps_for_profiler} skips past its last step "
        f"{config.steps - 1}"
      )
      self._here = False
    if self._here and self.mode == "nsys":
      self._cudart = load_cudart()
      if self._cudart is None:
        max_logging.warn(
          f"profiler=nsys needs CUDA's runtime library (libcudart.so), which this host does not have "
          f"({jax.default_backend()} devices): no profile is taken. profiler=xplane works on every host"
        )
        self._here = False

  def before_step(self, step: int, state) -> None:
    """Starts the profiler before the first profiled step (after the previous steps have finished)."""
    if not self._here or step != self.first:
      return
    jax.block_until_ready(state)
    if self.mode == "xplane":
      jax.profiler.start_trace(self.directory)
    elif not self._cuda_call("cudaProfilerStart"):
      self._here = False  # no CUDA device (a CPU backend), or no driver: nothing would be recorded
      return
    self._running, self._reached = True, None
    max_logging.log(f"Profiling steps {self.first}-{self.last} ({self.mode})", every_process=True)

  def after_step(self, step: int, metrics) -> None:
    """Stops the profiler once the last profiled step has finished on the devices."""
    if self._running:
      self._reached = step
    if self._running and step == self.last:
      jax.block_until_ready(metrics)
      self.stop()

  def stop(self) -> None:
    """Stops a running profile (also when the loop ends early)."""
    if not self._running:
      return
    self._running = False
    if self.mode == "xplane":
      jax.profiler.stop_trace()
      where = (
        f"under {os.path.join(self.directory, 'plugins', 'profile')}/: view it with `xprof server "
        f"--logdir={self.directory}` or TensorBoard's profile tab (pip install xprof)"
      )
    else:
      self._cuda_call("cudaProfilerStop")
      where = "to the report of the nsys that runs this process (nsys profile -o ...)"
    if self._reached is None:  # stopped before the first profiled step finished
      max_logging.log(f"The profile ({self.mode}) stopped before step {self.first} finished", every_process=True)
      return
    steps = f"steps {self.first}-{self._reached}" if self._reached > self.first else f"step {self.first}"
    max_logging.log(f"The profile of {steps} ({self.mode}) went {where}", every_process=True)

  def _cuda_call(self, name: str) -> bool:
    status = getattr(self._cudart, name)()
    if status != 0:
      max_logging.warn(
        f"profiler=nsys: {name}() returned CUDA error {status} ({jax.default_backend()} devices): no profile is taken"
      )
    return status == 0
