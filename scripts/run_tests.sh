#!/usr/bin/env bash
# Set-up, then the whole test suite (CPU only; MPI tests launch mpiexec themselves). Extra arguments go to pytest.
# The tests run in HETPIPE_TEST_WORKERS pytest-xdist workers (default 2: most tests wait on child processes, so two
# at once keep a 2-core machine busy; 0 runs them in this process, as plain pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
workers=${HETPIPE_TEST_WORKERS:-2}
case "$workers" in
  ''|*[!0-9]*) echo "run_tests: HETPIPE_TEST_WORKERS=$workers must be a number of workers (0: no xdist)" >&2; exit 2 ;;
esac
bash scripts/setup.sh
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest -q tests "$@"
fi
exec .venv/bin/python -m pytest -q -n "$workers" tests "$@"
