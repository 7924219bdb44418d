#!/usr/bin/env bash
# Installs MaxText's dependencies into the current Python environment (activate a venv first).
#
#   bash setup.sh                         # DEVICE detected (gpu if nvidia-smi works, tpu if /dev/accel* or /dev/vfio exist, else cpu)
#   bash setup.sh DEVICE=gpu MODE=stable  # DEVICE=cpu|gpu|tpu, MODE=stable|nightly
#   bash setup.sh WHEEL_DIR=~/wheels      # a host without internet: only the wheels in that directory, no index
#   bash setup.sh DEVICE=gpu TE=1         # also TransformerEngine's JAX package (attention=cudnn_flash_te)
#                                         # (docs/setup.md, "Hosts without internet", says how to fill it)
#
# Idempotent: a second run only checks what is installed (seconds).
set -euo pipefail

for arg in "$@"; do
  case "$arg" in
    DEVICE=*|MODE=*|WHEEL_DIR=*|TE=*) export "${arg?}" ;;
    *) echo "setup.sh: unknown argument '$arg' (use DEVICE=cpu|gpu|tpu MODE=stable|nightly WHEEL_DIR=<dir> TE=0|1)" >&2; exit 2 ;;
  esac
done

WHEEL_DIR="${WHEEL_DIR:-}"
if [[ -n "$WHEEL_DIR" ]]; then  # resolved before the cd below, against the caller's directory
  if [[ ! -d "$WHEEL_DIR" ]]; then
    echo "setup.sh: WHEEL_DIR=$WHEEL_DIR is not a directory (fill one with pip download: docs/setup.md, \"Hosts without internet\")" >&2
    exit 2
  fi
  WHEEL_DIR="$(cd "$WHEEL_DIR" && pwd)"
  if ! compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
    echo "setup.sh: WHEEL_DIR=$WHEEL_DIR holds no .whl files (fill it with pip download: docs/setup.md, \"Hosts without internet\")" >&2
    exit 2
  fi
fi
cd "$(dirname "$0")"

if [[ -z "${DEVICE:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=gpu
  elif compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then DEVICE=tpu
  else DEVICE=cpu; fi
fi
MODE="${MODE:-stable}"
case "$DEVICE" in cpu|gpu|tpu) ;; *) echo "setup.sh: DEVICE=$DEVICE is not one of cpu, gpu, tpu" >&2; exit 2 ;; esac
case "$MODE" in stable|nightly) ;; *) echo "setup.sh: MODE=$MODE is not one of stable, nightly" >&2; exit 2 ;; esac
TE="${TE:-0}"
case "$TE" in 0|1) ;; *) echo "setup.sh: TE=$TE is not 0 or 1" >&2; exit 2 ;; esac
if [[ "$TE" == 1 && "$DEVICE" != gpu ]]; then
  echo "setup.sh: TE=1 (TransformerEngine) needs DEVICE=gpu, not DEVICE=$DEVICE" >&2; exit 2
fi

PYTHON="${PYTHON:-python3}"
PIP=("$PYTHON" -m pip install --quiet --disable-pip-version-check)
if [[ -n "$WHEEL_DIR" ]]; then
  # No index at all, and no builds from source (they would need setuptools from an index).
  PIP+=(--no-index --find-links "$WHEEL_DIR" --only-binary=:all:)
fi
JAX_RANGE="$(grep -E '^jax[><=]' requirements.txt | head -n1 | sed 's/^jax//')"
echo "setup.sh: DEVICE=$DEVICE MODE=$MODE python=$("$PYTHON" -c 'import sys; print(sys.executable)')${WHEEL_DIR:+ WHEEL_DIR=$WHEEL_DIR}"

# pip install "$@"; from WHEEL_DIR, a failure ends with one line that names the wheel the directory lacks.
pip_install() {
  if [[ -z "$WHEEL_DIR" ]]; then
    "${PIP[@]}" "$@"
    return
  fi
  local log status=0
  log="$(mktemp)"
  "${PIP[@]}" "$@" 2>"$log" || status=$?
  cat "$log" >&2
  if [[ $status -ne 0 ]]; then
    local missing target
    missing="$(sed -n -e 's/.*satisfies the requirement \(.*\) (from versions.*/\1/p' \
      -e 's/.*No matching distribution found for //p' "$log" | head -n1)"
    target="$("$PYTHON" -c 'import platform, sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}, {platform.machine()}")')"
    if [[ -n "$missing" ]]; then
      echo "setup.sh: WHEEL_DIR=$WHEEL_DIR has no wheel for $missing that fits this host ($target): pip download it there on a machine with internet (docs/setup.md, \"Hosts without internet\")" >&2
    else
      echo "setup.sh: pip could not install from WHEEL_DIR=$WHEEL_DIR (its error is above)" >&2
    fi
  fi
  rm -f "$log"
  return "$status"
}

case "$DEVICE" in
  cpu) extra="" ;;
  gpu) extra="[cuda12]" ;;
  tpu) extra="[tpu]" ;;
esac
if [[ "$MODE" == "stable" ]]; then
  pip_install "jax${extra}${JAX_RANGE}"
elif [[ -n "$WHEEL_DIR" ]]; then
  # The newest jax/jaxlib pre-releases in WHEEL_DIR (downloaded from JAX's nightly index, see docs/setup.md).
  pip_install -U --pre "jax${extra}" jaxlib
else
  # Nightly jax/jaxlib (and libtpu or the CUDA plugin) from JAX's nightly index.
  pip_install -U --pre "jax${extra}" jaxlib \
    -i https://us-python.pkg.dev/ml-oss-artifacts-published/jax/simple/ -f https://storage.googleapis.com/jax-releases/libtpu_releases.html
fi

pip_install -r requirements.txt
if [[ "$TE" == 1 ]]; then
  # Optional: attention=cudnn_flash_te. Its JAX extension builds against the installed jax (CUDA headers needed);
  # from WHEEL_DIR it must be a wheel built on a machine with the same jax (docs/performance.md).
  pip_install --no-build-isolation "transformer_engine[jax]"
fi
CHECK_ENV=()
if [[ "$DEVICE" == tpu ]] && ! compgen -G "/dev/accel*" >/dev/null && ! compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
  # libtpu on a host without TPU chips: for train_compile.py's TPU targets; MaxText keeps JAX on the CPU here.
  echo "setup.sh: no TPU chips on this host: libtpu is installed to compile for TPU targets (MaxText/train_compile.py)"
  CHECK_ENV=(JAX_PLATFORMS=cpu)
fi
env "${CHECK_ENV[@]}" "$PYTHON" -c "import jax, flax, optax, orbax.checkpoint, grain, sentencepiece; print('setup.sh: ok, jax', jax.__version__, 'backend', jax.default_backend())"
