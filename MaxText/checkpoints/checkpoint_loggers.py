"""Where Orbax's checkpoint events (each save and restore: its step, kind and durations) are logged.

enable_checkpoint_standard_logger: one line each in the run's log. enable_checkpoint_cloud_logger: to Google Cloud
Logging (Orbax's CloudLogger, log name "orbax_checkpoint"), where the google-cloud-logging package and Google Cloud
credentials are there; where they are not, one line says so and the run goes on without it.
"""

import json

import orbax.checkpoint as ocp

from MaxText import max_logging

CLOUD_INSTALL = "pip install google-cloud-logging"


class OrbaxEventLog(ocp.logging.AbstractLogger):
  """enable_checkpoint_standard_logger: Orbax's record of each save and restore (its step, kind and durations), one
  line each. Orbax's own StandardLogger writes at absl's INFO level, which a run does not show."""

  def log_entry(self, entry, *args, **kwargs):
    del args, kwargs
    fields = {k: v for k, v in entry.items() if v is not None} if isinstance(entry, dict) else {"event": entry}
    max_logging.log(f"Orbax checkpoint event: {json.dumps(fields, default=str, sort_keys=True)}")


def cloud_logger(job_name: str):
  """Orbax's CloudLogger for this job, or None (after one line saying why) where Cloud Logging cannot be reached."""
  try:
    import google.auth  # pylint: disable=import-outside-toplevel
    import google.cloud.logging  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import  # Orbax's client
    from google.auth import exceptions  # pylint: disable=import-outside-toplevel
    from orbax.checkpoint._src.logging import cloud_logger as orbax_cloud  # pylint: disable=import-outside-toplevel
  except ImportError:
    max_logging.warn(
      f"enable_checkpoint_cloud_logger: the google-cloud-logging package is not installed ({CLOUD_INSTALL}); "
      "checkpoint events are not sent to Cloud Logging"
    )
    return None
  try:
    google.auth.default()
  except exceptions.DefaultCredentialsError:
    max_logging.warn(
      "enable_checkpoint_cloud_logger: no Google Cloud credentials here (gcloud auth application-default login, or "
      "a VM's service account); checkpoint events are not sent to Cloud Logging"
    )
    return None
  return _NeverFails(orbax_cloud.CloudLogger(orbax_cloud.CloudLoggerOptions(job_name=job_name)))


class _NeverFails(ocp.logging.AbstractLogger):
  """A logger whose failures (Cloud Logging unreachable, a quota) never fail the save or restore it reports: the
  first one is a warning, later ones are dropped."""

  def __init__(self, logger):
    self._logger, self._failed = logger, False

  def log_entry(self, entry, *args, **kwargs):
    try:
      self._logger.log_entry(entry, *args, **kwargs)
    except Exception as error:  # pylint: disable=broad-except  # a log line must not cost the checkpoint
      if not self._failed:
        max_logging.warn(f"could not send a checkpoint event to Cloud Logging ({type(error).__name__}: {error})")
      self._failed = True


def create(config) -> ocp.logging.AbstractLogger | None:
  """The logger of the run's checkpoint managers (None: Orbax's default)."""
  loggers = []
  if config.enable_checkpoint_standard_logger:
    loggers.append(OrbaxEventLog())
  if config.enable_checkpoint_cloud_logger:
    cloud = cloud_logger(config.run_name)
    if cloud is not None:
      loggers.append(cloud)
  if len(loggers) > 1:
    return ocp.logging.CompositeLogger(*loggers)
  return loggers[0] if loggers else None
