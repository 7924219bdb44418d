"""enable_goodput_recording's events, also sent to Google Cloud Logging with ml-goodput-measurement (upstream's
recorder), where its package and Google Cloud credentials are there, so that its dashboards and its calculator see
the run. The local events file (goodput.py) is always written and is what `python3 MaxText/runtime/goodput.py` reports.

Each local event maps to the recorder's: job start and end; each step's start (its end minus its time); the compile as
training preparation; a step's data wait as data loading; checkpoint saves, restores and evals as custom badput.
"""

import datetime

from MaxText import max_logging

INSTALL = "pip install ml-goodput-measurement"
LOGGER_NAME = "goodput"  # Cloud Logging's log name
_CUSTOM = {"restore": "checkpoint_restore", "checkpoint_save": "checkpoint_save", "eval": "eval"}


def _utc(seconds: float) -> datetime.datetime:
  return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)


class CloudMirror:
  """Replays the Recorder's events on an ml_goodput_measurement GoodputRecorder."""

  def __init__(self, recorder):
    self._recorder = recorder

  def event(self, kind: str, at: float, fields: dict) -> None:
    r = self._recorder
    if kind == "job_start":
      r.record_job_start_time(_utc(at))
    elif kind == "job_end":
      r.record_job_end_time(_utc(at))
    elif kind == "step":
      start = at - fields["seconds"]
      r.record_step_start_time(fields["step"], _utc(start))
      if fields["data_seconds"] > 0:
        r.record_data_loading_start_time(_utc(start))
        r.record_data_loading_end_time(_utc(start + fields["data_seconds"]))
    elif kind == "phase":
      start, end = _utc(at - fields["seconds"]), _utc(at)
      if fields["name"] == "compile":
        r.record_training_preparation_start_time(start)
        r.record_training_preparation_end_time(end)
      elif fields["name"] in _CUSTOM:
        r.record_custom_badput_event_start_time(start, custom_badput_event_type=_CUSTOM[fields["name"]])
        r.record_custom_badput_event_end_time(end, custom_badput_event_type=_CUSTOM[fields["name"]])

  def close(self) -> None:
    self._recorder.flush()


def mirror(job_name: str) -> CloudMirror | None:
  """A CloudMirror for this job, or None (after one line saying why) where Cloud Logging cannot be reached."""
  try:
    import google.auth  # pylint: disable=import-outside-toplevel
    from google.auth import exceptions  # pylint: disable=import-outside-toplevel
    from ml_goodput_measurement import goodput  # pylint: disable=import-outside-toplevel
  except ImportError:
    max_logging.log(
      f"enable_goodput_recording: events go to the local file only (ml-goodput-measurement is not installed: {INSTALL} "
      "sends them to Cloud Logging too)"
    )
    return None
  try:
    google.auth.default()
  except exceptions.DefaultCredentialsError:
    max_logging.log(
      "enable_goodput_recording: events go to the local file only (no Google Cloud credentials here for "
      "ml-goodput-measurement's Cloud Logging)"
    )
    return None
  return CloudMirror(goodput.GoodputRecorder(job_name, LOGGER_NAME, logging_enabled=True))
