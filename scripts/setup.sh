#!/usr/bin/env bash
# Idempotent set-up: .venv with the pinned packages, and the data the job's config needs when missing (Debian
# packages): Fashion-MNIST (dataset-fashion-mnist), or for config.dataset="text" with no config.data_dir the fortunes
# corpus (fortunes). Usage: scripts/setup.sh [CONFIG [--config.field=value ...]] (run_main.sh passes its own).
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

apt_install() {  # apt_install PACKAGE WHAT
  if command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing the Debian package $1 ($2)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$1" >/dev/null
  else
    echo "setup: $2 not found and no apt-get; install the Debian package $1 or set config.data_dir" >&2
  fi
}

# Which dataset the config trains on (config.dataset and config.data_dir, with --config.* overrides applied).
CONFIG_FILE=${1:-experiments/configs/default.py}
[ $# -gt 0 ] && shift
read -r DATASET DATA_DIR_SET < <(.venv/bin/python - "$CONFIG_FILE" "$@" <<'PY'
import importlib.util, sys
sys.path.insert(0, ".")
spec = importlib.util.spec_from_file_location("job_config_file", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
c = module.get_config()
dataset, data_dir = c.get("dataset", "fashion_mnist"), c.get("data_dir", "")
for arg in sys.argv[2:]:
  if arg.startswith("--config.dataset="):
    dataset = arg.split("=", 1)[1]
  if arg.startswith("--config.data_dir="):
    data_dir = arg.split("=", 1)[1]
print(dataset, "1" if data_dir else "0")
PY
)
if [ "$DATASET" = "text" ]; then
  if [ "$DATA_DIR_SET" = "0" ] && [ ! -d /usr/share/games/fortunes ]; then
    apt_install fortunes "the default text corpus, /usr/share/games/fortunes"
  fi
  exit 0
fi
[ "$DATASET" = "fashion_mnist" ] || exit 0  # a user's dataset brings its own data

have_data() {
  local d
  for d in "${HETPIPE_DATA_DIR:-}" /usr/share/datasets/fashion-mnist; do
    [ -n "$d" ] && [ -e "$d/train-images-idx3-ubyte.gz" -o -e "$d/train-images-idx3-ubyte" ] && return 0
  done
  return 1
}
if ! have_data; then
  if command -v apt-get >/dev/null 2>&1; then
    apt_install dataset-fashion-mnist "Fashion-MNIST"
  else
    echo "setup: Fashion-MNIST not found and no apt-get; put the four IDX .gz files in \$HETPIPE_DATA_DIR" >&2
  fi
fi
