"""Counts JAX's compilation work (tracing, lowering, backend compiles) while a block of code runs.

The check that a training loop's steps reuse one compiled program: after the first step nothing should be
traced, lowered or compiled again (a new shape, dtype, sharding or a Python value baked into a jit would).
Lowering and tracing are counted too, because with the persistent compilation cache a recompile may be a
cache hit that skips the backend compile.
"""

import contextlib
import dataclasses

import jax

EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)


@dataclasses.dataclass
class CompileLog:
  """The compile events seen so far: (event name, its metadata, e.g. the function's name where JAX gives it)."""

  events: list = dataclasses.field(default_factory=list)

  def __call__(self, event: str, duration: float, **metadata) -> None:
    del duration
    if event in EVENTS:
      self.events.append((event.rsplit("/", 1)[-1], metadata))

  def __len__(self) -> int:
    return len(self.events)

  def since(self, start: int) -> list:
    return self.events[start:]

  def describe(self, start: int = 0) -> str:
    """One line naming the events after `start` (the function names where JAX reports them)."""
    names = [f"{name}({meta.get('fun_name', '?')})" if meta else name for name, meta in self.since(start)]
    return f"{len(names)} compile events: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"


@contextlib.contextmanager
def recording():
  """Yields a CompileLog that collects the compile events of the block (from every thread)."""
  log = CompileLog()
  jax.monitoring.register_event_duration_secs_listener(log)
  try:
    yield log
  finally:
    jax.monitoring.unregister_event_duration_listener(log)
