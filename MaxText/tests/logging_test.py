"""Which process prints what: info lines on process 0 only (unless log_all_processes=true), warnings everywhere."""

import os
import subprocess
import sys

import portpicker
import pytest

from MaxText import max_logging
from MaxText.tests.helpers import REPO_ROOT, TRAIN_PY, tiny_args


@pytest.mark.slow  # two JAX processes: 20-30 s of the unit suite on 2 cores
def test_a_two_process_run_prints_its_config_and_steps_once(tmp_path):
  port = portpicker.pick_unused_port()
  args = tiny_args(
    f"base_output_directory={tmp_path}",
    "steps=2",
    "per_device_batch_size=1",
    "dataset_type=synthetic",
    "enable_checkpointing=false",
  )
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu", NNODES="2")
  env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}")
  procs = [
    subprocess.Popen(
      [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", "run_name=two", *args],
      cwd=REPO_ROOT,
      env=dict(env, NODE_RANK=str(rank)),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for rank in range(2)
  ]
  (out0, err0), (out1, err1) = [p.communicate(timeout=600) for p in procs]
  assert procs[0].returncode == 0, err0[-3000:]
  assert procs[1].returncode == 0, err1[-3000:]
  assert "Config (value  # source):" in out0 and "completed step: 1" in out0
  assert "Config (value" not in out1 and "completed step" not in out1 and "Training finished" not in out1
  # Lines before the config exists describe this process (jax.distributed set-up): they print everywhere.
  assert "jax.distributed ready: process 1 of 2" in out1


def test_where_info_lines_print(capsys):
  assert max_logging.prints_info(0, all_processes=False)
  assert not max_logging.prints_info(1, all_processes=False)
  assert max_logging.prints_info(1, all_processes=True)
  assert max_logging.prints_info(None, all_processes=False)  # not configured yet
  try:
    max_logging.configure(all_processes=False, process_index=1)
    max_logging.log("an info line")
    max_logging.log("this process's own line", every_process=True)
    max_logging.warn("a warning")
  finally:
    max_logging.configure(all_processes=True, process_index=0)
  printed = capsys.readouterr()
  assert printed.out == "this process's own line\n"
  assert printed.err == "WARNING: a warning\n"
