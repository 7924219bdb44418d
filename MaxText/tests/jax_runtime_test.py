"""Cluster detection for jax.distributed."""

import pytest

from MaxText import jax_runtime
from MaxText.errors import ConfigError


@pytest.mark.parametrize(
  "env,expected",
  [
    ({}, None),
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1", "NNODES": "4", "NODE_RANK": "2"}, ("10.0.0.1:1234", 4, 2)),
    ({"JAX_COORDINATOR_ADDRESS": "h:99", "NNODES": "2", "NODE_RANK": "0"}, ("h:99", 2, 0)),
    ({"JAX_COORDINATOR_IP": "h", "JAX_COORDINATOR_PORT": "7", "NNODES": "2", "NODE_RANK": "1"}, ("h:7", 2, 1)),
    ({"SLURM_NTASKS": "8"}, {}),
    ({"TPU_WORKER_HOSTNAMES": "a,b,c,d"}, {}),
  ],
)
def test_cluster_detection(env, expected):
  kwargs = jax_runtime._cluster_kwargs("cpu", env)  # pylint: disable=protected-access
  if isinstance(expected, tuple):
    assert (kwargs["coordinator_address"], kwargs["num_processes"], kwargs["process_id"]) == expected
  else:
    assert kwargs == expected


def test_coordinator_without_rank_is_a_clear_error():
  with pytest.raises(ConfigError, match="NNODES is not set"):
    jax_runtime._cluster_kwargs("gpu", {"JAX_COORDINATOR_ADDRESS": "h"})  # pylint: disable=protected-access
