"""The metrics JSON-lines files: one JSON object a line, each with its "step" (and "run_name"). Their line (record),
the resume rule that the metrics_file (metric_logger.py) and the numerics statistics (diagnostics/numerics_log.py)
share, and gcs_metrics' files under <run_dir>/metrics/."""

import json
import os

import jax
from etils import epath

from MaxText import max_logging


def record(step: int, run_name: str, scalars: dict) -> dict:
  """A step's line of the metrics_file and of gcs_metrics' files (as upstream's: "step" a float)."""
  return {"step": float(step), "run_name": run_name, **scalars}


def keep_lines_before(path: str, start_step: int, run_name: str | None = None) -> None:
  """Keeps the metrics of steps before start_step: a resumed run rewrites the steps after its checkpoint
  (and a line cut short by a kill), so the file never holds a step twice or a hole.

  Args:
    path: the JSON-lines file, rewritten in place (created empty if missing).
    start_step: the first step of this run; lines of this step and later are dropped.
    run_name: this run's name: the lines of other runs (a metrics_file that several runs share) are kept
      whatever their step. None: every line is this run's.
  """
  kept, others = [], set()
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          record = json.loads(line)
          other = run_name is not None and record.get("run_name", run_name) != run_name
          if other or record["step"] < start_step:
            kept.append(line if line.endswith("\n") else line + "\n")
          if other:
            others.add(str(record["run_name"]))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
          continue
  if others:
    max_logging.warn(
      f"{path} also holds the metrics of run(s) {', '.join(sorted(others))}: kept; each line names its run_name, "
      "and the plots select by it"
    )
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(kept)


class MetricsDirWriter:
  """gcs_metrics (upstream's key): the steps' metrics as JSON lines in files under <run_dir>/metrics/, one file
  metrics_step_<first>_to_step_<last>.txt every log_period steps and at the end, for any path the run directory
  takes (a local directory, gs://, ...). A MetricLogger observer; close() writes what is left."""

  def __init__(self, config):
    self.config = config
    self.records = []

  def __call__(self, step: int, scalars: dict, nested: dict) -> None:
    del nested
    self.records.append(record(step, self.config.run_name, scalars))
    if (step + 1) % self.config.log_period == 0 or step == self.config.steps - 1:
      self.close()

  def close(self) -> None:
    if not self.records:
      return
    first, last = int(self.records[0]["step"]), int(self.records[-1]["step"])
    directory = epath.Path(self.config.metrics_dir)
    directory.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(record) + "\n" for record in self.records)
    (directory / f"metrics_step_{first:06}_to_step_{last:06}.txt").write_text(text)
    self.records = []


def dir_writers(config) -> list:
  """The metrics-directory writer of gcs_metrics, on process 0 (none elsewhere or when off)."""
  return [MetricsDirWriter(config)] if config.gcs_metrics and jax.process_index() == 0 else []
