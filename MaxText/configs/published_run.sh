# Shared by the published run configs (v4/*.sh, v5e/*.sh): sourced after they set MODEL_KEYS and LIBTPU_INIT_ARGS.
#
# Arguments (KEY=VALUE): RUN_NAME, OUTPUT_PATH (base_output_directory), DATASET_PATH (a TFDS data_dir with c4/en;
# without it the data is synthetic, as in the published speed runs), EXECUTABLE=train|train_compile, and any
# M_<KEY>=value config override (e.g. M_COMPILE_TOPOLOGY=v5e-256 M_COMPILE_TOPOLOGY_NUM_SLICES=2 for train_compile).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
EXECUTABLE=train
for arg in "$@"; do
  [[ "$arg" == *=* ]] || { echo "$0: arguments are KEY=VALUE, got '$arg'" >&2; exit 2; }
  export "${arg?}"
done
DATA_KEYS=(dataset_type=synthetic)
if [[ -n "${DATASET_PATH:-}" ]]; then DATA_KEYS=(dataset_type=tfds "dataset_path=$DATASET_PATH"); fi
export LIBTPU_INIT_ARGS
set -x
python3 "MaxText/${EXECUTABLE}.py" MaxText/configs/base.yml ${RUN_NAME:+run_name=$RUN_NAME} \
  ${OUTPUT_PATH:+base_output_directory=$OUTPUT_PATH} "${DATA_KEYS[@]}" "${MODEL_KEYS[@]}"
