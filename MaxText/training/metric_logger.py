"""Per-step metrics: the console line, TensorBoard scalars and the JSON-lines metrics file.

Metrics are double-buffered: step N's device values are read on the host only after step N+1 has been
dispatched, so logging never leaves the device idle.
"""

import datetime
import json
import logging
import os
import time
from typing import NamedTuple

import jax
import numpy as np
from etils import epath

from MaxText import max_logging
from MaxText.diagnostics import metrics_file, plots
from MaxText.errors import UserError
from MaxText.training import flops as flops_lib

_TENSORBOARD_FLUSH_SECONDS = 30
_EVAL_TOTALS = {"eval/loss", "eval/total_weights", "eval/steps", "eval/seconds"}


class Written(NamedTuple):
  """A step as the logger wrote it: its scalars on the host, and its dicts of arrays (a feature's statistics, the
  non-finite report), which the loop's checks read."""

  step: int
  scalars: dict
  nested: dict


def _format_eta(seconds: float) -> str:
  return str(datetime.timedelta(seconds=int(round(seconds))))


class MetricLogger:
  """Writes one console line, one set of TensorBoard scalars and one metrics_file line per completed step.

  A step's metrics may also hold dicts of arrays (a feature's statistics, the non-finite report): they are not
  logged as scalars but handed, with the step's scalars, to each observer, called as observer(step, scalars,
  nested) once the step is written (writers of other reports: the features' observers, metrics_file.MetricsDirWriter;
  an observer with close() is closed with the logger). The logger only reports: it
  returns each step it wrote (Written), and the step loop decides what follows.
  """

  def __init__(self, config, start_step: int, writer=None, observers=()):
    self.config = config
    self.writer = writer
    self.observers = list(observers)
    self.step_flops = flops_lib.training_tflops_per_device(config)
    self.tokens_per_step = flops_lib.tokens_per_device_per_step(config)
    self.peak_tflops = flops_lib.peak_tflops_per_device(jax.devices()[0].device_kind)
    self._pending = None  # (step, device metrics) of the last dispatched step
    self._last_completion = time.time()
    self._last_tb_flush = time.time()
    self._recent_step_times = []
    self._steps_written = 0
    self.history = plots.History()  # the plotted values, for the end-of-run plot when there is no metrics file
    self._last_line = None  # (step, record, file offset) of the last metrics-file line, which an eval joins
    self._metrics_file = None
    if config.metrics_file and jax.process_index() == 0:
      try:
        os.makedirs(os.path.dirname(os.path.abspath(config.metrics_file)), exist_ok=True)
        metrics_file.keep_lines_before(config.metrics_file, start_step, config.run_name)
        self._metrics_file = open(config.metrics_file, "a", encoding="utf-8")  # pylint: disable=consider-using-with
      except OSError as e:
        raise UserError(f"metrics_file={config.metrics_file} cannot be written: {e.strerror or e}") from None

  def reset_step_timer(self) -> None:
    """Restarts the step clock (e.g. after a blocking checkpoint save or eval, which is not step time)."""
    self._last_completion = time.time()

  def record(self, step: int, metrics) -> Written | None:
    """Buffers `metrics` (device arrays) of `step` and writes the previously buffered step, which it returns (None
    when none was buffered)."""
    previous, self._pending = self._pending, (step, metrics)
    return None if previous is None else self._write(*previous)

  def discard_pending(self) -> None:
    """Forgets the buffered step (the run stops on an error about an earlier step: its line must come last)."""
    self._pending = None

  def flush(self) -> Written | None:
    """Writes the buffered step now (end of training, before a checkpoint or eval); returns it as record does."""
    written = None
    if self._pending is not None:
      pending, self._pending = self._pending, None
      written = self._write(*pending)
    if self.writer is not None:
      self.writer.flush()
    return written

  def write_eval(self, step: int, metrics: dict) -> None:
    if "eval/perplexity" in metrics:
      quality = f"perplexity={metrics['eval/perplexity']:.3f}"
    else:  # an objective with metrics of its own: their means
      own = sorted(set(metrics) - _EVAL_TOTALS)
      quality = ", ".join(f"{name.removeprefix('eval/')}={metrics[name]:.4f}" for name in own)
    max_logging.log(
      f"eval after step {step}: eval_loss={metrics['eval/loss']:.4f}, {quality}, eval_steps={metrics['eval/steps']}, "
      f"total_weights={int(metrics['eval/total_weights'])}, seconds={metrics['eval/seconds']:.3f}"
    )
    if self.writer is not None:
      for name, value in metrics.items():
        self.writer.add_scalar(name, value, step)
      self.writer.flush()
    self.history.add(step, metrics)
    self._add_to_last_line(step, metrics)
    for observer in self.observers:
      if hasattr(observer, "log_eval"):  # an observer that logs evals too (wandb_log)
        observer.log_eval(step, metrics)

  def _add_to_last_line(self, step: int, metrics: dict) -> None:
    """An eval's metrics join the metrics-file line of the step it follows: the file keeps one line per step."""
    if self._metrics_file is None or self._last_line is None or self._last_line[0] != step:
      return
    _, record, offset = self._last_line
    record.update({name: float(value) for name, value in metrics.items()})
    self._metrics_file.truncate(offset)  # the line was the file's last: rewrite it with the eval's keys
    self._metrics_file.write(json.dumps(record) + "\n")
    self._metrics_file.flush()

  def _perf_metrics(self, seconds: float) -> dict:
    tflops_per_sec = self.step_flops.total_tflops / seconds
    perf = {
      "perf/step_time_seconds": seconds,
      "perf/per_device_tflops": self.step_flops.total_tflops,
      "perf/per_device_tflops_per_sec": tflops_per_sec,
      "perf/per_device_tokens": self.tokens_per_step,
      "perf/per_device_tokens_per_sec": self.tokens_per_step / seconds,
    }
    if self.peak_tflops:
      perf["perf/mfu"] = tflops_per_sec / self.peak_tflops
    return perf

  def _eta_seconds(self, step: int) -> float | None:
    if not self._recent_step_times:
      return None
    return float(np.median(self._recent_step_times)) * (self.config.steps - 1 - step)

  def _write(self, step: int, device_metrics) -> Written:
    host = jax.device_get(device_metrics)  # blocks on this step only
    nested = {k: host.pop(k) for k in [k for k, v in host.items() if isinstance(v, dict)]}
    host = {k: float(v) for k, v in host.items()}
    if host["learning/total_weights"] == 0:
      return Written(step, host, nested)  # all padding on every process: the step changed nothing, and is not reported
    now = time.time()
    seconds = max(now - self._last_completion, 1e-9)
    self._last_completion = now
    if self._steps_written:  # The first step of a run includes compilation: keep it out of the ETA.
      self._recent_step_times = (self._recent_step_times + [seconds])[-20:]
    self._steps_written += 1
    host.update(self._perf_metrics(seconds))
    self._log_line(step, host)
    self._write_tensorboard(step, host)
    self.history.add(step, host)
    if self._metrics_file is not None:
      record = metrics_file.record(step, self.config.run_name, host)
      self._last_line = (step, record, self._metrics_file.tell())
      self._metrics_file.write(json.dumps(record) + "\n")
      self._metrics_file.flush()
    for observer in self.observers:
      observer(step, host, nested)
    return Written(step, host, nested)

  def _log_line(self, step: int, m: dict) -> None:
    # grad_norm is the norm before clipping: the clipped one only repeats the threshold once clipping starts.
    line = (
      f"completed step: {step}, seconds: {m['perf/step_time_seconds']:.3f}, "
      f"TFLOP/s/device: {m['perf/per_device_tflops_per_sec']:.3f}, "
      f"Tokens/s/device: {m['perf/per_device_tokens_per_sec']:.3f}, "
      f"total_weights: {int(m['learning/total_weights'])}, loss: {m['learning/loss']:.3f}, "
      f"lr: {m['learning/current_learning_rate']:.3e}, grad_norm: {m['learning/raw_grad_norm']:.3f}"
    )
    for key in sorted(k for k in m if k.startswith("learning/") and k.endswith("_loss")):  # the loss's added terms
      line += f", {key.removeprefix('learning/')}: {m[key]:.4f}"
    if "perf/mfu" in m:
      line += f", MFU: {100 * m['perf/mfu']:.2f}%"
    eta = self._eta_seconds(step)
    if eta is not None:
      line += f", ETA: {_format_eta(eta)}"
    max_logging.log(line)

  def _write_tensorboard(self, step: int, m: dict) -> None:
    if self.writer is None:
      return
    for name, value in m.items():
      self.writer.add_scalar(name, value, step)
    if (step + 1) % self.config.log_period == 0 or time.time() - self._last_tb_flush > _TENSORBOARD_FLUSH_SECONDS:
      self.writer.flush()
      self._last_tb_flush = time.time()

  def close(self) -> None:
    self.flush()
    for observer in self.observers:
      if hasattr(observer, "close"):
        observer.close()
    if self._metrics_file is not None:
      self._metrics_file.close()
      self._metrics_file = None
    if self.writer is not None:
      self.writer.close()


def create_tensorboard_writer(config):
  """A tensorboardX writer under config.tensorboard_dir on process 0 (None elsewhere or when disabled)."""
  if not config.enable_tensorboard or jax.process_index() != 0:
    return None
  from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

  # tensorboardX warns of every NaN scalar (three per step); the step line and nonfinite_action report them once.
  logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
  epath.Path(config.tensorboard_dir).mkdir(parents=True, exist_ok=True)
  return SummaryWriter(logdir=config.tensorboard_dir, flush_secs=_TENSORBOARD_FLUSH_SECONDS)
