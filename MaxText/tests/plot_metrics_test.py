"""Plots of metrics files (MaxText/plot_metrics.py), the end-of-run metrics.png, and eval metrics in the metrics file."""

import json
import os

import numpy as np
import pytest

from MaxText.diagnostics import metrics_file, plots
from MaxText.errors import UserError
from MaxText.tests.helpers import TRAIN_PY, read_metrics, run_python, run_train, tiny_args, tiny_config
from MaxText.training import metric_logger

PLOT_METRICS_PY = os.path.join(os.path.dirname(TRAIN_PY), "plot_metrics.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _step_metrics(loss: float) -> dict:
  names = ("learning/loss", "learning/total_weights", "learning/current_learning_rate", "learning/raw_grad_norm")
  return {name: np.float32(value) for name, value in zip(names, (loss, 64, 1e-3, 0.5))}


def _write_metrics_file(path, run_name: str, losses, eval_every: int = 0) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for step, loss in enumerate(losses):
      record = {"step": float(step), "run_name": run_name, "learning/loss": loss, "learning/current_learning_rate": 1e-3}
      record["perf/per_device_tokens_per_sec"] = 1000.0 + step
      if eval_every and (step + 1) % eval_every == 0:
        record["eval/loss"] = loss + 0.1
      f.write(json.dumps(record) + "\n")


def test_an_eval_joins_the_metrics_line_of_its_step(tmp_path):
  config = tiny_config(f"metrics_file={tmp_path / 'm.jsonl'}", tmp_path=tmp_path)
  logger = metric_logger.MetricLogger(config, 0)
  logger.record(0, _step_metrics(9.0))
  logger.record(1, _step_metrics(8.0))
  logger.flush()  # as train.py does before an eval
  logger.write_eval(
    1, {"eval/loss": 8.5, "eval/perplexity": 4914.8, "eval/steps": 2, "eval/total_weights": 128, "eval/seconds": 0.1}
  )
  logger.record(2, _step_metrics(7.0))
  logger.close()
  lines = read_metrics(tmp_path / "m.jsonl")
  assert [m["step"] for m in lines] == [0, 1, 2]
  assert "eval/loss" not in lines[0] and "eval/loss" not in lines[2]
  assert lines[1]["eval/loss"] == 8.5 and lines[1]["eval/steps"] == 2.0 and lines[1]["learning/loss"] == 8.0
  assert [(r["step"], r.get("learning/loss"), r.get("eval/loss")) for r in logger.history.records] == [
    (0, 9.0, None),
    (1, 8.0, None),
    (1, None, 8.5),
    (2, 7.0, None),
  ]


def test_history_stays_small_and_keeps_every_eval():
  history = plots.History()
  for step in range(100_000):
    history.add(step, {"learning/loss": 1.0, "perf/mfu": 0.5})
    if step % 1000 == 999:
      history.add(step, {"eval/loss": 2.0})
  train = [r["step"] for r in history.records if "eval/loss" not in r]
  assert len(train) <= 2 * plots._MAX_POINTS  # pylint: disable=protected-access
  assert len({b - a for a, b in zip(train, train[1:])}) == 1  # evenly spread
  assert train[0] == 0 and train[-1] > 95_000
  assert len([r for r in history.records if "eval/loss" in r]) == 100


def test_reading_metrics_files(tmp_path, capsys):
  good = tmp_path / "good.jsonl"
  _write_metrics_file(good, "a", [3.0, 2.0])
  with open(good, "a", encoding="utf-8") as f:
    f.write('{"step": 2.0, "learning/lo')  # a line being written
  assert [r["step"] for r in plots.read_metrics_file(str(good))] == [0, 1]
  mixed = tmp_path / "mixed.jsonl"
  mixed.write_text('{"step": 0, "learning/loss": 1.5}\nnot json\n{"step": 1, "learning/loss": 1.0}\n')
  assert len(plots.read_metrics_file(str(mixed))) == 2
  assert "mixed.jsonl: skipped 1 lines that are not metrics (line 2: not JSON)" in capsys.readouterr().err


@pytest.mark.parametrize(
  "name,text,message",
  [
    ("missing.jsonl", None, "metrics file {path} does not exist"),
    ("empty.jsonl", "\n", "metrics file {path} is empty: it has no metrics lines yet"),
    ("config.yml", "steps: 5\nrun_name: x\n", "{path} is not a metrics file: line 1 is not JSON"),
    ("list.jsonl", "[1, 2]\n", "{path} is not a metrics file: line 1 is not an object with a numeric 'step'"),
    ("other.jsonl", '{"step": 1, "accuracy": 0.5}\n', "line 1 is an object with none of learning/loss, eval/loss"),
  ],
)
def test_bad_metrics_files_are_one_clear_error(tmp_path, name, text, message):
  path = tmp_path / name
  if text is not None:
    path.write_text(text)
  with pytest.raises(UserError) as error:
    plots.read_metrics_file(str(path))
  assert message.format(path=path) in str(error.value)


def test_plot_metrics_compares_runs_and_rejects_bad_input(tmp_path):
  first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
  _write_metrics_file(first, "lr_high", [9.0, 7.0, 6.0, 5.5], eval_every=2)
  _write_metrics_file(second, "lr_low", [9.0, 8.5, 8.0, 7.8])
  output = tmp_path / "compare.png"
  result = run_python([PLOT_METRICS_PY, str(first), str(second), "--output", str(output)])
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == f"Wrote {output}: 2 run(s), 8 metrics lines"
  assert output.read_bytes().startswith(PNG_SIGNATURE)
  pdf = tmp_path / "compare.pdf"
  result = run_python([PLOT_METRICS_PY, str(first), str(first), "--output", str(pdf)])  # the same file twice: once
  assert result.returncode == 0 and result.stdout.strip() == f"Wrote {pdf}: 1 run(s), 4 metrics lines", result.stderr
  assert pdf.read_bytes().startswith(b"%PDF")
  for bad, output in (
    ([str(tmp_path / "nothing.jsonl")], "bad.png"),
    ([str(first), PLOT_METRICS_PY], "bad.png"),
    ([str(first)], "bad.jpg"),
  ):
    result = run_python([PLOT_METRICS_PY, *bad, "--output", str(tmp_path / output)])
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("Error: "), result.stderr
    assert not (tmp_path / output).exists()


def test_labels_name_runs_and_tell_equal_names_apart(tmp_path):
  for name, run_names in (("a", ["x"]), ("b", ["x"]), ("c", [None]), ("shared", ["y", "z", "y"])):
    with open(tmp_path / f"{name}.jsonl", "w", encoding="utf-8") as f:
      for step, run_name in enumerate(run_names):
        f.write(json.dumps({"step": step, "learning/loss": 1.0, **({"run_name": run_name} if run_name else {})}) + "\n")
  paths = [str(tmp_path / f"{name}.jsonl") for name in ("a", "b", "c", "shared")]
  runs = plots.runs_of_files(paths)
  assert list(runs) == [f"{paths[0]}:x", f"{paths[1]}:x", "c.jsonl", "y", "z"]
  assert [r["step"] for r in runs["y"]] == [0, 2]


def test_runs_sharing_a_metrics_file_keep_each_others_lines(tmp_path, capsys):
  path = str(tmp_path / "shared.jsonl")
  _write_metrics_file(path, "a", [3.0, 2.0, 1.5])
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps({"step": 0.0, "run_name": "b", "learning/loss": 4.0}) + "\n")
  metrics_file.keep_lines_before(path, 2, "a")  # run a resumes at step 2
  assert [(r["run_name"], r["step"]) for r in plots.read_metrics_file(path)] == [("a", 0), ("a", 1), ("b", 0)]
  assert "also holds the metrics of run(s) b: kept" in capsys.readouterr().err
  metrics_file.keep_lines_before(path, 0, "b")  # run b starts again
  assert [(r["run_name"], r["step"]) for r in plots.read_metrics_file(path)] == [("a", 0), ("a", 1)]


@pytest.mark.slow
def test_a_run_ends_with_its_plot_from_the_metrics_file_or_its_history(tmp_path):
  result, metrics = run_train(tmp_path, "plotted", "steps=4", "eval_interval=2", "eval_steps=1")
  assert result.returncode == 0, result.stderr[-3000:]
  assert [("eval/loss" in m) for m in metrics] == [False, True, False, True]
  png = tmp_path / "plotted" / "metrics.png"
  assert f"Plot of loss, eval loss, learning rate, tokens/s and MFU: {png}" in result.stdout
  assert png.read_bytes().startswith(PNG_SIGNATURE)
  args = tiny_args(f"base_output_directory={tmp_path}", "steps=2")  # no metrics_file: the logger's history
  result = run_python([TRAIN_PY, "MaxText/configs/base.yml", "run_name=unfiled", *args])
  assert result.returncode == 0, result.stderr[-3000:]
  assert (tmp_path / "unfiled" / "metrics.png").read_bytes().startswith(PNG_SIGNATURE)


def test_a_metric_gets_a_panel_of_its_own_and_a_missing_one_is_one_line(tmp_path):
  """--metric rl/reward_mean (GRPO's reward curve) adds a panel; a key that no file has names the file's keys."""
  path = tmp_path / "grpo.jsonl"
  with open(path, "w", encoding="utf-8") as f:
    for step in range(6):
      f.write(json.dumps({"step": step, "run_name": "grpo", "learning/loss": 0.1, "rl/reward_mean": step / 6}) + "\n")
  plain, reward = tmp_path / "plain.png", tmp_path / "reward.png"
  assert run_python([PLOT_METRICS_PY, str(path), "--output", str(plain)]).returncode == 0
  result = run_python([PLOT_METRICS_PY, str(path), "--metric", "rl/reward_mean", "--output", str(reward)])
  assert result.returncode == 0, result.stderr
  from PIL import Image  # pylint: disable=import-outside-toplevel

  # A third row of panels: the image is taller by half.
  assert Image.open(reward).size[1] == pytest.approx(Image.open(plain).size[1] * 1.5, rel=0.02)
  result = run_python([PLOT_METRICS_PY, str(path), "--metric", "rl/reward", "--output", str(tmp_path / "bad.png")])
  assert result.returncode == 2 and not (tmp_path / "bad.png").exists()
  assert result.stderr.strip() == (
    "Error: --metric rl/reward is in none of these metrics files; they have learning/loss, rl/reward_mean"
  )
