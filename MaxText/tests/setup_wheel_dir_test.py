"""setup.sh WHEEL_DIR=<dir> (hosts without internet): a directory that cannot serve the install is one clear line.

Nothing is installed: pip installs into an empty --target (PIP_TARGET), so the venv's jax does not satisfy the
request and pip has to look in the directory, which lacks jax.
"""

import os
import subprocess
import sys

import pytest

from MaxText.tests.helpers import REPO_ROOT

SETUP_SH = os.path.join(REPO_ROOT, "setup.sh")


def run_setup(tmp_path, *args, env_extra=None):
  env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
  env.update(
    PYTHON=sys.executable,
    PIP_CONFIG_FILE=os.devnull,
    PIP_TARGET=str(tmp_path / "target"),
    PIP_NO_INDEX="1",
    **(env_extra or {}),
  )
  # From tmp_path, so that a relative WHEEL_DIR is read against the caller's directory.
  return subprocess.run(
    ["bash", SETUP_SH, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
  )


def last_line(result) -> str:
  return result.stderr.strip().splitlines()[-1]


def test_missing_wheel_dir(tmp_path):
  result = run_setup(tmp_path, "DEVICE=cpu", "WHEEL_DIR=no_such_dir")
  assert result.returncode == 2
  assert result.stderr.strip() == (
    "setup.sh: WHEEL_DIR=no_such_dir is not a directory "
    '(fill one with pip download: docs/setup.md, "Hosts without internet")'
  )


def test_wheel_dir_without_wheels(tmp_path):
  (tmp_path / "wheels").mkdir()
  (tmp_path / "wheels" / "promise-2.3.tar.gz").write_text("")  # a source archive is not a wheel
  result = run_setup(tmp_path, "DEVICE=cpu", "WHEEL_DIR=wheels")
  assert result.returncode == 2
  assert last_line(result).startswith(f"setup.sh: WHEEL_DIR={tmp_path / 'wheels'} holds no .whl files")


@pytest.mark.parametrize("mode", ["stable", "nightly"])
def test_wheel_dir_lacking_jax_names_it(tmp_path, mode):
  (tmp_path / "wheels").mkdir()
  (tmp_path / "wheels" / "promise-2.3-py3-none-any.whl").write_text("")  # never opened: not what is asked for
  result = run_setup(tmp_path, "DEVICE=cpu", f"MODE={mode}", "WHEEL_DIR=wheels")
  assert result.returncode == 1, result.stderr
  assert last_line(result).startswith(f"setup.sh: WHEEL_DIR={tmp_path / 'wheels'} has no wheel for jax")
  assert "that fits this host (cp3" in last_line(result)
  assert "Traceback" not in result.stderr


def test_unknown_argument(tmp_path):
  result = run_setup(tmp_path, "WHEELDIR=x")
  assert result.returncode == 2
  assert "unknown argument 'WHEELDIR=x'" in result.stderr and "WHEEL_DIR=<dir>" in result.stderr


@pytest.mark.parametrize(
  "args, message",
  [
    (["DEVICE=cpu", "TE=1"], "setup.sh: TE=1 (TransformerEngine) needs DEVICE=gpu, not DEVICE=cpu"),
    (["DEVICE=gpu", "TE=yes"], "setup.sh: TE=yes is not 0 or 1"),
  ],
)
def test_transformer_engine_extra_is_checked(tmp_path, args, message):
  result = run_setup(tmp_path, *args)
  assert result.returncode == 2
  assert result.stderr.strip() == message
