"""The metrics JSON-lines files' resume rule, shared by the metrics_file (metric_logger.py) and the numerics
statistics (diagnostics/numerics_log.py): one JSON object a line, each with its "step" (and "run_name")."""

import json
import os

from MaxText import max_logging


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
