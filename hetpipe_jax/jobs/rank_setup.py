"""What each rank of an MPI job sets up from the plan: its GPUs (the launcher's per-rank table), its stages' devices,
its stage link, and the stage-rank and sharded-PS layout records (HetPipe §8.1's ED/HD VWs across nodes).

Runtime layer; used by :mod:`hetpipe_jax.jobs.mpi_job` and :mod:`hetpipe_jax.jobs.allreduce_job`.
"""

from __future__ import annotations

import os

import jax

from hetpipe_jax.jobs.job import Job
from hetpipe_jax.jobs.job_config import ConfigError
from hetpipe_jax.mpi import rank_devices
from hetpipe_jax.mpi.rank_layout import stage_rank_layout, stage_ranks_of_vw
from hetpipe_jax.mpi.stage_link import StageLink, stage_boundaries


def stage_link(settings: Job, spec, partition, vw_id, num_mb, comm):
  """This rank's :class:`hetpipe_jax.mpi.stage_link.StageLink` for VW ``vw_id`` (stage ranks)."""
  ranks = stage_ranks_of_vw(settings.num_ps_shards, settings.stage_groups, vw_id)
  return StageLink(comm, vw_id, ranks, stage_boundaries(spec, partition, settings.batch_size), num_mb,
                   ahead=settings.num_inflight + 1)


def rank_devices_of(platform: str, comm):
  """This rank's GPU restriction from the launcher (:mod:`hetpipe_jax.mpi.rank_devices`; applied by ``train`` before
  jax started), or None. Read once per rank by the job, which passes it on."""
  return rank_devices.apply(comm.Get_rank(), comm.Get_size(), platform, environ=dict(os.environ))


def check_rank_devices(settings: Job, table) -> None:
  """Every rank's entry of the launcher's GPU table holds the plan GPUs of the stages it runs (ranks past the table
  or the job's layout are left to the world-size check).

  Raises:
    ConfigError: a rank whose stages use a GPU its entry lacks (the message names ``HETPIPE_RANK_DEVICES``).
  """
  needed = [()] * len(table)
  groups = settings.stage_groups or [(tuple(range(len(v.devices))),) for v in settings.vws]
  for r, v, stages in stage_rank_layout(settings.num_ps_ranks, groups):
    if r < len(needed):
      needed[r] = tuple(settings.vws[v].devices[s] for s in stages)
  try:
    rank_devices.check_covers(table, needed)
  except rank_devices.RankDevicesError as e:
    raise ConfigError(str(e)) from None


def rank_device_fields(restricted) -> dict:
  """What config.json records about the ranks' visible GPUs (per rank its plan GPU ids, and how they were applied),
  from :func:`rank_devices_of`."""
  if restricted is None:
    return {"rank_visible_devices": None, "rank_devices_applied": "none (no HETPIPE_RANK_DEVICES)"}
  return {"rank_visible_devices": [list(ids) for ids in restricted.table],
          "rank_devices_applied": restricted.applied}


def stage_devices(settings, vw_id: int, link, restricted=None) -> list:
  """Per stage, its local device (stage ranks: a stage on another rank gets a placeholder, never used);
  ``restricted``: this rank's :func:`rank_devices_of` (None: it sees every device of its host).

  Raises:
    ConfigError: a rank restricted to its GPUs (``HETPIPE_RANK_DEVICES``) lacks one of its stages' GPUs.
  """
  local = jax.local_devices()
  out = []
  for s, d in enumerate(settings.vws[vw_id].devices):
    if link is not None and not link.is_local(s):
      out.append(local[0])
      continue
    if restricted is not None:
      try:
        d = restricted.local_index(d)
      except ValueError as e:
        raise ConfigError(f"VW {vw_id} stage {s}: {e}") from None
    if d >= len(local):
      raise ConfigError(f"VW {vw_id} stage {s} needs local device {d}; this rank sees {len(local)}")
    out.append(local[d])
  return out


def stage_rank_fields(settings: Job) -> dict:
  """What config.json and summary.json record about stage ranks: per VW, its stage groups and each stage's rank."""
  if not settings.stage_groups:
    return {}
  return {"stage_rank_groups": [[list(g) for g in groups] for groups in settings.stage_groups],
          "stage_rank_of_stage": [stage_ranks_of_vw(settings.num_ps_shards, settings.stage_groups, v)
                                  for v in range(settings.num_virtual_workers)]}
