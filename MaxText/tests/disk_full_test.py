"""A checkpoint save that fills the disk (a 4 MiB tmpfs that holds one checkpoint of the tiny model, not two): the
run stops with one line naming the step that stays the latest (exit 2), that checkpoint stays the latest, and once
there is space the same command resumes from it with the losses of an uninterrupted run."""

import errno
import os
import subprocess

import pytest

from MaxText.checkpoints import disk_full
from MaxText.tests.helpers import run_train

FS_BYTES = 4 * 2**20


def _mount_tmpfs(path, size: str, remount: bool = False) -> None:
  options = f"remount,size={size}" if remount else f"size={size}"
  subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True, capture_output=True, text=True)


@pytest.fixture
def small_disk(tmp_path):
  """A 4 MiB tmpfs (mount needs root: skipped otherwise)."""
  path = tmp_path / "small_disk"
  path.mkdir()
  if os.geteuid() != 0:
    pytest.skip("mounting a tmpfs (mount -t tmpfs) needs root, and this test runs as another user")
  try:
    _mount_tmpfs(path, "4m")
  except (subprocess.CalledProcessError, OSError) as e:
    pytest.skip(f"mount -t tmpfs is not permitted here: {getattr(e, 'stderr', '') or e}")
  try:
    yield path
  finally:
    subprocess.run(["umount", str(path)], check=False)


def _size(path) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# About 9 s each (three tiny runs); the synchronous save with the slow tests.
@pytest.mark.parametrize("async_checkpointing", ["true", pytest.param("false", marks=pytest.mark.slow)])
def test_a_full_disk_keeps_the_previous_checkpoint_the_latest_and_says_so_in_one_line(
  tmp_path, small_disk, async_checkpointing
):
  flags = ["steps=4", "checkpoint_period=1", f"async_checkpointing={async_checkpointing}"]
  reference, expected = run_train(tmp_path, "reference", *flags)
  assert reference.returncode == 0, reference.stderr[-3000:]
  checkpoint_bytes = _size(tmp_path / "reference" / "checkpoints" / "0")
  assert FS_BYTES / 2 < checkpoint_bytes < FS_BYTES, checkpoint_bytes  # one fits, two do not

  run, _ = run_train(tmp_path, "run", f"base_output_directory={small_disk}", *flags)
  checkpoints = small_disk / "run" / "checkpoints"
  assert run.returncode == 2, run.stderr[-3000:]
  assert run.stderr.strip() == (  # the one line, and nothing else on stderr
    f"Error: the checkpoint of step 1 could not be written to {checkpoints} (No space left on device), so the "
    "checkpoint of step 0 stays the latest. Free space (a save needs room for one more checkpoint beside those kept) "
    "and rerun the same command to resume from there."
  )
  assert "before exiting" not in run.stdout  # no second save was tried
  names = sorted(os.listdir(checkpoints))
  assert names[0] == "0" and all(".orbax-checkpoint-tmp" in name for name in names[1:]), names

  _mount_tmpfs(small_disk, "64m", remount=True)  # space freed: the same command resumes
  resumed, got = run_train(tmp_path, "run", f"base_output_directory={small_disk}", *flags)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"Restored the checkpoint of step 0 from {checkpoints}/0" in resumed.stdout
  assert sorted(os.listdir(checkpoints)) == ["0", "1", "2", "3"]  # the half-written one was removed
  assert [m["step"] for m in got] == [0, 1, 2, 3]
  assert [m["learning/loss"] for m in got] == [m["learning/loss"] for m in expected]  # bitwise


def test_a_full_disk_is_recognized_in_os_and_tensorstore_errors_and_their_causes():
  assert disk_full.reason(OSError(errno.ENOSPC, "No space left on device")) == os.strerror(errno.ENOSPC)
  assert disk_full.reason(OSError(errno.EDQUOT, "Disk quota exceeded")) == os.strerror(errno.EDQUOT)
  tensorstore = ValueError(
    'RESOURCE_EXHAUSTED: Error writing "params.x/0" in OCDBT database at local file "/c/1.orbax-checkpoint-tmp/": '
    "Failed to write 311855 bytes to file 4: No space left on device [os_error_code='28']"
  )
  try:
    raise TimeoutError("while waiting for the save") from tensorstore
  except TimeoutError as error:
    assert disk_full.reason(error) == os.strerror(errno.ENOSPC)
  assert disk_full.reason(OSError(errno.EACCES, "Permission denied")) is None
  assert disk_full.reason(ValueError("NOT_FOUND: no such file")) is None
