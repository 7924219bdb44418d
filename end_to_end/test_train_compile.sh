#!/usr/bin/env bash
# AOT-compiles docs/aot_compile.md's 16B example (2 x v5e-256) and the published run configs on this machine (a CPU is
# enough: libtpu describes the TPU topologies), and prints each one's compile time, peak host RSS and verdict.
#
#   bash end_to_end/test_train_compile.sh [16b|published|all]     (default all; libtpu: bash setup.sh DEVICE=tpu)
#
# Exit status: 0 when the 16B example compiles with a verdict line (fits or not), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
WHICH="${1:-all}"
OUT="$(mktemp -d)"

run() {  # run NAME COMMAND...: time and peak RSS of one compile, then its memory total and verdict
  local name="$1"; shift
  local start=$SECONDS
  python3 - "$OUT/$name.rss" "$@" > "$OUT/$name.log" 2>&1 <<'PY'
import resource, subprocess, sys
status = subprocess.run(sys.argv[2:]).returncode
peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
open(sys.argv[1], "w").write(f"{peak_kib / 2**20:.2f} GiB")
sys.exit(status)
PY
  local status=$?
  echo "== $name: exit $status, $((SECONDS - start)) s wall, peak host RSS $(cat "$OUT/$name.rss" 2>/dev/null)"
  grep -E "^Target:|^Model:|^Compile time:|  total |^Verdict:|^Estimate|TFLOPs per device" "$OUT/$name.log" | sed 's/^/   /'
  grep -q "^Verdict:" "$OUT/$name.log" || tail -5 "$OUT/$name.log"
  return $status
}

status=0
if [[ "$WHICH" == 16b || "$WHICH" == all ]]; then
  run 16b-2xv5e-256 python3 MaxText/train_compile.py MaxText/configs/base.yml compile_topology=v5e-256 \
    compile_topology_num_slices=2 global_parameter_scale=16 per_device_batch_size=4
  grep -q "^Verdict:" "$OUT/16b-2xv5e-256.log" || status=1
fi
if [[ "$WHICH" == published || "$WHICH" == all ]]; then
  run v5e-16b-2xv5e-256 bash MaxText/configs/v5e/16b.sh EXECUTABLE=train_compile M_COMPILE_TOPOLOGY=v5e-256 M_COMPILE_TOPOLOGY_NUM_SLICES=2
  run v5e-32b-2xv5e-256 bash MaxText/configs/v5e/32b.sh EXECUTABLE=train_compile M_COMPILE_TOPOLOGY=v5e-256 M_COMPILE_TOPOLOGY_NUM_SLICES=2
  run v4-22b-1xv4-128 bash MaxText/configs/v4/22b.sh EXECUTABLE=train_compile M_COMPILE_TOPOLOGY=v4-128 M_COMPILE_TOPOLOGY_NUM_SLICES=1
  run v4-52b-1xv4-384 bash MaxText/configs/v4/52b.sh EXECUTABLE=train_compile M_COMPILE_TOPOLOGY=v4-384 M_COMPILE_TOPOLOGY_NUM_SLICES=1
fi
echo "logs: $OUT"
exit $status
