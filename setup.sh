#!/usr/bin/env bash
# Installs MaxText's dependencies into the current Python environment (activate a venv first).
#
#   bash setup.sh                         # DEVICE detected (gpu if nvidia-smi works, tpu if /dev/accel* or /dev/vfio exist, else cpu)
#   bash setup.sh DEVICE=gpu MODE=stable  # DEVICE=cpu|gpu|tpu, MODE=stable|nightly
#
# Idempotent: a second run only checks what is installed (seconds).
set -euo pipefail
cd "$(dirname "$0")"

for arg in "$@"; do
  case "$arg" in
    DEVICE=*|MODE=*) export "${arg?}" ;;
    *) echo "setup.sh: unknown argument '$arg' (use DEVICE=cpu|gpu|tpu MODE=stable|nightly)" >&2; exit 2 ;;
  esac
done

if [[ -z "${DEVICE:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=gpu
  elif compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then DEVICE=tpu
  else DEVICE=cpu; fi
fi
MODE="${MODE:-stable}"
case "$DEVICE" in cpu|gpu|tpu) ;; *) echo "setup.sh: DEVICE=$DEVICE is not one of cpu, gpu, tpu" >&2; exit 2 ;; esac
case "$MODE" in stable|nightly) ;; *) echo "setup.sh: MODE=$MODE is not one of stable, nightly" >&2; exit 2 ;; esac

PYTHON="${PYTHON:-python3}"
PIP=("$PYTHON" -m pip install --quiet --disable-pip-version-check)
JAX_RANGE="$(grep -E '^jax[><=]' requirements.txt | head -n1 | sed 's/^jax//')"
echo "setup.sh: DEVICE=$DEVICE MODE=$MODE python=$("$PYTHON" -c 'import sys; print(sys.executable)')"

case "$DEVICE" in
  cpu) extra="" ;;
  gpu) extra="[cuda12]" ;;
  tpu) extra="[tpu]" ;;
esac
if [[ "$MODE" == "stable" ]]; then
  "${PIP[@]}" "jax${extra}${JAX_RANGE}"
else
  # Nightly jax/jaxlib (and libtpu or the CUDA plugin) from JAX's nightly index.
  "${PIP[@]}" -U --pre "jax${extra}" jaxlib \
    -i https://us-python.pkg.dev/ml-oss-artifacts-published/jax/simple/ -f https://storage.googleapis.com/jax-releases/libtpu_releases.html
fi

"${PIP[@]}" -r requirements.txt
CHECK_ENV=()
if [[ "$DEVICE" == tpu ]] && ! compgen -G "/dev/accel*" >/dev/null && ! compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
  # libtpu on a host without TPU chips: for train_compile.py's TPU targets; MaxText keeps JAX on the CPU here.
  echo "setup.sh: no TPU chips on this host: libtpu is installed to compile for TPU targets (MaxText/train_compile.py)"
  CHECK_ENV=(JAX_PLATFORMS=cpu)
fi
env "${CHECK_ENV[@]}" "$PYTHON" -c "import jax, flax, optax, orbax.checkpoint, grain, sentencepiece; print('setup.sh: ok, jax', jax.__version__, 'backend', jax.default_backend())"
