"""What the training loop calls around its steps: the profiler, the step watchdog, and a test's injected hang or kill."""

import contextlib

import jax

from MaxText.diagnostics import profiler, watchdog
from MaxText.runtime import fault_injection


class LoopDiagnostics:
  """The diagnostics of one run of the step loop; `close()` it when the loop ends."""

  def __init__(self, config, start_step: int):
    self.profiler = profiler.Profiler(config, start_step)
    self.profiler_server = profiler.start_server(config)
    self.watchdog = watchdog.create(config, start_step)

  @contextlib.contextmanager
  def step(self, step: int, state):
    """Around getting a batch and dispatching step `step` (the profiler's trace names the step)."""
    fault_injection.hang_before(step)  # a test's hang (MAXTEXT_FAULT_INJECTION=hang_at_step:<step>)
    self.profiler.before_step(step, state)
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      yield
    fault_injection.kill_in(step)  # a test's SIGKILL while the step runs (MAXTEXT_FAULT_INJECTION=kill_in_step:<step>)

  def after_step(self, step: int, metrics) -> None:
    """After the step's metrics were handed to the logger: the heartbeat, and the profiler's last step."""
    if self.watchdog is not None:
      self.watchdog.beat(step)
    self.profiler.after_step(step, metrics)

  def activity(self, name: str):
    """A context for work between steps (an eval, a checkpoint save), which the watchdog times on its own."""
    return self.watchdog.activity(name) if self.watchdog is not None else contextlib.nullcontext()

  def close(self) -> None:
    self.profiler.stop()
    if self.profiler_server is not None:
      jax.profiler.stop_server()
    if self.watchdog is not None:
      self.watchdog.close()
