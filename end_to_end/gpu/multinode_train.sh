#!/usr/bin/env bash
# Runs MaxText/train.py on one node of a multi-node GPU job; start it on every node (one process per node,
# which drives all of the node's GPUs).
#
#   bash end_to_end/gpu/multinode_train.sh [config.yml] key=value ...    # MaxText config overrides
#
# The cluster, from the first of these that is there:
#   1. JAX_COORDINATOR_ADDRESS (host[:port]) or JAX_COORDINATOR_IP [+ JAX_COORDINATOR_PORT], with NNODES and
#      NODE_RANK (0 .. NNODES-1): the A3 Mega scripts' variables, or your own on plain hosts;
#   2. CLUSTER_SPEC (Vertex AI custom jobs): the coordinator is workerpool0's replica, NODE_RANK 0 is workerpool0
#      and workerpool1's replicas follow it; NNODES, NODE_RANK or the coordinator given as in 1 win over it;
#   3. SLURM (srun): JAX reads SLURM_* itself and gives each process one GPU, so run GPUS_PER_NODE tasks per node;
#   4. NNODES=1: this node alone.
# Other variables:
#   GPUS_PER_NODE      GPUs per node (default 8, as on a3-megagpu-8g); checked against nvidia-smi where it runs.
#   XLA_FLAGS_PRESET   adds xla_flags_preset=<name> (a3mega: the tuned A3 Mega XLA flags; MaxText/runtime/xla_flag_presets.py).
#   RUN_NAME           run_name, when no run_name=... is given (default: the Vertex AI or SLURM job id). Every
#                      node needs the same one.
#   BASE_OUTPUT_DIRECTORY  base_output_directory, when none is given; on several nodes it must be storage they
#                      all share (gs://bucket/dir, or a shared filesystem): checkpoints are written there by all.
#   DRY_RUN=1          print the cluster and the command instead of running it.
set -euo pipefail

die() {
  echo "multinode_train.sh: $*" >&2
  exit 2
}

is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }

cd "$(dirname "$0")/../.."

config="MaxText/configs/base.yml"
if [[ $# -gt 0 && "$1" == *.yml ]]; then
  config="$1"
  shift
fi
declare -A given=()  # the config keys given as key=value arguments or as M_<KEY> variables
for arg in "$@"; do
  [[ "$arg" == *=* ]] || die "argument '$arg' is not a MaxText override key=value"
  given["${arg%%=*}"]=1
done
for key in run_name base_output_directory hardware xla_flags_preset; do
  env_key="M_${key^^}"
  [[ -n "${!env_key:-}" ]] && given[$key]=1
done

GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
is_int "$GPUS_PER_NODE" && ((GPUS_PER_NODE > 0)) || die "GPUS_PER_NODE=$GPUS_PER_NODE must be a positive integer"

# The coordinator as the user gave it.
coordinator="${JAX_COORDINATOR_ADDRESS:-}"
if [[ -z "$coordinator" && -n "${JAX_COORDINATOR_IP:-}" ]]; then
  coordinator="$JAX_COORDINATOR_IP"
fi

source=""
if [[ -n "${CLUSTER_SPEC:-}" ]]; then
  spec="$(python3 - <<'EOF'
import json, os, sys

try:
  spec = json.loads(os.environ["CLUSTER_SPEC"])
  primary = spec["cluster"]["workerpool0"]
  workers = spec["cluster"].get("workerpool1") or []
  task_type, index = spec["task"]["type"], int(spec["task"]["index"])
  host = primary[0]
except (ValueError, KeyError, TypeError, IndexError) as e:
  sys.exit(
    f"multinode_train.sh: CLUSTER_SPEC is not a Vertex AI cluster description ({type(e).__name__}: {e}); "
    'expected {"cluster": {"workerpool0": ["host:port"], "workerpool1": [...]}, "task": {"type": ..., "index": ...}}'
  )
if task_type not in ("workerpool0", "workerpool1"):
  sys.exit(f"multinode_train.sh: this replica is {task_type} in CLUSTER_SPEC; MaxText trains on workerpool0 and workerpool1")
rank = index if task_type == "workerpool0" else len(primary) + index
print(len(primary) + len(workers), rank, host)
EOF
  )" || exit 2
  read -r spec_nnodes spec_rank spec_coordinator <<<"$spec"
  [[ -z "${JAX_COORDINATOR_PORT:-}" ]] || spec_coordinator="${spec_coordinator%:*}"  # that port, not the spec's
  if [[ -n "${NNODES:-}" && "$NNODES" != "$spec_nnodes" ]]; then
    die "NNODES=$NNODES but CLUSTER_SPEC lists $spec_nnodes nodes (workerpool0 + workerpool1); unset NNODES or fix replicaCount"
  fi
  NNODES="${NNODES:-$spec_nnodes}"
  NODE_RANK="${NODE_RANK:-$spec_rank}"
  coordinator="${coordinator:-$spec_coordinator}"
  source="CLUSTER_SPEC (Vertex AI)"
elif [[ -z "${NNODES:-}" && -n "${SLURM_JOB_ID:-}" && -n "${SLURM_NTASKS:-}" ]]; then
  nodes="${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
  is_int "$nodes" && is_int "$SLURM_NTASKS" || die "SLURM_NNODES=$nodes and SLURM_NTASKS=$SLURM_NTASKS must be integers"
  if ((SLURM_NTASKS != nodes * GPUS_PER_NODE)); then
    die "SLURM runs $SLURM_NTASKS task(s) on $nodes node(s), but JAX gives each SLURM task one GPU: run" \
      "srun --ntasks-per-node=$GPUS_PER_NODE (GPUS_PER_NODE)"
  fi
  source="SLURM ($SLURM_NTASKS tasks on $nodes nodes, one GPU each; JAX reads SLURM_*)"
fi

if [[ -z "$source" ]]; then
  [[ -n "${NNODES:-}" ]] || die "NNODES is not set and there is no CLUSTER_SPEC (Vertex AI) or SLURM job: set NNODES," \
    "NODE_RANK and JAX_COORDINATOR_ADDRESS on every node (NNODES=1 for this node alone)"
  source="environment"
fi
nodes_total="${NNODES:-${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}}"
if [[ -n "${NNODES:-}" ]]; then
  is_int "$NNODES" && ((NNODES > 0)) || die "NNODES=$NNODES must be a positive integer"
  if ((NNODES > 1)); then
    [[ -n "${NODE_RANK:-}" ]] || die "NODE_RANK is not set: number the nodes 0 .. $((NNODES - 1)), the same way on every node"
    is_int "$NODE_RANK" && ((NODE_RANK < NNODES)) || die "NODE_RANK=$NODE_RANK must be an integer in 0 .. $((NNODES - 1)) (NNODES=$NNODES)"
    [[ -n "$coordinator" ]] || die "no coordinator: set JAX_COORDINATOR_ADDRESS=host[:port] (or JAX_COORDINATOR_IP and" \
      "JAX_COORDINATOR_PORT) to node 0's address, the same on every node"
    if [[ "$coordinator" != *:* || "$coordinator" == *"]" ]] && [[ -n "${JAX_COORDINATOR_PORT:-}" ]]; then
      coordinator="$coordinator:$JAX_COORDINATOR_PORT"  # Vertex AI and the A3 Mega scripts give the port apart
    fi
    export JAX_COORDINATOR_ADDRESS="$coordinator" NNODES NODE_RANK
  else
    NODE_RANK=0
    unset JAX_COORDINATOR_ADDRESS JAX_COORDINATOR_IP
    export NNODES NODE_RANK
  fi
fi
export GPUS_PER_NODE

args=("$@")
if [[ -z "${given[run_name]:-}" ]]; then
  run_name="${RUN_NAME:-}"
  [[ -n "$run_name" || -z "${CLOUD_ML_JOB_ID:-}" ]] || run_name="vertex-$CLOUD_ML_JOB_ID"
  [[ -n "$run_name" || -z "${SLURM_JOB_ID:-}" ]] || run_name="slurm-$SLURM_JOB_ID"
  [[ -n "$run_name" || -n "${JOBSET_NAME:-}" ]] || die "no run_name: pass run_name=NAME or set RUN_NAME, the same on every node"
  [[ -z "$run_name" ]] || args+=("run_name=$run_name")
fi
if [[ -z "${given[base_output_directory]:-}" ]]; then
  if [[ -n "${BASE_OUTPUT_DIRECTORY:-}" ]]; then
    args+=("base_output_directory=$BASE_OUTPUT_DIRECTORY")
  elif ((nodes_total > 1)); then
    die "no base_output_directory for $nodes_total nodes: pass base_output_directory=gs://BUCKET/DIR (or a filesystem" \
      "that every node mounts) or set BASE_OUTPUT_DIRECTORY; all nodes write the checkpoints there"
  fi
fi
[[ -n "${given[hardware]:-}" ]] || args+=("hardware=gpu")
if [[ -n "${XLA_FLAGS_PRESET:-}" && -z "${given[xla_flags_preset]:-}" ]]; then
  args+=("xla_flags_preset=$XLA_FLAGS_PRESET")
fi

command=(python3 MaxText/train.py "$config" "${args[@]}")
cluster="GPUS_PER_NODE=$GPUS_PER_NODE"
[[ -z "${NNODES:-}" ]] || cluster="NNODES=$NNODES NODE_RANK=$NODE_RANK $cluster"
[[ -z "${JAX_COORDINATOR_ADDRESS:-}" ]] || cluster="JAX_COORDINATOR_ADDRESS=$JAX_COORDINATOR_ADDRESS $cluster"
echo "multinode_train.sh: cluster from $source: $cluster"
if [[ "${DRY_RUN:-0}" != 0 ]]; then
  echo "multinode_train.sh: dry run: $(printf '%q ' "${command[@]}")"
  exit 0
fi

if command -v nvidia-smi >/dev/null 2>&1 && [[ -z "${SLURM_JOB_ID:-}" || -n "${NNODES:-}" ]]; then
  visible="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  ((visible == GPUS_PER_NODE)) || die "GPUS_PER_NODE=$GPUS_PER_NODE but nvidia-smi lists $visible GPU(s) on $(hostname)"
fi
exec "${command[@]}"
