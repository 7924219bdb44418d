"""Goodput: the share of a run's wall time that trained steps it kept, across all its restarts.

    python3 MaxText/runtime/goodput.py RUN_DIR          # the report of a run recorded with enable_goodput_recording=true

With enable_goodput_recording, process 0 appends the run's events to <run_dir>/goodput/events.jsonl: each start of
the job (an attempt), the restore and the compile, each step (its time, and the part of it spent waiting for data),
checkpoint saves, evals, and the end. The report splits the wall time from the first start to the last event into:
productive step time (steps that no later attempt re-ran, less their data waits), and badput by cause: compile,
checkpoint restore, checkpoint saves, evals, data input, steps lost to a restart (steps that a later attempt re-ran
from its checkpoint), the time between a killed attempt's last event and the next start, and the rest of each
attempt (initialisation, logging), so that the figures add up to the wall time. monitor_goodput logs the goodput so
far every goodput_upload_interval_seconds. Where ml-goodput-measurement can reach Google Cloud Logging, the events go
there too (goodput_cloud.py). This file needs a local (or mounted) run directory, since it is appended to.
"""

import json
import os
import sys
import time

if __package__ in (None, ""):  # Run as `python3 MaxText/runtime/goodput.py`: import MaxText from this checkout.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EVENTS = "goodput/events.jsonl"
PHASES = ("compile", "restore", "checkpoint_save", "eval")
CAUSES = {  # badput causes in report order: (key, label)
  "compile": "compile",
  "restore": "checkpoint restore",
  "checkpoint_save": "checkpoint saves",
  "eval": "evals",
  "data": "data input",
  "lost": "steps lost to a restart",
  "between": "between attempts (a killed attempt's end to the next start)",
  "other": "initialisation and the rest",
}


class Recorder:
  """Appends a run's events to <run_dir>/goodput/events.jsonl (process 0 only: see recorder()).

  Args:
    run_dir: a local run directory (the file is appended to, line by line, which object stores such as gs:// do
      not allow).
    monitor_every: monitor_goodput: log the goodput so far at the first step, then every this many seconds; None: not.
  """

  def __init__(self, run_dir: str, monitor_every: float | None = None, cloud=None):
    from MaxText.errors import UserError  # pylint: disable=import-outside-toplevel

    if "://" in run_dir:
      raise UserError(
        f"enable_goodput_recording appends its events to a local file, and the run directory {run_dir} is not local: "
        "use a local (or mounted) base_output_directory, or enable_goodput_recording=false"
      )
    self.path = os.path.join(run_dir, EVENTS)
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # pylint: disable=consider-using-with  # a line each
    self._monitor_every, self._last_report = monitor_every, None
    self._cloud = cloud  # goodput_cloud.CloudMirror, or None

  def event(self, kind: str, **fields) -> None:
    now = time.time()
    self._file.write(json.dumps({"event": kind, "time": now, **fields}) + "\n")
    if self._cloud is not None:
      self._cloud.event(kind, now, fields)

  def close(self) -> None:
    self._file.close()
    if self._cloud is not None:
      self._cloud.close()

  def phase(self, name: str, seconds: float) -> None:
    self.event("phase", name=name, seconds=seconds)

  def step(self, step: int, seconds: float, data_seconds: float) -> None:
    self.event("step", step=step, seconds=seconds, data_seconds=data_seconds)
    if self._monitor_every is not None and (
      self._last_report is None or time.monotonic() - self._last_report >= self._monitor_every
    ):
      self._last_report = time.monotonic()
      from MaxText import max_logging  # pylint: disable=import-outside-toplevel

      max_logging.log(f"Goodput so far: {100 * report(read(self.path)).goodput:.1f}%")


class _Off:
  """What records nothing (enable_goodput_recording=false, or a process other than 0)."""

  def event(self, kind, **fields):
    del kind, fields

  def phase(self, name, seconds):
    del name, seconds

  def step(self, step, seconds, data_seconds):
    del step, seconds, data_seconds

  def close(self):
    pass


OFF = _Off()


def recorder(config):
  """The run's Recorder on process 0 when enable_goodput_recording, else one that records nothing."""
  import jax  # pylint: disable=import-outside-toplevel

  if not config.enable_goodput_recording or jax.process_index() != 0:
    return OFF
  from MaxText.runtime import goodput_cloud  # pylint: disable=import-outside-toplevel

  monitor_every = config.goodput_upload_interval_seconds if config.monitor_goodput else None
  return Recorder(config.run_dir, monitor_every, cloud=goodput_cloud.mirror(config.run_name))


def read(path) -> list[dict]:
  events = []
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  for line in lines:
    try:
      events.append(json.loads(line))
    except json.JSONDecodeError:
      continue  # a line cut short by a kill
  return events


class Report:
  """Seconds by cause over the whole run; wall = productive + sum(badput.values())."""

  def __init__(self, attempts: int, wall: float, productive: float, badput: dict, lost_steps: int):
    self.attempts, self.wall, self.productive, self.badput, self.lost_steps = attempts, wall, productive, badput, lost_steps

  @property
  def goodput(self) -> float:
    return self.productive / self.wall if self.wall > 0 else 0.0

  def lines(self) -> list[str]:
    share = lambda seconds: f"{seconds:.2f} s ({100 * seconds / self.wall:.1f}%)" if self.wall else "0 s"  # noqa: E731
    lines = [
      f"Goodput {100 * self.goodput:.1f}% over {self.attempts} attempt(s): productive steps {share(self.productive)} "
      f"of {self.wall:.2f} s wall time"
    ]
    for key, label in CAUSES.items():
      extra = f", {self.lost_steps} step(s)" if key == "lost" and self.lost_steps else ""
      lines.append(f"  badput, {label}: {share(self.badput[key])}{extra}")
    return lines


def _attempts(events: list[dict]) -> list[list[dict]]:
  attempts = []
  for event in events:
    if event["event"] == "job_start" or not attempts:
      attempts.append([])
    attempts[-1].append(event)
  return attempts


def report(events: list[dict]) -> Report:
  """The goodput report of a run's events (see the module doc)."""
  attempts = _attempts(events)
  badput = dict.fromkeys(CAUSES, 0.0)
  productive, lost_steps = 0.0, 0
  for k, attempt in enumerate(attempts):
    start, end = attempt[0]["time"], attempt[-1]["time"]
    later_resumes = [e["step"] for a in attempts[k + 1 :] for e in a if e["event"] == "resume"]
    redone_from = min(later_resumes) if later_resumes else None  # steps from here were re-run later
    recorded = 0.0
    for event in attempt:
      if event["event"] == "phase":
        badput[event["name"]] += event["seconds"]
        recorded += event["seconds"]
      elif event["event"] == "step":
        recorded += event["seconds"]
        if redone_from is not None and event["step"] >= redone_from:
          badput["lost"] += event["seconds"]
          lost_steps += 1
        else:
          badput["data"] += event["data_seconds"]
          productive += event["seconds"] - event["data_seconds"]
    badput["other"] += max(0.0, (end - start) - recorded)
    if k + 1 < len(attempts):
      badput["between"] += max(0.0, attempts[k + 1][0]["time"] - end)
  wall = (events[-1]["time"] - events[0]["time"]) if events else 0.0
  return Report(len(attempts), wall, productive, badput, lost_steps)


def log_report(config) -> None:
  """The run's goodput report, on process 0, at the end of an attempt."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText import max_logging  # pylint: disable=import-outside-toplevel

  if jax.process_index() == 0:
    for line in report(read(os.path.join(config.run_dir, EVENTS))).lines():
      max_logging.log(line)


def main(argv: list[str]) -> None:
  from MaxText.errors import UserError  # pylint: disable=import-outside-toplevel

  if len(argv) != 2:
    raise UserError("usage: python3 MaxText/runtime/goodput.py RUN_DIR (a run recorded with enable_goodput_recording=true)")
  path = os.path.join(argv[1], EVENTS)
  if not os.path.exists(path):
    raise UserError(f"{path} does not exist: was the run recorded with enable_goodput_recording=true?")
  print("\n".join(report(read(path)).lines()))


if __name__ == "__main__":
  from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=wrong-import-position

  run_and_exit_on_user_error(main, sys.argv)
