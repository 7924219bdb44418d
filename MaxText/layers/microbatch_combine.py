"""How the values that several uses of a layer give combine into what one use on the whole batch gives.

The plain stack runs each layer once, on the whole batch; the pipeline (pipeline.py) runs it once per microbatch. A
layer's sown statistic (the MoE routing statistics, the numerics reductions) and a model collection whose gradient
is a statistic rather than a sum (fp8's amax history, the numerics gradient taps) then come once per microbatch. The
module that sows the statistic, or owns the collection, registers here how the microbatches' values combine, so that
the pipeline gives their readers exactly what the plain stack gives, without knowing what they are.

A rule takes the microbatches' values stacked on a new leading axis, in microbatch order, and returns one value.
"""

from collections.abc import Callable

import jax

_RULES: dict[str, Callable] = {}


def register(name: str, rule: Callable) -> None:
  """Registers how the values sown under `name` (a sown statistic's name), or the gradient of the collection `name`,
  combine over microbatches: rule(stacked) -> combined, where `stacked` holds the microbatches' pytrees on axis 0."""
  _RULES[name] = rule


def rule(name: str) -> Callable | None:
  return _RULES.get(name)


def rows(stacked):
  """Per-row values (a batch axis first): the microbatches' rows back in the batch's order. Microbatch m holds rows
  m, m + count, ... (pipeline._microbatches), so (count, rows / count, ...) -> (rows, ...)."""

  def one(x):
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])

  return jax.tree.map(one, stacked)


def folded(pairwise: Callable) -> Callable:
  """The rule that combines the microbatches two at a time, in order, with pairwise(a, b) -> combined."""

  def rule_(stacked):
    count = jax.tree.leaves(stacked)[0].shape[0]
    total = jax.tree.map(lambda x: x[0], stacked)
    for m in range(1, count):
      total = pairwise(total, jax.tree.map(lambda x, m=m: x[m], stacked))
    return total

  return rule_


def combined(tree):
  """A sown tree whose leaves hold the microbatches' values on axis 0 -> each registered name's subtree combined
  by its rule. Raises ValueError for a sown name with no rule (the pipeline would otherwise give its reader the
  wrong statistic)."""
  if not isinstance(tree, dict):
    raise ValueError("a sown value outside a named entry cannot be combined over microbatches")
  out = {}
  for name, value in tree.items():
    if isinstance(value, dict):
      out[name] = combined(value)
    elif name in _RULES:
      out[name] = _RULES[name](value)
    else:
      raise ValueError(f"no rule says how the sown statistic {name!r} combines over pipeline microbatches")
  return out
