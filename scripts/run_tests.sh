#!/usr/bin/env bash
# Set-up, then the whole test suite (CPU only; MPI tests launch mpiexec themselves). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q tests "$@"
