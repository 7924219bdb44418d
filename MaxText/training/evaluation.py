"""The eval loop: one pass over the eval data (or eval_steps batches), from its beginning every time."""

import math
import time

import jax

from MaxText.input_pipeline.input_pipeline_interface import create_eval_iterator


def check_eval_data(config, mesh) -> None:
  """Opens the eval data and reads its first batch when the run evaluates (eval_interval > 0).

  A wrong eval split, glob or file, or empty eval data, then raises the input pipeline's UserError before
  step 0 instead of at the first eval, after eval_interval steps of training.

  Args:
    config: the run's Config.
    mesh: the device mesh the eval batches are sharded over.
  """
  if config.eval_interval <= 0:
    return
  iterator = create_eval_iterator(config, mesh)
  try:
    next(iterator)
  finally:
    iterator.close()


def evaluate(config, mesh, p_eval_step, state) -> dict:
  """Mean loss over the eval data, weighted by the objective's weights (target tokens for the cross-entropy), with
  the means of the objective's metrics; stops at eval_steps or when every process is out of data. The perplexity is
  the cross-entropy's: an objective with metrics of its own has none."""
  start = time.time()
  iterator = create_eval_iterator(config, mesh)
  sums, steps = {}, 0
  try:
    while config.eval_steps == -1 or steps < config.eval_steps:
      metrics = jax.device_get(p_eval_step(state, next(iterator)))
      if metrics["evaluation/total_weights"] == 0:  # padding everywhere: the eval data is used up
        break
      for name, value in metrics.items():
        sums[name] = sums.get(name, 0.0) + float(value)
      steps += 1
  finally:
    iterator.close()
  weights = sums.pop("evaluation/total_weights", 0.0)
  loss = sums.pop("evaluation/total_loss", 0.0) / max(weights, 1.0)
  means = {f"eval/{name.removeprefix('evaluation/')}": value / max(weights, 1.0) for name, value in sums.items()}
  quality = means or {"eval/perplexity": math.exp(min(loss, 700.0))}
  return {
    "eval/loss": loss,
    **quality,
    "eval/total_weights": weights,
    "eval/steps": steps,
    "eval/seconds": time.time() - start,
  }
