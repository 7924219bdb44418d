"""Errors in a run: a bad eval source fails before step 0; an error mid-run keeps what was trained."""

import os

import pytest

from MaxText.input_pipeline import sample_datasets, tf_example
from MaxText.tests.helpers import run_train


def _documents(count: int) -> list[str]:
  return [f"document {i} " * 4 for i in range(count)]


def _grain_train(tmp_path) -> list[str]:
  files = sample_datasets.write_array_records(str(tmp_path / "train"), _documents(200), num_shards=1)
  return ["dataset_type=grain", f"grain_train_files={files[0]}"]


def _error_lines(result) -> list[str]:
  return [line for line in result.stderr.splitlines() if line.startswith("Error: ")]


def test_a_wrong_eval_glob_stops_before_step_0(tmp_path):
  result, metrics = run_train(
    tmp_path,
    "bad_eval",
    "steps=4",
    "eval_interval=2",
    f"grain_eval_files={tmp_path}/no_such_eval-*",
    *_grain_train(tmp_path),
  )
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [f"Error: grain_eval_files: '{tmp_path}/no_such_eval-*' matches no file"]
  assert "completed step" not in result.stdout and not metrics
  assert not os.path.exists(tmp_path / "bad_eval" / "checkpoints")


def _eval_file_with_a_bad_record(path: str, bad_index: int) -> str:
  """Eval records whose record `bad_index` lacks the "text" column: the first eval batches read fine, a whole
  pass over the eval data stops there with a UserError."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=import-outside-toplevel

  writer = ArrayRecordWriter(path, "group_size:1")
  for i, text in enumerate(_documents(bad_index + 10)):
    writer.write(tf_example.serialize({"body" if i == bad_index else "text": text}))
  writer.close()
  return path


def test_an_error_at_eval_saves_the_last_step_and_the_rerun_resumes_there(tmp_path):
  eval_file = _eval_file_with_a_bad_record(str(tmp_path / "eval.array_record"), bad_index=60)
  common = ["steps=10", "checkpoint_period=3", "learning_rate_schedule_steps=10", *_grain_train(tmp_path)]
  # Checkpoints at steps 0 and 3; the first eval, after step 4, reads the bad record.
  result, metrics = run_train(tmp_path, "mid", *common, "eval_interval=5", "eval_steps=-1", f"grain_eval_files={eval_file}")
  assert result.returncode == 2
  assert len(_error_lines(result)) == 1 and "records have no column 'text'" in _error_lines(result)[0]
  assert "Saving the checkpoint of step 4 before exiting because of an error: records have no column" in result.stdout
  assert sorted(os.listdir(tmp_path / "mid" / "checkpoints"), key=int) == ["0", "3", "4"]
  assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
  # The same run without eval resumes from step 4 and continues at step 5.
  result, metrics = run_train(tmp_path, "mid", *common)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Restored the checkpoint of step 4" in result.stdout
  assert [m["step"] for m in metrics] == list(range(10))


def test_ctrl_c_outside_the_step_loop_is_one_line_naming_where(capsys):
  """Ctrl-C during the compile (or a second one in the loop): where it landed, exit 130, no traceback."""
  from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=import-outside-toplevel

  def compile_for_a_long_time(argv):
    del argv
    raise KeyboardInterrupt

  with pytest.raises(SystemExit) as exit_info:
    run_and_exit_on_user_error(compile_for_a_long_time, ["train.py", "base.yml"])
  assert exit_info.value.code == 130
  err = capsys.readouterr().err
  assert err.startswith("Interrupted (Ctrl-C) in compile_for_a_long_time (MaxText/tests/train_errors_test.py:")
  assert "Traceback" not in err and len(err.splitlines()) == 1
