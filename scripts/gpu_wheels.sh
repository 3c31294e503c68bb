#!/usr/bin/env bash
# Makes .gpu_carry/ here (a machine that reaches PyPI): what a borrowed GPU machine lacks for scripts/gpu_check.sh,
# to carry over with the working tree (the device tool's `carry`, 64 MiB in all with the tracked files).
#   .gpu_carry/wheels/         ml_collections, mpi4py and mpich (the MPI library mpi4py loads, with mpiexec) at
#                              requirements.txt's pins, for CPython 3.12 manylinux x86-64 (the GPU image's Python;
#                              its own JAX, flax, optax, orbax, absl-py, scipy, matplotlib, tqdm and pytest are used)
#   .gpu_carry/fashion-mnist/  the four Fashion-MNIST IDX files (from $HETPIPE_DATA_DIR or the Debian package)
# Usage: bash scripts/gpu_wheels.sh [PYTHON_VERSION=3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
DEST=${GPU_CARRY:-.gpu_carry}
pin() { sed -n "s/^$1==\([^ #]*\).*/\1/p" requirements.txt; }
mkdir -p "$DEST/wheels" "$DEST/fashion-mnist"
rm -f "$DEST"/wheels/*.whl
PIP=${PIP:-python3 -m pip}
$PIP download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$DEST/wheels" \
  "ml_collections==$(pin ml_collections)" "mpi4py==$(pin mpi4py)" "mpich==$(pin mpich)" 2>&1 | grep -v "is ignored" || true
for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
  found=""
  for d in "${HETPIPE_DATA_DIR:-}" /usr/share/datasets/fashion-mnist; do
    [ -n "$d" ] && [ -f "$d/$f" ] && { found="$d/$f"; break; }
  done
  [ -n "$found" ] || { echo "gpu_wheels: $f not found: run bash scripts/setup.sh first (it installs the data)" >&2; exit 1; }
  cp "$found" "$DEST/fashion-mnist/$f"
done
n=$(ls "$DEST"/wheels/*.whl | wc -l)
[ "$n" -eq 3 ] || { echo "gpu_wheels: expected 3 wheels, got $n: $(ls "$DEST/wheels")" >&2; exit 1; }
carry=$(du -sb "$DEST" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((carry + tree))
limit=$((64 * 1024 * 1024))
echo "gpu_wheels: $DEST holds $((carry / 1048576)) MiB ($(ls "$DEST/wheels" | tr '\n' ' ')); with the tracked files" \
  "$((total / 1048576)) MiB of the 64 MiB a device call carries"
[ "$total" -le "$limit" ] || { echo "gpu_wheels: over the 64 MiB a device call carries" >&2; exit 1; }
