"""train_compile.py's search mode: the largest per_device_batch_size that fits the target (per remat policy).

compile_search=per_device_batch_size doubles the batch from 1 until a compile does not fit, then bisects
between the last size that fit and the first that did not (below 1, it halves towards one row per batch
shard). compile_search=per_device_batch_size,remat_policy does that for every remat policy. Every candidate is
a real compile for the target; the table lists each with its memory, predicted step time and MFU.
"""

import dataclasses

from MaxText import max_logging, pyconfig
from MaxText.aot import aot_compile
from MaxText.configuration import common_types
from MaxText.errors import ConfigError

_LARGEST_TRIED = 4096  # per_device_batch_size; a search that fits there stops


@dataclasses.dataclass
class Candidate:
  remat_policy: str
  per_device_batch_size: float
  outcome: aot_compile.Outcome | None  # None: the config is not valid for this target (reason says why)
  reason: str = ""

  @property
  def fits(self) -> bool:
    return self.outcome is not None and self.outcome.fits


def _compile(argv, remat_policy: str, per_device_batch_size: float) -> Candidate:
  try:
    config = pyconfig.initialize(
      argv,
      for_compile_topology=True,
      remat_policy=remat_policy,
      per_device_batch_size=float(per_device_batch_size),
      compile_search="",
    )
  except ConfigError as e:
    return Candidate(remat_policy, per_device_batch_size, None, str(e))
  outcome = aot_compile.compile_for_target(config)
  candidate = Candidate(remat_policy, per_device_batch_size, outcome)
  max_logging.log(f"  {_row(candidate)}")
  return candidate


def largest_batch(argv, remat_policy: str) -> list[Candidate]:
  """The candidates tried for one remat policy, in order; the largest fitting one is the answer."""
  tried = [_compile(argv, remat_policy, 1)]
  if tried[-1].fits:
    while tried[-1].fits and tried[-1].per_device_batch_size < _LARGEST_TRIED:
      tried.append(_compile(argv, remat_policy, tried[-1].per_device_batch_size * 2))
    if tried[-1].fits:
      return tried
    low, high = int(tried[-2].per_device_batch_size), int(tried[-1].per_device_batch_size)  # fits, does not
    while high - low > 1:
      middle = (low + high) // 2
      tried.append(_compile(argv, remat_policy, middle))
      low, high = (middle, high) if tried[-1].fits else (low, middle)
    return tried
  size = 1.0
  while not tried[-1].fits and tried[-1].outcome is not None:  # stops at a size the batch shards cannot split
    size /= 2
    tried.append(_compile(argv, remat_policy, size))
  return tried


def _row(candidate: Candidate) -> str:
  head = f"{candidate.remat_policy:<24}{candidate.per_device_batch_size:>12g}"
  outcome = candidate.outcome
  if outcome is None:
    return f"{head}  not valid here: {candidate.reason}"
  memory = f"{outcome.memory.peak_bytes / 2**30:9.2f} GiB" if outcome.memory else f"{'-':>13}"
  if not outcome.fits:
    excess = outcome.excess_bytes()
    over = f" (+{excess / 2**30:.2f} GiB)" if excess is not None else ""
    return f"{head}  {memory}  does not fit{over}"
  estimate = outcome.estimate
  timing = f"{estimate.step_seconds:9.3f} s  {100 * estimate.mfu:6.1f}%" if estimate else "        -        -"
  return f"{head}  {memory}  fits          {timing}"


def run(argv, config) -> bool:
  """Searches, prints the table and the best candidate; returns whether any candidate fits."""
  if config.compile_search == "per_device_batch_size":
    policies = [config.remat_policy]
  else:
    # Saving the attention output pays only where a fused kernel would otherwise be rerun.
    fused = config.attention != "dot_product"
    policies = [p for p in common_types.REMAT_POLICIES if fused or p not in common_types.CONTEXT_REMAT_POLICIES]
  max_logging.log(
    f"Searching the largest per_device_batch_size that fits {config.compile_topology} for remat_policy "
    f"{', '.join(policies)}; each candidate is a compile:"
  )
  header = f"  {'remat_policy':<24}{'per_device_batch':>12}  {'memory/device':>13}  verdict       step (est)  MFU (est)"
  max_logging.log(header)
  candidates = []
  for policy in policies:
    candidates += largest_batch(argv, policy)
  fitting = [c for c in candidates if c.fits]
  lines = ["Search result (step time and MFU: roofline estimates):"]
  for policy in policies:
    best = max((c for c in fitting if c.remat_policy == policy), key=lambda c: c.per_device_batch_size, default=None)
    lines.append(
      f"  remat_policy={policy}: largest per_device_batch_size that fits: {best.per_device_batch_size:g}"
      if best
      else f"  remat_policy={policy}: nothing fits, not even the smallest batch"
    )
  with_estimate = [c for c in fitting if c.outcome.estimate is not None]
  if with_estimate:
    top = max(with_estimate, key=lambda c: (c.outcome.estimate.mfu, c.per_device_batch_size))
    lines.append(
      f"Best estimated MFU: remat_policy={top.remat_policy} per_device_batch_size={top.per_device_batch_size:g} "
      f"({100 * top.outcome.estimate.mfu:.1f}%, {top.outcome.estimate.step_seconds:.3f} s per step)"
    )
  for line in lines:
    max_logging.log(line)
  return bool(fitting)
