"""profiler=xplane writes a trace that the profile plugin (xprof) lists; profiler=nsys calls cudaProfilerStart/Stop."""

import ctypes
import glob
import os
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from MaxText.diagnostics import profiler
from MaxText.tests.helpers import run_train

STEPS = 6


def _config(tmp_path, **values):
  keys = {
    "profiler": "xplane",
    "tensorboard_dir": str(tmp_path / "tensorboard"),
    "skip_first_n_steps_for_profiler": 1,
    "profiler_steps": 2,
    "upload_all_profiler_results": False,
    "steps": STEPS,
  }
  return types.SimpleNamespace(**{**keys, **values})


def _toy_loop(prof):
  """A jitted 'step' in the profiler's loop calls, as train.py makes them."""
  step_fn = jax.jit(lambda x: jnp.tanh(x @ x))
  state = jnp.ones((64, 64)) / 64
  for step in range(STEPS):
    prof.before_step(step, state)
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      state = step_fn(state)
    prof.after_step(step, state)
  prof.stop()


def listed_profile_runs(logdir: str, monkeypatch) -> dict:
  """{run: tools} as the profile plugin lists them (xprof's ProfilePlugin, without a TensorBoard server)."""
  if "tensorflow" not in sys.modules:  # the plugin's optional remote-capture import takes seconds; it is not needed
    monkeypatch.setitem(sys.modules, "tensorflow", None)
  from xprof import profile_plugin  # pylint: disable=import-outside-toplevel

  context = types.SimpleNamespace(
    logdir=logdir, data_provider=None, flags=types.SimpleNamespace(master_tpu_unsecure_channel="")
  )
  plugin = profile_plugin.ProfilePlugin(context)
  return {run: plugin.run_tools_imp(run) for run in plugin.runs_imp()}


def test_xplane_trace_is_listed_by_the_profile_plugin(tmp_path, monkeypatch):
  prof = profiler.Profiler(_config(tmp_path), start_step=0)
  assert (prof.first, prof.last) == (1, 2)
  _toy_loop(prof)
  (trace,) = glob.glob(str(tmp_path / "tensorboard" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  run = os.path.basename(os.path.dirname(trace))
  runs = listed_profile_runs(str(tmp_path / "tensorboard"), monkeypatch)
  assert list(runs) == [run]
  assert {"overview_page", "trace_viewer@"} <= set(runs[run])


def test_profiled_steps_are_counted_from_the_runs_first_step(tmp_path, capsys):
  prof = profiler.Profiler(_config(tmp_path, profiler_steps=5), start_step=3)
  assert (prof.first, prof.last) == (4, STEPS - 1)  # clipped to the last step
  profiler.Profiler(_config(tmp_path, skip_first_n_steps_for_profiler=3), start_step=4)  # a resumed run
  assert "profiler=xplane: no step to profile: this run starts at step 4" in capsys.readouterr().err


def test_nsys_without_cuda_is_one_warning_and_no_profile(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(profiler, "load_cudart", lambda: None)
  _toy_loop(profiler.Profiler(_config(tmp_path, profiler="nsys"), start_step=0))
  err = capsys.readouterr().err
  assert err.count("WARNING: profiler=nsys needs CUDA's runtime library (libcudart.so), which this host does not") == 1
  assert "(cpu devices): no profile is taken" in err


def test_a_profile_stopped_early_names_the_steps_it_holds(tmp_path, capsys):
  prof = profiler.Profiler(_config(tmp_path, profiler_steps=4), start_step=0)
  state = jnp.ones(())
  for step in (0, 1, 2):  # the run stops (SIGTERM, an error) after step 2 of the profiled 1-4
    prof.before_step(step, state)
    prof.after_step(step, state)
  prof.stop()
  out = capsys.readouterr().out
  assert "Profiling steps 1-4 (xplane)" in out and "The profile of steps 1-2 (xplane) went under" in out


FAKE_CUDART = """
int starts = 0, stops = 0;
int cudaProfilerStart(void) { starts++; return STATUS; }
int cudaProfilerStop(void) { stops++; return STATUS; }
"""


def _build_cudart(tmp_path, status: int):
  if not shutil.which("cc"):
    pytest.skip("no C compiler to build a stand-in libcudart.so")
  source = tmp_path / "cudart.c"
  source.write_text(FAKE_CUDART.replace("STATUS", str(status)))
  library = tmp_path / "lib" / "libcudart.so"
  library.parent.mkdir()
  subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
  return library


@pytest.fixture(name="fake_cudart")
def fixture_fake_cudart(tmp_path):
  """A libcudart.so with counting cudaProfilerStart/Stop, built with the C compiler."""
  return _build_cudart(tmp_path, 0)


def test_nsys_where_cuda_has_no_device_is_one_warning_and_no_profile(tmp_path, capsys, monkeypatch):
  library = _build_cudart(tmp_path, 35)  # cudaErrorInsufficientDriver, as on a host with CUDA's runtime and no GPU
  monkeypatch.setattr(profiler, "_CUDART_NAMES", (str(library),))
  _toy_loop(profiler.Profiler(_config(tmp_path, profiler="nsys"), start_step=0))
  captured = capsys.readouterr()
  assert captured.err.count("WARNING: profiler=nsys: cudaProfilerStart() returned CUDA error 35") == 1
  assert "no profile is taken" in captured.err
  assert "Profiling" not in captured.out and "The profile" not in captured.out


def test_nsys_brackets_the_profiled_steps_with_cuda_profiler_calls(tmp_path, fake_cudart, monkeypatch):
  monkeypatch.setattr(profiler, "_CUDART_NAMES", (str(fake_cudart),))
  prof = profiler.Profiler(_config(tmp_path, profiler="nsys"), start_step=0)
  library = ctypes.CDLL(str(fake_cudart))  # the same handle: the counters the profiler's calls change
  calls = []
  step_fn = jax.jit(lambda x: x + 1)
  state = jnp.zeros(())
  for step in range(STEPS):
    prof.before_step(step, state)
    state = step_fn(state)
    prof.after_step(step, state)
    calls.append((ctypes.c_int.in_dll(library, "starts").value, ctypes.c_int.in_dll(library, "stops").value))
  assert calls == [(0, 0), (1, 0), (1, 1), (1, 1), (1, 1), (1, 1)]  # started before step 1, stopped after step 2


@pytest.mark.slow
def test_training_writes_a_profile_the_plugin_lists(tmp_path, monkeypatch):
  result, metrics = run_train(
    tmp_path, "profiled", "steps=4", "profiler=xplane", "skip_first_n_steps_for_profiler=1", "profiler_steps=2"
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(metrics) == 4
  assert "Profiling steps 1-2 (xplane)" in result.stdout
  logdir = tmp_path / "profiled" / "tensorboard"
  assert f"The profile of steps 1-2 (xplane) went under {logdir}/plugins/profile/" in result.stdout
  (trace,) = glob.glob(str(logdir / "plugins" / "profile" / "*" / "*.xplane.pb"))
  runs = listed_profile_runs(str(logdir), monkeypatch)
  assert list(runs) == [os.path.basename(os.path.dirname(trace))]
  assert "trace_viewer@" in next(iter(runs.values()))


@pytest.mark.slow
def test_training_with_nsys_calls_the_cuda_profiler_around_the_steps(tmp_path, fake_cudart):
  env = {"LD_LIBRARY_PATH": str(fake_cudart.parent)}
  result, _ = run_train(tmp_path, "nsys", "steps=4", "profiler=nsys", "profiler_steps=2", env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [line for line in result.stdout.splitlines() if "nsys" in line or line.startswith("completed step")]
  assert lines.index("Profiling steps 1-2 (nsys)") < lines.index(
    next(line for line in lines if line.startswith("The profile of steps 1-2 (nsys) went to the report"))
  )
  assert "WARNING" not in result.stderr


def test_diagnostics_keys_leave_the_compiled_step_alone():
  from MaxText.aot import compiled_step_file  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import tiny_config  # pylint: disable=import-outside-toplevel

  diagnostics = tiny_config(
    "collect_stack_trace=true",
    "stack_trace_to_cloud=true",
    "stack_trace_interval_seconds=5",
    "step_watchdog=true",
    "step_watchdog_factor=3",
    "step_watchdog_min_seconds=7",
    "profiler=xplane",
    "upload_all_profiler_results=true",
    "skip_first_n_steps_for_profiler=2",
    "profiler_steps=3",
    "enable_tensorboard=true",
    "use_vertex_tensorboard=true",
    "vertex_tensorboard_project=p",
    "vertex_tensorboard_region=us-central1",
  )
  devices = jax.devices()
  assert compiled_step_file.step_signature(diagnostics, devices) == compiled_step_file.step_signature(
    tiny_config("enable_tensorboard=true"), devices
  )
