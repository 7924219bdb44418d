"""Errors that mean "the user asked for something wrong", as opposed to bugs.

Entry points catch `UserError` and print its message as one line with a non-zero exit, without a traceback
(runtime/entry_point.py). Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
  """A mistake in the user's input (config, CLI flags, data files, checkpoints)."""


class ConfigError(UserError):
  """An invalid configuration value. The message names the key, the value and what would be valid."""
