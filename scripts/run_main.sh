#!/usr/bin/env bash
# Set-up, then the main job: the default config (2 VWs x 2 stages, Nm = 2, D = 1, CNN on Fashion-MNIST) under MPI.
# CONFIG=experiments/configs/lm.py runs the byte-level GPT on the fortunes corpus (setup installs it).
# Extra arguments go to hetpipe_jax.train, e.g. --config.staleness_bound=2.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-experiments/configs/default.py}
bash scripts/setup.sh "$CONFIG" "$@"  # installs the data this config needs (Fashion-MNIST, or fortunes for text)
NUM_RANKS=${NUM_RANKS:-3}  # 1 parameter server + one rank per virtual worker
WORKDIR=${WORKDIR:-runs/default-$(date +%Y%m%d-%H%M%S)}
echo "run: $NUM_RANKS ranks, config $CONFIG, workdir $WORKDIR"
exec .venv/bin/mpiexec -n "$NUM_RANKS" .venv/bin/python -m mpi4py -m hetpipe_jax.train \
  --config="$CONFIG" --workdir="$WORKDIR" "$@"
