#!/usr/bin/env bash
# Idempotent set-up: .venv with the pinned packages, and the Fashion-MNIST files (Debian package) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "setup: need Python 3.11 (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

# Which jax build: the CUDA 12 build of the pinned version when an NVIDIA GPU answers `nvidia-smi -L`, else the CPU
# build. HETPIPE_JAX_BUILD=cpu|cuda12 overrides the detection.
jax_version=$(sed -n 's/^jax==\([^ #]*\).*/\1/p' requirements.txt)
jax_build() {
  case "${HETPIPE_JAX_BUILD:-}" in
    cpu|cuda12) echo "$HETPIPE_JAX_BUILD"; return ;;
    "") ;;
    *) echo "setup: HETPIPE_JAX_BUILD=$HETPIPE_JAX_BUILD must be cpu or cuda12" >&2; exit 1 ;;
  esac
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda12; else echo cpu; fi
}
build=$(jax_build)
if [ "$build" = cuda12 ]; then
  why="CUDA 12 build, jax[cuda12]==$jax_version: nvidia-smi found an NVIDIA GPU (run with --config.platform=gpu)"
else
  why="CPU build: no NVIDIA GPU answered nvidia-smi"
fi
[ -n "${HETPIPE_JAX_BUILD:-}" ] && why="$why (HETPIPE_JAX_BUILD=$HETPIPE_JAX_BUILD)"
if [ "${SETUP_DETECT_ONLY:-0}" = 1 ]; then  # tests: report the choice, install nothing
  echo "setup: jax $jax_version, $why"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
[ "$build" = cuda12 ] && want="$want cuda12"  # the CPU stamp is the plain hash (as before this option existed)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing requirements.txt into .venv"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.txt
  if [ "$build" = cuda12 ]; then
    echo "setup: installing jax[cuda12]==$jax_version (the CUDA build of the pinned jax)"
    .venv/bin/python -m pip install --quiet "jax[cuda12]==$jax_version"
  fi
  echo "$want" > "$stamp"
fi
echo "setup: jax $jax_version, $why"

have_data() {
  local d
  for d in "${HETPIPE_DATA_DIR:-}" /usr/share/datasets/fashion-mnist; do
    [ -n "$d" ] && [ -e "$d/train-images-idx3-ubyte.gz" -o -e "$d/train-images-idx3-ubyte" ] && return 0
  done
  return 1
}
if ! have_data; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing the Debian package dataset-fashion-mnist"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "setup: Fashion-MNIST not found and no apt-get; put the four IDX .gz files in \$HETPIPE_DATA_DIR" >&2
  fi
fi
