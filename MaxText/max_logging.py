"""Console logging: one flushed line per call, so that logs of long jobs stream."""

import sys


def log(message: str) -> None:
  print(message, flush=True)


def warn(message: str) -> None:
  print(f"WARNING: {message}", file=sys.stderr, flush=True)
