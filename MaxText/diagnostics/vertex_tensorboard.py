"""Uploads the run's TensorBoard directory to a Vertex AI TensorBoard while it trains (use_vertex_tensorboard).

As upstream MaxText, through cloud-accelerator-diagnostics: a TensorBoard instance named <project>-tb-instance and
an experiment named after the run are created when missing, then aiplatform's uploader follows tensorboard_dir.
The package is optional (not in requirements.txt): it pulls google-cloud-aiplatform with bigquery, genai and a
dozen more packages, and pins tensorboard-plugin-profile<2.18, whose TensorBoard plugin "profile" clashes with
xprof's. Without the package, credentials or network, one warning says what is missing and training goes on: the
data stays in tensorboard_dir. The set-up runs in a daemon thread, so a slow network never delays the first step.
"""

import contextlib
import logging
import re
import threading

from MaxText import max_logging

_PACKAGE_LOGGER = "cloud_accelerator_diagnostics"
_CLOSE_WAIT_SECONDS = 60


class _LastError(logging.Handler):
  """Keeps the package's last error instead of printing it: it logs every failure with a traceback."""

  def __init__(self):
    super().__init__(logging.ERROR)
    self.message = None

  def emit(self, record):
    error = record.exc_info[1] if record.exc_info else None
    text = f"{type(error).__name__}: {error}" if error is not None else record.getMessage()
    self.message = " ".join(text.split())[:300]


class _NotUploaded(Exception):
  """Why nothing is uploaded: a missing package, credentials or project, or an error of the Vertex AI API."""


def experiment_name(run_name: str) -> str:
  """Vertex AI experiment names are 1-128 of [a-z0-9-]."""
  return (re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-") or "maxtext")[:128]


class _Uploader:
  """The set-up thread and, once it succeeded, aiplatform's upload thread."""

  def __init__(self, project: str, region: str, run_name: str, logdir: str):
    self.project, self.region, self.logdir = project, region, logdir
    self.experiment = experiment_name(run_name)
    self.uploading = False
    self._uploader_module = None
    self._thread = threading.Thread(target=self._set_up, name="maxtext-vertex-tensorboard", daemon=True)
    self._thread.start()

  def _set_up(self) -> None:
    try:
      url = self._start()
    except Exception as e:  # pylint: disable=broad-except  # a diagnostics aid must not stop training
      reason = str(e) if isinstance(e, _NotUploaded) else f"{type(e).__name__}: {e}"
      max_logging.warn(
        f"use_vertex_tensorboard=true: nothing is uploaded to Vertex AI TensorBoard ({reason}); "
        f"the TensorBoard data stays in {self.logdir}"
      )
      return
    max_logging.log(f"Uploading {self.logdir} to Vertex AI TensorBoard: {url}")

  def _start(self) -> str:
    """Creates what is missing and starts the upload; returns the experiment's URL or raises _NotUploaded."""
    missing = []
    try:
      from cloud_accelerator_diagnostics import tensorboard, uploader  # pylint: disable=import-outside-toplevel
    except ImportError:
      missing.append("the cloud-accelerator-diagnostics package is not installed: pip install cloud-accelerator-diagnostics")
    try:
      import google.auth  # pylint: disable=import-outside-toplevel

      _, credentials_project = google.auth.default()
    except Exception as e:  # pylint: disable=broad-except  # DefaultCredentialsError, or no google-auth at all
      credentials_project = None
      missing.append(f"no Google Cloud credentials ({type(e).__name__}; gcloud auth application-default login)")
    self.project = self.project or credentials_project
    if not self.project and not missing:
      missing.append("no project: set vertex_tensorboard_project")
    if missing:
      raise _NotUploaded("; ".join(missing))
    instance = f"{self.project}-tb-instance"
    package_logger, last_error = logging.getLogger(_PACKAGE_LOGGER), _LastError()
    package_logger.addHandler(last_error)
    package_logger.propagate = False
    try:
      if tensorboard.create_instance(self.project, self.region, instance) is None:
        raise _NotUploaded(f"could not find or create the TensorBoard instance {instance}: {last_error.message}")
      _, url = tensorboard.create_experiment(self.project, self.region, self.experiment, instance)
      if url is None:
        raise _NotUploaded(f"could not find or create the experiment {self.experiment}: {last_error.message}")
      uploader.start_upload_to_tensorboard(self.project, self.region, self.experiment, instance, self.logdir)
      if last_error.message:
        raise _NotUploaded(f"the uploader did not start: {last_error.message}")
    finally:
      package_logger.removeHandler(last_error)
      package_logger.propagate = True
    self._uploader_module, self.uploading = uploader, True
    return url

  def close(self) -> None:
    self._thread.join(timeout=_CLOSE_WAIT_SECONDS)
    if self.uploading:
      try:
        self._uploader_module.stop_upload_to_tensorboard()  # uploads what is new, then stops
      except Exception as e:  # pylint: disable=broad-except
        max_logging.warn(f"use_vertex_tensorboard=true: stopping the upload failed: {type(e).__name__}: {e}")


@contextlib.contextmanager
def upload(config):
  """While inside, process 0 uploads config.tensorboard_dir to Vertex AI TensorBoard (when use_vertex_tensorboard)."""
  import jax  # pylint: disable=import-outside-toplevel

  if not config.use_vertex_tensorboard or jax.process_index() != 0:
    yield
    return
  uploader = _Uploader(
    config.vertex_tensorboard_project, config.vertex_tensorboard_region, config.run_name, config.tensorboard_dir
  )
  try:
    yield
  finally:
    uploader.close()
