"""NaN/Inf detection (nonfinite_action: abort | skip | none): a cheap flag in the step, the location only when it trips.

In the step, the loss and the gradients' global norm (computed anyway for logging and clipping) say whether the
step is finite: a NaN or Inf in any gradient makes the norm non-finite. A non-finite step does not update the
params or the optimizer state (it still counts as a step), and only then does a lax.cond branch look for where
the values are: which parameter tensors are non-finite (per layer for scanned params) and which gradients. The
host reads that small report with the step's metrics and, for `abort`, stops the run with one line and saves
nothing (the state is the one before the step; the last checkpoint stays the last good one); for `skip`, warns
and goes on.
"""

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import max_logging
from MaxText.errors import UserError
from MaxText.layers import layer_names

SKIPPED = "learning/nonfinite_skipped"  # 1.0 in a step's metrics when its update was skipped
REPORT = "nonfinite"  # the step's report (a dict of int32 scalars), read by HostCheck


class NonFiniteError(UserError):
  """nonfinite_action=abort found a NaN or Inf: one line and a non-zero exit, and no checkpoint saved."""


def is_finite(loss, grad_norm):
  """One flag for the step: a NaN or Inf in any gradient makes their global norm non-finite."""
  return jnp.isfinite(loss) & jnp.isfinite(grad_norm)


def _finite_per_name(tree, config):
  """(N,) bool: whether each tensor of layer_names.param_names (scanned params per layer) is finite."""
  flags = []
  for keys, leaf in layer_names.flatten(tree):
    finite = jnp.isfinite(leaf)
    axis = layer_names.scan_axis(keys, leaf, config)
    if axis is not None:
      flags.append(jnp.all(finite, axis=tuple(a for a in range(leaf.ndim) if a != axis)))
    else:
      flags.append(jnp.all(finite)[None])
  return jnp.concatenate(flags)


def _backward_order(names: list[str]) -> np.ndarray:
  """The indices of `names` in the order the backward pass reaches them: after the layers (final norm, logits)
  first, then the layers from the last, then the embeddings."""

  def rank(i):
    number = layer_names.layer_number(names[i])
    if number is not None:
      return (1, -number, i)
    return (2 if "embedder" in names[i] else 0, 0, i)

  return np.array(sorted(range(len(names)), key=rank), dtype=np.int32)


def _first(bad, order=None):
  """The index of the first True of `bad` (in `order` when given), -1 when none."""
  ranked = bad if order is None else bad[order]
  first = jnp.argmax(ranked)
  index = first if order is None else jnp.asarray(order)[first]
  return jnp.where(jnp.any(bad), index, -1).astype(jnp.int32)


def locate(finite, params, grads, config) -> dict:
  """Where the non-finite values are, computed only when `finite` is False (a lax.cond; free otherwise).

  Returns:
    int32 scalars: params (how many parameter tensors, per layer, are non-finite), first_param (the first that
    the forward pass meets, an index into layer_names.param_names, -1 if none), gradients and first_gradient
    (the non-finite gradient nearest the loss, in backward order).
  """
  order = _backward_order(layer_names.param_names(params, config))

  def find():
    bad_params = ~_finite_per_name(params, config)
    bad_grads = ~_finite_per_name(grads, config)
    return {
      "params": jnp.sum(bad_params, dtype=jnp.int32),
      "first_param": _first(bad_params, order[::-1]),  # in forward order: embeddings, layers 1.., norm, logits
      "gradients": jnp.sum(bad_grads, dtype=jnp.int32),
      "first_gradient": _first(bad_grads, order),
    }

  def nothing():
    zero, none = jnp.zeros((), jnp.int32), jnp.full((), -1, jnp.int32)
    return {"params": zero, "first_param": none, "gradients": zero, "first_gradient": none}

  return jax.lax.cond(finite, nothing, find)


def describe(step: int, loss: float, report: dict, names: list[str]) -> str:
  """One line: the step and where the first non-finite value is (params, else the loss, else the gradients)."""
  if report["params"] > 0:
    where = (
      f"first in the params: {names[int(report['first_param'])]} ({int(report['params'])} of {len(names)} "
      f"parameter tensors are non-finite)"
    )
  elif not np.isfinite(loss):
    where = (
      "first in the loss, with finite params: the forward pass produced it (numerics_debug_config statistics "
      "of the layers can show where)"
    )
  elif report["gradients"] > 0:
    where = (
      f"first in the gradients: {names[int(report['first_gradient'])]} (the nearest the loss of "
      f"{int(report['gradients'])} non-finite gradient tensors; the loss is finite)"
    )
  else:
    where = "in the gradients' global norm, which overflowed although every gradient is finite"
  return f"step {step}: non-finite values (loss={loss:g}), {where}"


class HostCheck:
  """Acts on each step's report once the metric logger has written the step (called by the step loop)."""

  def __init__(self, config, params):
    self.action = config.nonfinite_action
    self.names = layer_names.param_names(params, config)
    self.skipped = 0
    self._aborted = False

  def __call__(self, step: int, scalars: dict, nested: dict) -> None:
    if self._aborted or not scalars.get(SKIPPED):
      return
    line = describe(step, scalars["learning/loss"], nested[REPORT], self.names)
    if self.action == "abort":
      self._aborted = True  # the loop's clean-up writes the steps in flight: report once
      raise NonFiniteError(
        f"{line}. nonfinite_action=abort: nothing was saved, the last checkpoint is the last good state; resume "
        "from it with nonfinite_action=skip or a lower learning_rate"
      )
    self.skipped += 1
    max_logging.warn(
      f"{line}; nonfinite_action=skip: the step's update was skipped (params and optimizer state unchanged; "
      f"{self.skipped} step(s) skipped so far)"
    )


def host_check(config, params) -> HostCheck | None:
  """The check of nonfinite_action (None for `none`)."""
  return None if config.nonfinite_action == "none" else HostCheck(config, params)
