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

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing requirements.txt into .venv"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.txt
  echo "$want" > "$stamp"
fi

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
