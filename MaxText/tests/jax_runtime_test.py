"""Cluster detection for jax.distributed, and a coordinator that never answers."""

import time

import portpicker
import pytest

from MaxText.errors import ConfigError
from MaxText.runtime import cluster
from MaxText.tests.helpers import BASE_YML, TRAIN_PY, run_python, tiny_args


@pytest.mark.parametrize(
  "mode,env,expected",
  [
    ("auto", {}, None),
    ("auto", {"TPU_WORKER_HOSTNAMES": "localhost"}, None),
    ("auto", {"JAX_COORDINATOR_ADDRESS": "10.0.0.1", "NNODES": "4", "NODE_RANK": "2"}, ("10.0.0.1:1234", 4, 2)),
    ("auto", {"JAX_COORDINATOR_ADDRESS": "h:99", "NNODES": "2", "NODE_RANK": "0"}, ("h:99", 2, 0)),
    # Vertex AI sets the master's address and the port apart.
    (
      "auto",
      {"JAX_COORDINATOR_ADDRESS": "10.1.2.3", "JAX_COORDINATOR_PORT": "2222", "NNODES": "2", "NODE_RANK": "1"},
      ("10.1.2.3:2222", 2, 1),
    ),
    ("auto", {"JAX_COORDINATOR_IP": "h", "JAX_COORDINATOR_PORT": "7", "NNODES": "2", "NODE_RANK": "1"}, ("h:7", 2, 1)),
    ("auto", {"JAX_COORDINATOR_ADDRESS": "[fe80::1]", "NNODES": "2", "NODE_RANK": "1"}, ("[fe80::1]:1234", 2, 1)),
    ("auto", {"SLURM_NTASKS": "8"}, {}),
    ("auto", {"SLURM_NTASKS": "1"}, None),
    ("auto", {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3"}, {}),
    ("auto", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),  # a lone pod
    ("auto", {"TPU_WORKER_HOSTNAMES": "a,b,c,d"}, {}),
    ("auto", {"MEGASCALE_COORDINATOR_ADDRESS": "a"}, {}),
    ("always", {}, {}),  # e.g. TPU VMs outside GKE: JAX's cluster detection
    ("never", {"SLURM_NTASKS": "8"}, None),
    ("never", {"JAX_COORDINATOR_ADDRESS": "h", "NNODES": "2", "NODE_RANK": "1"}, None),
  ],
)
def test_cluster_detection(mode, env, expected):
  kwargs = cluster.cluster_kwargs(mode, "cpu", env)
  if isinstance(expected, tuple):
    assert (kwargs["coordinator_address"], kwargs["num_processes"], kwargs["process_id"]) == expected
  else:
    assert kwargs == expected


def test_gpu_multiprocess_uses_jax_detection():
  assert cluster.cluster_kwargs("auto", "gpu_multiprocess", {}) == {}


@pytest.mark.parametrize(
  "env,message",
  [
    ({"JAX_COORDINATOR_ADDRESS": "h"}, "NNODES is not set"),
    ({"JAX_COORDINATOR_ADDRESS": "h", "NNODES": "two", "NODE_RANK": "0"}, "NNODES=two must be an integer"),
    ({"JAX_COORDINATOR_ADDRESS": "h", "NNODES": "2", "NODE_RANK": "2"}, r"NODE_RANK=2 must be in \[0, NNODES=2\)"),
  ],
)
def test_bad_cluster_variables_are_clear_errors(env, message):
  with pytest.raises(ConfigError, match=message):
    cluster.cluster_kwargs("auto", "gpu", env)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_coordinator_that_never_answers_is_one_clear_line_within_the_timeout(tmp_path, rank):
  """Rank 1: nothing listens at the address. Rank 0: it is the coordinator, but process 1 never comes."""
  port = portpicker.pick_unused_port()
  argv = [TRAIN_PY, BASE_YML, "run_name=lonely", *tiny_args(f"base_output_directory={tmp_path}", "steps=1")]
  argv.append("distributed_init_timeout=5")
  env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "NNODES": "2", "NODE_RANK": str(rank)}
  start = time.time()
  result = run_python(argv, env_extra=env, timeout=120)
  elapsed = time.time() - start
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
  assert len(lines) == 1, result.stderr[-2000:]
  assert f"127.0.0.1:{port}" in lines[0] and "distributed_init_timeout" in lines[0]
  assert ("could not reach" if rank else "did not finish joining") in lines[0]
  assert "Traceback" not in result.stderr and "Check failure" not in result.stderr
  assert elapsed < 5 + 30, elapsed  # the timeout, plus starting Python and JAX


def test_always_without_a_cluster_is_one_clear_line(tmp_path):
  argv = [TRAIN_PY, BASE_YML, "run_name=x", "jax_distributed_init=always", *tiny_args(f"base_output_directory={tmp_path}")]
  result = run_python(argv, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1].startswith("Error: jax.distributed could not start")
  assert "no cluster found: set JAX_COORDINATOR_ADDRESS, NNODES and NODE_RANK" in result.stderr
