"""use_vertex_tensorboard: the upload through cloud-accelerator-diagnostics, and one warning when it cannot happen."""

import logging
import sys
import types

import google.auth
import google.auth.exceptions
import pytest

from MaxText.diagnostics import vertex_tensorboard
from MaxText.tests.helpers import run_train


def _config(tmp_path, **values):
  keys = {
    "use_vertex_tensorboard": True,
    "vertex_tensorboard_project": "",
    "vertex_tensorboard_region": "us-central1",
    "run_name": "My_Run.1",
    "tensorboard_dir": str(tmp_path / "tensorboard"),
  }
  return types.SimpleNamespace(**{**keys, **values})


def _no_credentials(*args, **kwargs):
  raise google.auth.exceptions.DefaultCredentialsError("Your default credentials were not found.")


def _fake_package(monkeypatch, instance="projects/1/locations/us-central1/tensorboards/2", url="https://x/experiment"):
  """cloud_accelerator_diagnostics as sys.modules sees it; its functions log failures as the real ones do."""
  calls = []
  logger = logging.getLogger("cloud_accelerator_diagnostics.src.tensorboard_uploader.tensorboard")

  def create_instance(project, location, tensorboard_name):
    calls.append(("create_instance", project, location, tensorboard_name))
    if instance is None:
      try:
        raise PermissionError("403 Vertex AI API has not been used in project p")
      except PermissionError:
        logger.exception("Error while creating Tensorboard instance.")
    return instance

  def create_experiment(project, location, experiment_name, tensorboard_name):
    calls.append(("create_experiment", experiment_name))
    return instance, url

  tensorboard = types.SimpleNamespace(create_instance=create_instance, create_experiment=create_experiment)
  uploader = types.SimpleNamespace(
    start_upload_to_tensorboard=lambda *args: calls.append(("start", *args)),
    stop_upload_to_tensorboard=lambda: calls.append(("stop",)),
  )
  monkeypatch.setitem(
    sys.modules, "cloud_accelerator_diagnostics", types.SimpleNamespace(tensorboard=tensorboard, uploader=uploader)
  )
  monkeypatch.setattr(google.auth, "default", lambda *a, **k: (object(), "project-of-the-credentials"))
  return calls


def _warnings(err: str) -> list[str]:
  return [line for line in err.splitlines() if line.strip()]


def test_without_package_and_credentials_one_warning(tmp_path, capfd, monkeypatch):
  monkeypatch.setitem(sys.modules, "cloud_accelerator_diagnostics", None)  # as where it is not installed
  monkeypatch.setattr(google.auth, "default", _no_credentials)
  with vertex_tensorboard.upload(_config(tmp_path, vertex_tensorboard_project="p")):
    pass
  (line,) = _warnings(capfd.readouterr().err)
  assert line.startswith("WARNING: use_vertex_tensorboard=true: nothing is uploaded to Vertex AI TensorBoard (")
  assert "the cloud-accelerator-diagnostics package is not installed: pip install cloud-accelerator-diagnostics" in line
  assert "no Google Cloud credentials (DefaultCredentialsError; gcloud auth application-default login)" in line
  assert line.endswith(f"the TensorBoard data stays in {tmp_path / 'tensorboard'}")


def test_an_api_error_is_one_line_without_the_packages_traceback(tmp_path, capfd, monkeypatch):
  calls = _fake_package(monkeypatch, instance=None)
  with vertex_tensorboard.upload(_config(tmp_path)):
    pass
  (line,) = _warnings(capfd.readouterr().err)
  assert (
    "could not find or create the TensorBoard instance project-of-the-credentials-tb-instance: "
    "PermissionError: 403 Vertex AI API has not been used in project p" in line
  )
  assert calls == [
    ("create_instance", "project-of-the-credentials", "us-central1", "project-of-the-credentials-tb-instance")
  ]


def test_upload_starts_in_the_background_and_stops_at_the_end(tmp_path, capfd, monkeypatch):
  calls = _fake_package(monkeypatch)
  with vertex_tensorboard.upload(_config(tmp_path, vertex_tensorboard_project="p")):
    pass
  out, err = capfd.readouterr()
  assert not err
  assert f"Uploading {tmp_path / 'tensorboard'} to Vertex AI TensorBoard: https://x/experiment" in out
  assert calls[1:] == [
    ("create_experiment", "my-run-1"),
    ("start", "p", "us-central1", "my-run-1", "p-tb-instance", str(tmp_path / "tensorboard")),
    ("stop",),
  ]


def test_off_does_nothing(tmp_path, capfd):
  with vertex_tensorboard.upload(_config(tmp_path, use_vertex_tensorboard=False)):
    pass
  assert capfd.readouterr() == ("", "")


@pytest.mark.slow
def test_training_without_credentials_finishes_with_one_warning(tmp_path):
  result, metrics = run_train(
    tmp_path,
    "vertex",
    "steps=3",
    "enable_tensorboard=true",
    "use_vertex_tensorboard=true",
    "vertex_tensorboard_project=my-project",
    "vertex_tensorboard_region=us-central1",
    env={"GOOGLE_APPLICATION_CREDENTIALS": "", "NO_GCE_CHECK": "True"},
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(metrics) == 3
  warnings = [line for line in result.stderr.splitlines() if "Vertex" in line]
  assert len(warnings) == 1 and "nothing is uploaded to Vertex AI TensorBoard" in warnings[0], result.stderr[-3000:]
