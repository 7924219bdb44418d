"""train.py's loop compiles nothing after its first step: every later step reuses the compiled train step, and
the loop's own jitted helpers (metrics, checkpoint saves, eval) compile at their first use only."""

import jax
import jax.numpy as jnp
import pytest

from MaxText import train
from MaxText.aot import aot_compile, compile_events
from MaxText.tests.helpers import tiny_config


def _loop_compiles_after_first_step(tmp_path, monkeypatch, *args) -> str:
  """Runs train_loop on the tiny model and returns a description of what compiled after the first step ("")."""
  calls = []  # len(log) at the start of each step
  compile_step = aot_compile.compile_train_step

  def recorded_compile(*a, **k):
    compiled = compile_step(*a, **k)

    def step(state, batch):
      calls.append(len(log))
      return compiled(state, batch)

    return step

  monkeypatch.setattr(aot_compile, "compile_train_step", recorded_compile)
  config = tiny_config("steps=6", "checkpoint_period=2", "eval_interval=2", *args, tmp_path=tmp_path)
  with compile_events.recording() as log:
    train.train_loop(config)
  assert len(calls) == 6
  return log.describe(calls[2]) if len(log) > calls[2] else ""


def test_no_compilation_after_the_first_step(tmp_path, monkeypatch):
  # From the start of the third step: the second step's end sees the first checkpoint save and eval.
  assert _loop_compiles_after_first_step(tmp_path, monkeypatch) == ""


def test_a_recompiling_loop_is_caught(tmp_path, monkeypatch):
  """The check can fail: a jitted function called with a new shape each step compiles every step."""
  original = aot_compile.compile_train_step

  def recompiling(*a, **k):
    compiled = original(*a, **k)
    counter = iter(range(1, 100))

    def step(state, batch):
      jax.jit(jnp.sum)(jnp.zeros(next(counter)))  # a new shape per step: a new program
      return compiled(state, batch)

    return step

  monkeypatch.setattr(aot_compile, "compile_train_step", recompiling)
  with pytest.raises(AssertionError, match="compile events"):
    assert _loop_compiles_after_first_step(tmp_path, monkeypatch) == ""
