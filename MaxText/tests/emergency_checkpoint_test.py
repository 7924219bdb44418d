"""Emergency (multi-tier) checkpoints: local saves every 2 steps and persistent ones every 6, a job killed at step 9
resumes from the newest step every process can restore, with the uninterrupted run's losses bitwise; the local tier
also serves a run of one process; and the persistent tier restores with enable_single_replica_ckpt_restoring."""

import functools
import shutil
import subprocess
import sys

import pytest

from MaxText.tests.helpers import (
  REPO_ROOT,
  TRAIN_PY,
  cpu_env,
  finish_processes,
  read_metrics,
  start_cpu_processes,
  tiny_args,
)

STEPS = 12
KILL_STEP = 9
TIERS = ["enable_emergency_checkpoint=true", "local_checkpoint_period=2", "checkpoint_period=6"]


def _command(root, *flags):
  args = tiny_args(
    f"base_output_directory={root}",
    f"local_checkpoint_directory={root}/local",
    f"metrics_file={root}/metrics.jsonl",
    f"steps={STEPS}",
    "learning_rate=1e-2",
    "per_device_batch_size=1",
    "async_checkpointing=false",  # the save of step 8 is complete when step 9 starts (and is killed)
    "log_all_processes=true",
    *TIERS,
    *flags,
  )
  return [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", "run_name=tiers", *args]


def _losses(root) -> dict[int, float]:
  return {m["step"]: m["learning/loss"] for m in read_metrics(root / "metrics.jsonl")}


def _run_two_processes(command, rank_env=None):
  codes, outputs = finish_processes(start_cpu_processes(command, rank_env=rank_env))
  return codes, outputs


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
  """(reference losses, the directory of a 2-process job killed in step 9), each process one data-parallel replica."""
  reference = tmp_path_factory.mktemp("reference")
  codes, outputs = _run_two_processes(_command(reference, "dcn_data_parallelism=2"))
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
  root = tmp_path_factory.mktemp("killed")
  kill = {rank: {"MAXTEXT_FAULT_INJECTION": f"kill_in_step:{KILL_STEP}"} for rank in range(2)}
  codes, outputs = _run_two_processes(_command(root, "dcn_data_parallelism=2"), rank_env=kill)
  assert codes == [-9, -9], "\n".join(o[-3000:] for o in outputs)
  return _losses(reference), root


def _resume(killed_root, tmp_path, remove=(), *flags):
  """Resumes a copy of the killed job with the local directories `remove` (process indices) deleted."""
  root = tmp_path / "resumed"
  shutil.copytree(killed_root, root)
  for process in remove:
    shutil.rmtree(root / "local" / "tiers" / f"process_{process}-of-2")
  codes, outputs = _run_two_processes(_command(root, "dcn_data_parallelism=2", *flags))
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
  return _losses(root), outputs


@pytest.mark.slow
@pytest.mark.parametrize(
  "remove, step, tier, flags",
  [
    ((), 8, "local", ()),
    # Process 1's copies are gone: no local step is on every process, so the persistent tier's newest.
    ((1,), 6, "persistent", ()),
    ((0, 1), 6, "persistent", ("enable_single_replica_ckpt_restoring=true",)),
  ],
)
def test_killed_job_resumes_from_the_newest_step_every_process_has(killed, tmp_path, remove, step, tier, flags):
  reference, killed_root = killed
  losses, outputs = _resume(killed_root, tmp_path, remove, *flags)
  for output in outputs:
    assert f"Restored the checkpoint of step {step} from the {tier} tier" in output, output[-3000:]
  if flags:
    assert "reading each array once per replica" in outputs[0]
  resumed = {s: loss for s, loss in losses.items() if s > step}
  assert sorted(resumed) == list(range(step + 1, STEPS))
  assert resumed == {s: reference[s] for s in resumed}  # bitwise


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("enable_lora=true", "lora_rank=4")], ids=["full", "lora"])
def test_one_process_saves_and_restores_its_local_tier(tmp_path, flags):
  """One replica (one host): the local tier still saves and restores, with the uninterrupted losses bitwise. A LoRA
  run's local saves hold its adapters only (as its persistent ones): the base is joined back on restore."""
  reference = tmp_path / "reference"
  run = functools.partial(subprocess.run, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
  whole = run(_command(reference, *flags), env=cpu_env(4))
  assert whole.returncode == 0, whole.stderr[-3000:]
  root = tmp_path / "killed"
  killed = run(_command(root, *flags), env=cpu_env(4, MAXTEXT_FAULT_INJECTION=f"kill_in_step:{KILL_STEP}"))
  assert killed.returncode == -9, killed.stderr[-3000:]
  local_params = _local_params(root / "local" / "tiers" / "process_0-of-1" / "8")
  assert local_params and all(k[-1] in ("lora_a", "lora_b") for k in local_params) == bool(flags), local_params
  resumed = run(_command(root, *flags), env=cpu_env(4))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Restored the checkpoint of step 8 from the local tier" in resumed.stdout + resumed.stderr
  losses, expected = _losses(root), _losses(reference)
  assert {s: losses[s] for s in range(KILL_STEP, STEPS)} == {s: expected[s] for s in range(KILL_STEP, STEPS)}


def _local_params(step_dir) -> list[tuple]:
  """The key paths under params of a local-tier step's saved state."""
  from MaxText.checkpoints import checkpointing  # pylint: disable=import-outside-toplevel
  from MaxText.layers import layer_names  # pylint: disable=import-outside-toplevel

  tree = checkpointing.tree_metadata(step_dir / checkpointing.STATE_ITEM, "local tier")
  return [keys for keys, _ in layer_names.flatten(tree["params"])]
