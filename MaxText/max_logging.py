"""Console logging: one flushed line per call, so that logs of long jobs stream.

Info lines (`log`) print on process 0 only, unless log_all_processes=true, so that a job of N processes
does not print its config and every step N times; warnings print on every process. Until an entry point
calls `configure` (after the config, and jax.distributed, are set up) every line prints: before that JAX
may not know this process's index yet, and asking would start its backend too early.
"""

import sys

_process_index = None  # None: not configured yet, print everywhere
_all_processes = True


def configure(all_processes: bool, process_index: int | None = None) -> None:
  """Chooses where info lines print from now on.

  Args:
    all_processes: print them on every process (config key log_all_processes), not only on process 0.
    process_index: this process's index (default jax.process_index()).
  """
  global _process_index, _all_processes  # pylint: disable=global-statement
  if process_index is None:
    import jax  # pylint: disable=import-outside-toplevel

    process_index = jax.process_index()
  _process_index, _all_processes = process_index, all_processes


def prints_info(process_index: int | None, all_processes: bool) -> bool:
  """Whether a process prints info lines.

  Args:
    process_index: the process's index, None before `configure`.
    all_processes: the log_all_processes setting.
  """
  return all_processes or process_index in (None, 0)


def log(message: str, every_process: bool = False) -> None:
  """Prints an info line (on process 0 only, unless configured for all processes).

  Args:
    message: the line.
    every_process: a line about this process itself (e.g. which data rows it reads): print it everywhere.
  """
  if every_process or prints_info(_process_index, _all_processes):
    print(message, flush=True)


def warn(message: str) -> None:
  """Prints a warning on stderr, on every process."""
  print(f"WARNING: {message}", file=sys.stderr, flush=True)
