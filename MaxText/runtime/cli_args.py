"""argparse pieces for the command-line tools (benchmarks/): a mistake in a flag is one line, not a usage block."""

import argparse
import math

from MaxText.errors import UserError


class OneLineErrorParser(argparse.ArgumentParser):
  """argparse whose errors are a UserError: one `Error:` line and exit status 2 (run_and_exit_on_user_error)."""

  def error(self, message):
    raise UserError(f"{message} (see --help)")


def int_at_least(low: int):
  """An argparse type: an integer >= low."""

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      value = None
    if value is None or value < low:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {low}")
    return value

  return parse


def positive_number(what: str = "number"):
  """An argparse type: a finite number > 0 (e.g. what="number of seconds")."""

  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      value = math.nan
    if not (math.isfinite(value) and value > 0):
      raise argparse.ArgumentTypeError(f"{text!r} is not a {what} > 0")
    return value

  return parse
