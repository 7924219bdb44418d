"""Checkpoints written by commit 1752d65 (fixtures/checkpoints_1752d65, see its make_fixtures.py) still restore:
each case's checkpoint of step 2 resumes through train.py to the end of its 5-step run, and the resumed steps'
losses equal those of that commit's uninterrupted run.

Cases: full (params, Adam's state, step, a data stream's position), lora (adapters only, over a params-only base),
fp8 (the fp8 scales and amax histories), dpo (reference_params), emergency (the local tier of emergency checkpoints).
Only the command line, the checkpoint layout on disk and the metrics file are relied on.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from MaxText.tests.helpers import REPO_ROOT, TEST_JAX_CACHE_DIR, TRAIN_PY

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "checkpoints_1752d65")
with open(os.path.join(FIXTURES, "fixtures.json"), encoding="utf-8") as _f:
  SPEC = json.load(_f)


def _resume(tmp_path, case: dict) -> tuple[subprocess.CompletedProcess, list[dict]]:
  """Copies the fixtures to tmp_path and runs the case's train.py command there; returns the process and metrics."""
  fixtures = tmp_path / "fixtures"
  shutil.copytree(FIXTURES, fixtures, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
  metrics = tmp_path / "metrics.jsonl"
  args = [a.format(fixtures=fixtures, metrics=metrics, jax_cache=TEST_JAX_CACHE_DIR) for a in case["args"]]
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")} | SPEC["env"]
  result = subprocess.run(
    [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", *args],
    cwd=REPO_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  lines = metrics.read_text(encoding="utf-8").splitlines() if metrics.exists() else []
  return result, [json.loads(line) for line in lines if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SPEC["cases"]))
def test_a_checkpoint_of_1752d65_resumes_with_the_uninterrupted_runs_losses(tmp_path, name):
  case = SPEC["cases"][name]
  assert os.path.isdir(os.path.join(FIXTURES, case["checkpoint"])), case["checkpoint"]
  result, metrics = _resume(tmp_path, case)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-5000:]
  assert case["restored_log"] in output, output[-5000:]
  expected = {int(step): loss for step, loss in case["losses_after_saved_step"].items()}
  got = {int(m["step"]): m["learning/loss"] for m in metrics}
  assert sorted(got) == sorted(expected), f"steps run after the restore: {sorted(got)}"  # resumed at saved_step + 1
  for step, loss in expected.items():
    assert got[step] == pytest.approx(loss, rel=1e-6), (
      f"{name}: step {step}'s loss {got[step]!r} != {loss!r} of commit {SPEC['commit']}'s uninterrupted run "
      f"(written with {SPEC['environment']})"
    )
