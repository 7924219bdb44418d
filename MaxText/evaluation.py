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


def evaluate(config, mesh, p_eval_step, params) -> dict:
  """Token-weighted mean loss over the eval data; stops at eval_steps or when every process is out of data."""
  start = time.time()
  iterator = create_eval_iterator(config, mesh)
  total_loss, total_weights, steps = 0.0, 0.0, 0
  try:
    while config.eval_steps == -1 or steps < config.eval_steps:
      metrics = jax.device_get(p_eval_step(params, next(iterator)))
      if metrics["evaluation/total_weights"] == 0:  # padding everywhere: the eval data is used up
        break
      total_loss += float(metrics["evaluation/total_loss"])
      total_weights += float(metrics["evaluation/total_weights"])
      steps += 1
  finally:
    iterator.close()
  loss = total_loss / max(total_weights, 1.0)
  return {
    "eval/loss": loss,
    "eval/perplexity": math.exp(min(loss, 700.0)),
    "eval/total_weights": total_weights,
    "eval/steps": steps,
    "eval/seconds": time.time() - start,
  }
