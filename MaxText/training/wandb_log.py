"""enable_wandb: the run's step and eval metrics to Weights & Biases, from process 0.

wandb is an optional dependency: enable_wandb=true without it is one line saying how to install it. The W&B run's
id is derived from wandb_run_name (default run_name), with resume="allow", so a run that resumes from a checkpoint
continues the same W&B run; W&B keeps the first value it got for a step, so steps re-run after a resume keep their
first logged values. The usual WANDB_* variables apply (WANDB_MODE=offline writes the run under
<run_dir>/wandb, for `wandb sync` later).
"""

import hashlib
import os

from MaxText import max_logging
from MaxText.errors import UserError


def _module():
  try:
    import wandb  # pylint: disable=import-outside-toplevel

    return wandb
  except ImportError:
    raise UserError("enable_wandb=true needs the wandb package: pip install wandb (or set enable_wandb=false)") from None


class WandbWriter:
  """A MetricLogger observer: logs each step's scalars at its step, and each eval's metrics; close() finishes."""

  def __init__(self, config):
    wandb = _module()
    name = config.wandb_run_name or config.run_name
    directory = config.run_dir if "://" not in config.run_dir else None  # wandb writes locally
    if directory:
      os.makedirs(directory, exist_ok=True)
    run_id = hashlib.sha1(f"{config.wandb_project}/{name}".encode()).hexdigest()[:16]  # W&B ids: no slashes
    self.run = wandb.init(
      project=config.wandb_project or "maxtext", name=name, id=run_id, resume="allow", dir=directory,
      config={"model_name": config.model_name, "steps": config.steps, "per_device_batch_size": config.per_device_batch_size,
              "global_batch_size": config.global_batch_size_to_train_on, "max_target_length": config.max_target_length,
              "learning_rate": config.learning_rate, "num_devices": config.num_devices},
    )  # fmt: skip
    max_logging.log(f"Weights & Biases: run {name} ({run_id}) of project {config.wandb_project or 'maxtext'}")

  def __call__(self, step: int, scalars: dict, nested: dict) -> None:
    del nested
    self.run.log(scalars, step=step)

  def log_eval(self, step: int, metrics: dict) -> None:
    self.run.log({name: float(value) for name, value in metrics.items()}, step=step)

  def close(self) -> None:
    self.run.finish()


def writers(config) -> list:
  """The W&B observer on process 0 when enable_wandb (none elsewhere or when off)."""
  import jax  # pylint: disable=import-outside-toplevel

  return [WandbWriter(config)] if config.enable_wandb and jax.process_index() == 0 else []
