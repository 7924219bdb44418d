"""GRPO's reward functions: loaded by name from reward_functions_path, called with TRL's signature
f(prompts, completions, **columns) -> list[float] (`columns`: the records' other columns, one value per completion,
and `completion_ids`), weighted by reward_weights. Whatever a function does wrong (it cannot be imported, it raises,
it returns the wrong number of rewards, a NaN or something not a number) stops the run with one line naming it.
"""

import importlib.util
import math
import os
import sys
from typing import NamedTuple

import numpy as np

from MaxText.errors import UserError


class Scores(NamedTuple):
  """The rewards of a batch of completions."""

  total: np.ndarray  # (B,) float32: the weighted sum over the functions
  per_function: dict  # {function name: (B,) float32}


def _load_module(path: str):
  if not os.path.isfile(path):
    raise UserError(f"reward_functions_path={path}: no such file")
  name = "maxtext_rewards_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as error:  # pylint: disable=broad-except  # the user's file: any error is theirs, said in one line
    raise UserError(f"reward_functions_path={path} cannot be imported: {type(error).__name__}: {error}") from None
  sys.modules[name] = module
  return module


class RewardFunctions:
  """The run's reward functions.

  Args:
    path: reward_functions_path, a Python file.
    names: the functions' names in it (reward_functions, split at commas).
    weights: one per function; empty: all 1.
  """

  def __init__(self, path: str, names: list[str], weights=()):
    module = _load_module(path)
    self.functions = {}
    for name in names:
      function = getattr(module, name, None)
      if not callable(function):
        found = sorted(n for n, f in vars(module).items() if callable(f) and not n.startswith("_"))
        raise UserError(f"reward function {name}: {path} has no function of that name (it has: {', '.join(found)})")
      self.functions[name] = function
    self.weights = np.asarray(list(weights) or [1.0] * len(names), np.float32)

  def score(self, prompts: list[str], completions: list[str], columns: dict) -> Scores:
    """The rewards of completions[i] (of prompts[i]), with the records' other columns ({name: one value per row})."""
    per_function = {
      name: self._call(name, function, prompts, completions, columns) for name, function in self.functions.items()
    }
    total = sum(w * r for w, r in zip(self.weights, per_function.values()))
    return Scores(np.asarray(total, np.float32), per_function)

  @staticmethod
  def _call(name, function, prompts, completions, columns) -> np.ndarray:
    try:
      rewards = function(prompts=prompts, completions=completions, **columns)
    except Exception as error:  # pylint: disable=broad-except  # the user's function: said in one line
      raise UserError(f"reward function {name} raised {type(error).__name__}: {error}".replace("\n", " ")) from None
    if not isinstance(rewards, (list, tuple, np.ndarray)) or len(rewards) != len(completions):
      got = f"{len(rewards)} values" if hasattr(rewards, "__len__") else type(rewards).__name__
      raise UserError(f"reward function {name} returned {got} for {len(completions)} completions: return one float each")
    for i, value in enumerate(rewards):
      if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise UserError(f"reward function {name} returned {value!r} for completion {i}: return a float for each")
      if math.isnan(value):
        raise UserError(f"reward function {name} returned NaN for completion {i} ({completions[i][:80]!r})")
    return np.asarray(rewards, np.float32)
