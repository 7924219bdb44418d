"""The README quickstart, exactly as written there: it finishes in time and the loss falls enough."""

import os
import re
import shlex
import time

import pytest

from MaxText.tests.helpers import REPO_ROOT, read_metrics, run_python

TIME_LIMIT_SECONDS = 300  # on 2 CPU cores
MAX_LOSS_RATIO = 0.7  # mean loss of the last 5 steps / loss of the first step


def readme_quickstart_args() -> list[str]:
  with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  block = re.search(r"<!-- quickstart -->\n```bash\n(python3 MaxText/train.py [^\n]+)\n```", text)
  assert block, "README.md lost its quickstart block"
  return shlex.split(block.group(1))[1:]


@pytest.mark.slow
def test_readme_quickstart(tmp_path):
  metrics = tmp_path / "metrics.jsonl"
  start = time.time()
  result = run_python([*readme_quickstart_args(), f"base_output_directory={tmp_path}", f"metrics_file={metrics}"])
  elapsed = time.time() - start
  assert result.returncode == 0, result.stderr[-3000:]
  losses = [m["learning/loss"] for m in read_metrics(metrics)]
  ratio = sum(losses[-5:]) / 5 / losses[0]
  print(
    f"quickstart: {elapsed:.0f} s, first loss {losses[0]:.3f}, last-5 mean {sum(losses[-5:]) / 5:.3f}, ratio {ratio:.3f}"
  )
  assert elapsed < TIME_LIMIT_SECONDS
  assert ratio <= MAX_LOSS_RATIO
