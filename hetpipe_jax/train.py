"""Entry point: HetPipe training over MPI (rank 0 = parameter server, ranks 1..N = virtual workers; with
``config.num_ps_shards`` = S: ranks 0..S-1 = PS shards, ranks S..S+N-1 = VWs; with ``config.stage_ranks``: the VWs'
further stages on ranks S+N.., see ``python -m hetpipe_jax.launch``).

  mpiexec -n <1+N> python -m mpi4py -m hetpipe_jax.train --config=experiments/configs/default.py \
      --workdir=runs/default [--config.staleness_bound=2 ...] [--resume]

jax is imported only after the config is read, so the forced host-device count for CPU stages is set first. A rank
that seems hung prints every thread's Python stack to its stderr on ``kill -USR1 <pid>`` (``faulthandler``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from hetpipe_jax.data.fashion_mnist import DataError
from hetpipe_jax.jobs.job_config import ConfigError, resolve_job
from hetpipe_jax.jobs.outputs import ReplicasDivergedError
from hetpipe_jax.mpi import rank_devices
from hetpipe_jax.mpi import rank_records
from hetpipe_jax.ps.param_server import BadUpdateError
from hetpipe_jax.rules.watchdog import HungRankError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Job config file (ml_collections).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config.json, metrics, summary and checkpoint.")
_PLAN = flags.DEFINE_string("plan", None, "Plan JSON from `python -m hetpipe_jax.plan` (same as --config.plan).")
_MODE = flags.DEFINE_enum("mode", "mpi", ["mpi", "virtual"],
                          "mpi: rank 0 = PS, ranks 1..N = VWs, wall time. virtual: one process runs every VW in "
                          "simulated time (the event engine's schedule, real numerics).")
_RESUME = flags.DEFINE_bool("resume", False, "Continue the run in --workdir from its newest readable checkpoint "
                            "(config.checkpoint_every_waves > 0 writes them); the config may name a new plan.")
flags.mark_flags_as_required(["config", "workdir"])
_REPORT_GRACE_S = 3.0


def _set_platform(job) -> None:
  """Sets JAX_PLATFORMS / XLA_FLAGS for this process before jax is imported (CPU: forced host devices)."""
  settings = job
  if job.platform == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    needed = settings.devices_needed
    if _MODE.value == "virtual":  # every VW's stages in this one process (round-robin beyond 16)
      needed = min(16, sum(len(v.devices) for v in settings.vws))
    count = job.pipeline.num_cpu_devices or needed
    flag = f"--xla_force_host_platform_device_count={count}"
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in xla_flags:
      os.environ["XLA_FLAGS"] = f"{xla_flags} {flag}".strip()


def main(argv) -> None:
  del argv
  if sys.__stderr__ is not None:  # a hung rank's stacks, on demand (module docstring), to the process's own stderr
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
  from mpi4py import MPI
  comm = MPI.COMM_WORLD
  rank = comm.Get_rank()
  logging.set_verbosity(logging.INFO if rank == 0 else logging.WARNING)
  config = _CONFIG.value
  if _MODE.value == "mpi":  # who this rank is, for a launcher naming a failed rank (hetpipe_jax.mpi.rank_records)
    rank_records.write_proc(_WORKDIR.value, rank, comm.Get_size())
  try:
    if _PLAN.value is not None:
      given = "config.plan" in flags.FLAGS and flags.FLAGS["config.plan"].present
      if given and config.plan and config.plan != _PLAN.value:  # one of them would be dropped
        raise ConfigError(f"--plan={_PLAN.value} and --config.plan={config.plan} name different plans: give one")
      config.plan = _PLAN.value
    job = resolve_job(config, _MODE.value, _RESUME.value)  # the one reading of the config (and the plan)
    try:  # the launcher's per-rank GPUs (HETPIPE_RANK_DEVICES), before jax starts a backend
      rank_devices.apply(rank, comm.Get_size(), job.platform)
    except rank_devices.RankDevicesError as e:
      raise ConfigError(str(e)) from None
    _set_platform(job)
    if _MODE.value == "virtual":
      if comm.Get_size() != 1:
        raise ConfigError(f"--mode=virtual runs in one process; launch it without mpiexec (world size is "
                          f"{comm.Get_size()})")
      from hetpipe_jax.jobs import virtual_job
      virtual_job.run(job, _WORKDIR.value)
    else:
      from hetpipe_jax.jobs import allreduce_job, mpi_job
      # the PS methods' job, or all-reduce BSP (one rank per VW, no PS: gpipe, 1f1b_flush, horovod), by ``sync``
      driver = {"wsp": mpi_job, "allreduce": allreduce_job}[job.pipeline.sync]
      driver.run(job, _WORKDIR.value, comm)
  except (ConfigError, DataError, FileExistsError, BadUpdateError, ReplicasDivergedError) as e:
    # Every rank validates the same settings; rank 0 reports and its exit aborts the mpi_job. Another rank reports
    # only if it is still alive after a moment (its failure was its own, e.g. a data file missing on its node).
    if _MODE.value == "mpi":  # a launcher's recovery does not restart what would fail again
      rank_records.write_failure(_WORKDIR.value, rank, e)
    if rank != 0:
      time.sleep(_REPORT_GRACE_S)
    print(f"error: {e}" if rank == 0 else f"error: [rank {rank}] {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  except HungRankError as e:  # the PS's watchdog (MPI): the launcher's recovery reads the blamed rank from the record
    rank_records.write_failure(_WORKDIR.value, rank, e, suspect_rank=e.rank)
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(3)
  except Exception as e:  # pylint: disable=broad-except  # a bug or a lost peer: recorded for the launcher, re-raised
    if _MODE.value == "mpi":
      rank_records.write_failure(_WORKDIR.value, rank, e)
    raise


if __name__ == "__main__":
  app.run(main)
