#!/usr/bin/env bash
# The GPU check (issue 28): one command, run from the repository root on a borrowed GPU machine, that writes
# gpu_check.json and its plots under $OUT (or --out=DIR). `--cpu` is the rehearsal CI runs on CPU devices.
#
#   bash scripts/gpu_check.sh [--cpu] [--out=DIR] [--steps=env,pytest_gpu,main_job,profile,pipeline,memory]
#
# Set-up here, nothing fetched: when .gpu_carry/ exists (made by scripts/gpu_wheels.sh on a machine with PyPI), its
# wheels (what the GPU image lacks: ml_collections, mpi4py + the mpich library) are installed under
# /tmp/hetpipe_gpu_prefix and put first on PYTHONPATH, PATH and LD_LIBRARY_PATH, and its fashion-mnist/ becomes
# HETPIPE_DATA_DIR. Python: $PYTHON, else .venv/bin/python when present (then the wheels are not needed), else
# python3 (the GPU image's, with its JAX).
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=${GPU_CARRY:-.gpu_carry}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python  # set-up made it: everything is installed
else PY=python3
fi
if [ "$PY" != .venv/bin/python ] && ls "$CARRY"/wheels/*.whl >/dev/null 2>&1; then
  PREFIX=/tmp/hetpipe_gpu_prefix
  if [ ! -f "$PREFIX/.installed" ]; then
    echo "gpu_check: installing the carried wheels into $PREFIX: $(ls "$CARRY"/wheels | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix "$PREFIX" \
      "$CARRY"/wheels/*.whl || { echo "gpu_check: installing the wheels failed" >&2; exit 1; }
    touch "$PREFIX/.installed"
  fi
  SITE=$(echo "$PREFIX"/lib/python3*/site-packages)
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$PREFIX/bin:$PATH"
  export LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ -z "${HETPIPE_DATA_DIR:-}" ] && [ -d "$CARRY/fashion-mnist" ]; then
  export HETPIPE_DATA_DIR="$PWD/$CARRY/fashion-mnist"
fi
export PYTHONUNBUFFERED=1
# Several processes share the one GPU (the MPI ranks of the main job and of the GPU tests): allocate on demand.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
# One compilation cache for every process of the check (the memory step compiles the same layers in 4 processes).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/hetpipe_gpu_check_jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}
exec "$PY" scripts/gpu_check.py "$@"
