"""end_to_end/gpu/: the multi-node launch script's cluster variables and command (DRY_RUN), and the Vertex AI job file.

Nothing here runs on a GPU: the script prints the train command instead of running it, and the job file's
command is checked against the config system with 2 nodes x 8 GPUs described by stand-in devices.
"""

import json
import os
import shlex
import subprocess
import types

import pytest

from MaxText import pyconfig
from MaxText.tests.helpers import BASE_YML, REPO_ROOT

LAUNCH = "end_to_end/gpu/multinode_train.sh"
JOB_FILE = os.path.join(REPO_ROOT, "end_to_end", "gpu", "vertex_a3mega_llama2_7b.json")
CLUSTER_ENV = (
  "CLUSTER_SPEC",
  "NNODES",
  "NODE_RANK",
  "GPUS_PER_NODE",
  "XLA_FLAGS_PRESET",
  "RUN_NAME",
  "BASE_OUTPUT_DIRECTORY",
  "CLOUD_ML_JOB_ID",
  "JOBSET_NAME",
)


def vertex_spec(task_type, index, workers=1):
  return json.dumps(
    {
      "cluster": {
        "workerpool0": ["cmle-training-workerpool0-ab12-0:2222"],
        "workerpool1": [f"cmle-training-workerpool1-ab12-{i}:2222" for i in range(workers)],
      },
      "environment": "cloud",
      "task": {"type": task_type, "index": index, "trial": ""},
    }
  )


def launch(*args, env=None):
  """Runs the launch script with DRY_RUN=1 from another directory; returns (result, cluster dict, train argv)."""
  clean = {
    k: v for k, v in os.environ.items() if not k.startswith(("M_", "JAX_COORDINATOR", "SLURM_")) and k not in CLUSTER_ENV
  }
  clean.update(DRY_RUN="1", **(env or {}))
  result = subprocess.run(
    ["bash", os.path.join(REPO_ROOT, LAUNCH), *args], cwd="/", env=clean, capture_output=True, text=True, check=False
  )
  cluster, argv = {}, []
  for line in result.stdout.splitlines():
    if ": cluster from " in line:
      cluster = dict(item.split("=", 1) for item in line.split(": ", 2)[2].split())
    if ": dry run: " in line:
      argv = shlex.split(line.split(": dry run: ", 1)[1])
  return result, cluster, argv


@pytest.mark.parametrize(
  "task_type,index,workers,rank",
  [("workerpool0", 0, 1, 0), ("workerpool1", 0, 1, 1), ("workerpool1", 2, 3, 3)],
)
def test_vertex_cluster_spec_gives_rank_nodes_and_coordinator(task_type, index, workers, rank):
  env = {"CLUSTER_SPEC": vertex_spec(task_type, index, workers), "CLOUD_ML_JOB_ID": "4242"}
  result, cluster, argv = launch("model_name=llama2-7b", "base_output_directory=gs://b/runs", env=env)
  assert result.returncode == 0, result.stderr
  assert cluster == {
    "JAX_COORDINATOR_ADDRESS": "cmle-training-workerpool0-ab12-0:2222",
    "NNODES": str(1 + workers),
    "NODE_RANK": str(rank),
    "GPUS_PER_NODE": "8",
  }
  assert argv == [
    "python3",
    "MaxText/train.py",
    "MaxText/configs/base.yml",
    "model_name=llama2-7b",
    "base_output_directory=gs://b/runs",
    "run_name=vertex-4242",  # the same on every replica of the job
    "hardware=gpu",
  ]


def test_explicit_variables_win_and_the_port_is_added():
  env = {
    "CLUSTER_SPEC": vertex_spec("workerpool1", 0),
    "NODE_RANK": "0",
    "JAX_COORDINATOR_IP": "10.0.0.7",
    "JAX_COORDINATOR_PORT": "3389",
    "RUN_NAME": "r1",
    "BASE_OUTPUT_DIRECTORY": "/shared/out",
    "XLA_FLAGS_PRESET": "a3mega",
  }
  result, cluster, argv = launch("steps=5", env=env)
  assert result.returncode == 0, result.stderr
  assert (cluster["JAX_COORDINATOR_ADDRESS"], cluster["NNODES"], cluster["NODE_RANK"]) == ("10.0.0.7:3389", "2", "0")
  assert argv[3:] == [
    "steps=5",
    "run_name=r1",
    "base_output_directory=/shared/out",
    "hardware=gpu",
    "xla_flags_preset=a3mega",
  ]


def test_coordinator_address_without_port_takes_jax_coordinator_port():
  env = {"NNODES": "4", "NODE_RANK": "3", "JAX_COORDINATOR_ADDRESS": "node-0", "JAX_COORDINATOR_PORT": "2222"}
  result, cluster, argv = launch("run_name=a", "base_output_directory=gs://b", "hardware=gpu_multiprocess", env=env)
  assert result.returncode == 0, result.stderr
  assert cluster["JAX_COORDINATOR_ADDRESS"] == "node-0:2222"
  assert argv.count("hardware=gpu_multiprocess") == 1 and "hardware=gpu" not in argv  # the user's value wins


def test_config_file_and_single_node():
  result, cluster, argv = launch("my.yml", "run_name=a", env={"NNODES": "1", "JAX_COORDINATOR_ADDRESS": "stale:1"})
  assert result.returncode == 0, result.stderr
  assert cluster == {"NNODES": "1", "NODE_RANK": "0", "GPUS_PER_NODE": "8"}
  assert argv == ["python3", "MaxText/train.py", "my.yml", "run_name=a", "hardware=gpu"]


def test_slurm_one_task_per_gpu():
  env = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "16", "SLURM_NNODES": "2"}
  result, cluster, argv = launch("base_output_directory=/nfs/runs", env=env)
  assert result.returncode == 0, result.stderr
  assert cluster == {"GPUS_PER_NODE": "8"} and "from SLURM" in result.stdout
  assert argv[3:] == ["base_output_directory=/nfs/runs", "run_name=slurm-77", "hardware=gpu"]


@pytest.mark.parametrize(
  "env,args,message",
  [
    ({}, ["run_name=a"], "NNODES is not set and there is no CLUSTER_SPEC (Vertex AI) or SLURM job"),
    ({"NNODES": "2", "JAX_COORDINATOR_ADDRESS": "h"}, ["run_name=a"], "NODE_RANK is not set"),
    (
      {"NNODES": "2", "NODE_RANK": "2", "JAX_COORDINATOR_ADDRESS": "h"},
      ["run_name=a"],
      "NODE_RANK=2 must be an integer in 0 .. 1",
    ),
    ({"NNODES": "two"}, ["run_name=a"], "NNODES=two must be a positive integer"),
    ({"NNODES": "2", "NODE_RANK": "1"}, ["run_name=a"], "no coordinator: set JAX_COORDINATOR_ADDRESS"),
    ({"NNODES": "1", "GPUS_PER_NODE": "0"}, ["run_name=a"], "GPUS_PER_NODE=0 must be a positive integer"),
    ({"CLUSTER_SPEC": "{not json"}, ["run_name=a"], "CLUSTER_SPEC is not a Vertex AI cluster description"),
    ({"CLUSTER_SPEC": vertex_spec("workerpool2", 0)}, ["run_name=a"], "this replica is workerpool2 in CLUSTER_SPEC"),
    ({"CLUSTER_SPEC": vertex_spec("workerpool1", 0), "NNODES": "3"}, ["run_name=a"], "NNODES=3 but CLUSTER_SPEC lists 2"),
    ({"CLUSTER_SPEC": vertex_spec("workerpool1", 0)}, ["run_name=a"], "no base_output_directory for 2 nodes"),
    ({"NNODES": "1"}, [], "no run_name: pass run_name=NAME or set RUN_NAME"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_NNODES": "2"}, ["run_name=a"], "srun --ntasks-per-node=8"),
    ({"NNODES": "1"}, ["run_name=a", "steps"], "argument 'steps' is not a MaxText override key=value"),
  ],
)
def test_bad_cluster_is_one_clear_line(env, args, message):
  result, _, _ = launch(*args, env=env)
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("multinode_train.sh: "), result.stderr
  assert message in lines[0], lines[0]


def load_job():
  with open(JOB_FILE, encoding="utf-8") as f:
    return json.load(f)


def test_vertex_job_file_runs_the_launch_script_on_two_a3_mega_nodes():
  pools = load_job()["workerPoolSpecs"]  # a CustomJobSpec, as `gcloud ai custom-jobs create --config` reads it
  assert len(pools) == 2
  for pool in pools:
    assert pool["machineSpec"] == {
      "machineType": "a3-megagpu-8g",
      "acceleratorType": "NVIDIA_H100_MEGA_80GB",
      "acceleratorCount": 8,
    }
    assert int(pool["replicaCount"]) == 1
    assert pool["containerSpec"]["command"][-1].endswith(LAUNCH)
    assert {"name": "XLA_FLAGS_PRESET", "value": "a3mega"} in pool["containerSpec"]["env"]
  assert pools[0]["containerSpec"] == pools[1]["containerSpec"]  # every node runs the same command
  assert "_" not in "".join(_keys(load_job()))  # gcloud rejects keys with underscores


def _keys(value):
  if isinstance(value, dict):
    for key, item in value.items():
      yield key
      yield from _keys(item)
  elif isinstance(value, list):
    for item in value:
      yield from _keys(item)


def test_vertex_job_command_is_a_valid_config_for_two_nodes_of_eight_gpus():
  """The job's arguments, through the launch script as a Vertex AI replica would run them, then the config system."""
  container = load_job()["workerPoolSpecs"][1]["containerSpec"]
  env = {item["name"]: item["value"] for item in container["env"]}
  env.update(CLUSTER_SPEC=vertex_spec("workerpool1", 0), CLOUD_ML_JOB_ID="99")
  result, cluster, argv = launch(*container["args"], env=env)
  assert result.returncode == 0, result.stderr
  assert (cluster["NNODES"], cluster["GPUS_PER_NODE"]) == ("2", "8")
  assert argv[:3] == ["python3", "MaxText/train.py", "MaxText/configs/base.yml"]
  # The seed's llama2-7b command: FSDP over a node's 8 GPUs, data parallelism across the 2 nodes.
  for arg in ["model_name=llama2-7b", "dcn_data_parallelism=2", "ici_fsdp_parallelism=8", "per_device_batch_size=4"]:
    assert arg in argv
  assert "remat_policy=minimal_flash" in argv and "max_target_length=4096" in argv
  assert "hardware=gpu" in argv and "xla_flags_preset=a3mega" in argv

  # GPU hosts are slices (XLA gives each host's devices one slice_index).
  gpus = [types.SimpleNamespace(platform="gpu", id=i, slice_index=i // 8, process_index=i // 8) for i in range(16)]
  config = pyconfig.initialize(["train.py", BASE_YML, *argv[3:]], environ={}, devices=gpus)
  assert config.num_slices == 2 and config.num_devices == 16
  assert dict(zip(config.mesh_axes, config.dcn_parallelism))["data"] == 2
  assert dict(zip(config.mesh_axes, config.ici_parallelism))["fsdp"] == 8
  assert config.global_batch_size_to_train_on == 64 and config.emb_dim == 4096
  assert config.attention == "cudnn_flash_jax"  # autoselected on GPUs: cuDNN flash attention (the guide: through TE)
