"""One HetPipe training job over MPI: ranks 0..S-1 run the parameter-server shards (S = config.num_ps_shards, rank 0
the lead: outputs, evaluation, checkpoints), ranks S..S+N-1 run one VW each (with ``config.stage_ranks``: each VW's
driver and first stage group; the VWs' further stage groups run on ranks S+N.., :mod:`hetpipe_jax.mpi.stage_server`).

Runtime layer; :mod:`hetpipe_jax.train` is its thin absl entry point. Everything that can be checked is checked on
every rank before training starts (settings, world size, model, partition, devices, data), so bad input ends every
rank with the same clear message and no rank waits on another.
"""

from __future__ import annotations

import math
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from hetpipe_jax.jobs import opt_checkpoint
from hetpipe_jax.jobs import rank_setup
from hetpipe_jax.jobs import resume as resume_lib
from hetpipe_jax.jobs import vw_role
from hetpipe_jax.jobs.job import Job
from hetpipe_jax.jobs.job_config import ConfigError
from hetpipe_jax.jobs.lead_role import Lead
from hetpipe_jax.jobs.outputs import write_runtime_trace
from hetpipe_jax.jobs.run_context import RunContext, set_up
from hetpipe_jax.jobs.summary import Summary, rates, settings_summary, wsp_results
from hetpipe_jax.mpi import ps_shards
from hetpipe_jax.mpi.ps_client import MPIPSClient, StageRankPSClient
from hetpipe_jax.mpi.ps_server import ParameterServerService
from hetpipe_jax.mpi.rank_layout import stage_rank_layout
from hetpipe_jax.mpi.stage_client import RemoteStages
from hetpipe_jax.mpi.stage_server import StageRankServer
from hetpipe_jax.ps.param_server import ParameterServer
from hetpipe_jax.runtime import placement as placement_lib


def run(job: Job, workdir: str, comm) -> dict | None:
  """Runs the job on this rank; returns the summary on rank 0, None on the other ranks.

  With ``checkpoint.every_waves = K > 0`` the run is cut into segments at the global clocks K, 2K, ...; each
  segment's end is a checkpoint barrier (:mod:`hetpipe_jax.jobs.resume`).

  Args:
    job: :func:`hetpipe_jax.jobs.job_config.resolve_job` (mode ``"mpi"``; ``job.resume``: continue from the newest
      readable checkpoint in ``workdir``, any plan of the same model).
    workdir: the run's output directory.
    comm: the MPI communicator (ranks 0..S-1 = PS shards, then the VWs, then the stage ranks).

  Raises:
    ConfigError: invalid settings (raised identically on every rank before any work), ``resume`` without
      checkpoints (or checkpoints without it), a checkpoint of another model, nothing left to train.
    fashion_mnist.DataError: missing or corrupt dataset files.
  """
  if not job.num_ps_ranks:
    raise ConfigError(f"config.method={job.method!r} has no PS: its job is hetpipe_jax.jobs.allreduce_job")
  ctx = set_up(job, workdir, comm)
  rank = comm.Get_rank()
  num_shards = job.num_ps_shards
  if rank == 0:
    return _run_ps(ctx)
  if rank < num_shards:
    ps_shards.run_shard(job, job.wsp.ps_apply, ctx.flat0, ctx.shards, rank, comm, ctx.partitions,
                        ctx.layout.layer_offsets, ctx.segments(), ctx.eval_every)
    return None
  if rank >= num_shards + job.num_virtual_workers:  # a stage rank
    vw_id = next(v for r, v, _ in stage_rank_layout(num_shards, job.stage_groups) if r == rank)
    _run_stage_rank(ctx, vw_id)
    return None
  _run_vw(ctx, rank - num_shards)
  return None


def _run_stage_rank(ctx: RunContext, vw_id: int) -> None:
  """A stage rank: runs its stages of VW ``vw_id`` as the VW's driver commands
  (:class:`hetpipe_jax.mpi.stage_server.StageRankServer`), pushes and pulls its stages' parts of every shard
  (:class:`hetpipe_jax.mpi.ps_client.StageRankPSClient`), then joins the job's final collective.

  Checkpoint segments (:mod:`hetpipe_jax.jobs.resume`): the driver stops the rank at each segment's end; the rank
  sends its stages' optimizer state to the lead shard when a checkpoint is due (a rank holding parameters), takes its
  parts of the barrier's global weights from its shards and serves the next segment from them. A resumed run starts
  from the checkpoint's optimizer state and version numbering, as the driver does."""
  settings, layout, comm, shards = ctx.job, ctx.layout, ctx.comm, ctx.shards
  link = rank_setup.stage_link(settings, ctx.spec, ctx.partitions[vw_id], vw_id, ctx.num_minibatches, comm)
  devices = rank_setup.stage_devices(settings, vw_id, link, ctx.restricted)
  vw = vw_role.stage_rank_vw(ctx, vw_id, devices, link)
  labels = ctx.minibatches(vw_id).get(0)[1]
  local_index = StageRankServer.local_index_of(vw)
  ps = StageRankPSClient(comm, ps_shards.vw_parts(settings, shards, ctx.partitions, layout.layer_offsets)[vw_id],
                         local_index, settings.num_virtual_workers)
  logging.info("[VW %d] stage rank %d: stages %s on %s", vw_id, comm.Get_rank(), vw.local_stages,
               [str(devices[s]) for s in vw.local_stages])
  segs, total = ctx.segments(), ctx.total_waves
  for i, (first, end) in enumerate(segs):
    server = StageRankServer(comm, vw, settings.num_ps_shards + vw_id, labels, ps, shards.index)
    server.serve(last=i + 1 == len(segs))
    due = settings.checkpoint.due(end, total) and bool(ps.shards)  # a rank without parameters has no state to save
    opt = opt_checkpoint.state_bytes(*vw.opt_state_by_layer()) if due else None
    if i + 1 < len(segs):
      flat = np.zeros(layout.num_params, np.float32)
      flat[local_index] = ps.barrier(end - first, opt)
      vw.begin_segment(flat)
    elif opt is not None:  # the final checkpoint's
      ps.send_opt_state(end - first, opt)
      ps.flush()
  ps_shards.ps_byte_matrix(comm)


_STAT_SUMS = ("wait_s", "idle_s", "wall_time_s", "num_pulls", "num_pushes", "num_tasks", "num_overruns", "overrun_s",
              "host_busy_s", "update_s", "sync_s", "inject_s", "dispatch_s")


def _run_vw(ctx: RunContext, vw_id: int) -> None:
  settings, layout, comm, shards, point, num_mb = ctx.job, ctx.layout, ctx.comm, ctx.shards, ctx.point, ctx.num_minibatches
  partition, partitions = ctx.partitions[vw_id], ctx.partitions
  task_times = ctx.task_times[vw_id] if ctx.task_times else None
  link = remote = None
  placement = placement_lib.ALL_LOCAL
  if settings.stage_groups:  # stage ranks: this rank runs the VW's first stage group and drives the others
    link = rank_setup.stage_link(settings, ctx.spec, partition, vw_id, num_mb, comm)
    remote = RemoteStages(comm, vw_id, link)
    placement = placement_lib.LinkedStages(link, remote)
  devices = rank_setup.stage_devices(settings, vw_id, link, ctx.restricted)
  sharded = shards if settings.num_ps_shards > 1 else None
  parts = ps_shards.vw_parts(settings, shards, partitions, layout.layer_offsets)
  client = MPIPSClient(comm, vw_id, layout.num_params, settings.num_virtual_workers, shards=sharded,
                       first_vw_rank=settings.num_ps_shards, parts=parts[vw_id] if parts else None)
  nm = settings.num_inflight
  clock0, total, segs = ctx.clock0, ctx.total_waves, ctx.segments()
  start_mb = ctx.start_minibatch
  off = resume_lib.Offsets(clock0, start_mb, 0.0)
  vw = vw_role.wsp_vw(ctx, vw_id, devices, client, off, ps_shards=sharded, placement=placement,
                      task_time_s=task_times.task_duration_s if task_times else None)
  stages = vw.stages
  first_start = None
  if point is not None:
    first_start = point.meta.get("start_unix_s", {}).get(str(vw_id % int(point.meta["num_virtual_workers"])))
  logging.info("[VW %d] %d stages %s on %s, %d minibatches", vw_id, len(stages), partition,
               [str(d) for d in devices], num_mb)
  totals: dict[str, Any] = dict.fromkeys(_STAT_SUMS, 0)
  totals["barrier_s"] = 0.0  # at checkpoint barriers: sending the state, waiting for the others and the save
  peaks: list[int] = [0] * len(stages)
  max_concurrent = 0
  sent = 0  # records already sent to the PS
  stage_reports: dict[int, dict] = {}  # stage rank -> its reports summed over segments
  for i, (first, end) in enumerate(segs):
    off.clock, off.minibatch = first, ctx.minibatches_at(first)
    mark = len(vw.records)
    before = dict(vw.stats.__dict__)
    stats = vw.run((end - first) * nm)
    if first_start is None:
      first_start = stats.start_unix_s
    off.time_s = stats.start_unix_s - first_start
    for rec in vw.records[mark:]:
      resume_lib.shift_record(rec, off)
    for k in _STAT_SUMS:
      totals[k] += (stats.__dict__[k] - before[k]) if k != "wall_time_s" else stats.wall_time_s
    peaks = [max(a, b) for a, b in zip(peaks, stats.peak_inflight_per_stage)]
    max_concurrent = max(max_concurrent, stats.max_concurrent_tasks)
    report = {"records": [r.__dict__ for r in vw.records[sent:]], "version_id": vw.version.version_id,
              "start_unix_s": first_start}
    sent = len(vw.records)
    if i + 1 < len(segs):  # a checkpoint barrier: the PS holds every VW's waves of the run so far
      t_barrier = time.perf_counter()
      if remote is not None:  # the stage ranks end the segment too (they send their states and take their weights)
        _add_stage_reports(stage_reports, remote.stop(client.num_pulls_requested, last=False))
      opt = opt_checkpoint.state_bytes(*vw.opt_state_by_layer()) if settings.checkpoint.due(end, total) else None
      _, flat = client.barrier(end - first, report, opt)
      vw.begin_segment(flat)
      totals["barrier_s"] += time.perf_counter() - t_barrier
  stats = {**dict(vw.stats.__dict__), **totals, "peak_inflight_per_stage": peaks,
           "max_concurrent_tasks": max_concurrent, "start_unix_s": first_start}
  if settings.checkpoint.due(total, total):  # the final checkpoint's optimizer state, before DONE
    client.send_opt_state(total - segs[-1][0], opt_checkpoint.state_bytes(*vw.opt_state_by_layer()))
  trace_counts = {s.stage_id: dict(s.trace_counts) for s in stages}
  if remote is not None:  # the stage ranks' own counts replace the placeholders' (never traced here)
    _add_stage_reports(stage_reports, remote.stop(client.num_pulls_requested))
    for rep in stage_reports.values():
      trace_counts.update({int(s): c for s, c in rep["trace_counts"].items()})
    report["stage_ranks"] = {"ranks": list(link.stage_ranks),
                             "version_waits": sum(r["version_waits"] for r in stage_reports.values()),
                             "version_wait_s": sum(r["version_wait_s"] for r in stage_reports.values()),
                             "remote_tasks": sum(r["tasks"] for r in stage_reports.values())}
  report.update({
      "stats": stats,
      "partition": [list(r) for r in partition],
      "stage_devices": [d.id for d in devices],
      "trace_counts": trace_counts,
      "tasks": vw.task_log if settings.run.save_task_trace else [],
  })
  client.finish(total - segs[-1][0], report)  # the waves of the last segment (as SEGMENT counts a segment's)
  ps_shards.ps_byte_matrix(comm)
  logging.info("[VW %d] done: %.1f s, wait %.2f s, idle %.2f s", vw_id, totals["wall_time_s"], totals["wait_s"],
               totals["idle_s"])


def _add_stage_reports(into: dict[int, dict], reports: dict[int, dict]) -> None:
  """Adds one run's stage-rank reports (:meth:`hetpipe_jax.mpi.stage_client.RemoteStages.stop`) to ``into``: counts
  and seconds summed over checkpoint segments, the trace counts (kept over the job by each stage) the newest."""
  for rank, rep in reports.items():
    had = into.setdefault(rank, {"version_waits": 0, "version_wait_s": 0.0, "tasks": 0})
    had.update(trace_counts=rep["trace_counts"], version_waits=had["version_waits"] + rep["version_waits"],
               version_wait_s=had["version_wait_s"] + rep["version_wait_s"], tasks=had["tasks"] + rep["tasks"])


def _run_ps(ctx: RunContext) -> dict:
  settings, spec, layout, flat0 = ctx.job, ctx.spec, ctx.layout, ctx.flat0
  num_mb, partitions, comm, point, shards = ctx.num_minibatches, ctx.partitions, ctx.comm, ctx.point, ctx.shards
  n, nm = settings.num_virtual_workers, settings.num_inflight
  meta = point.meta if point else {}
  config_json = ctx.config_json(num_ps_shards=settings.num_ps_shards, ps_placement=settings.ps_placement,
                                **rank_setup.stage_rank_fields(settings),
                                **rank_setup.rank_device_fields(ctx.restricted))
  outputs = ctx.start_outputs(config_json, "[PS]")
  evaluator = ctx.evaluator(jax.local_devices()[0])
  eval_every = ctx.eval_every
  server = ParameterServer(shards.gather(flat0, 0), n, settings.wsp.ps_apply, **settings.ps.scaling_kwargs())  # shard 0's slice (all of it when S = 1)
  clock0, total, segs = ctx.clock0, ctx.total_waves, ctx.segments()
  start_mb = ctx.start_minibatch
  parts = ps_shards.vw_parts(settings, shards, partitions, layout.layer_offsets)
  service = ParameterServerService(comm, server, num_minibatches_per_vw=num_mb, num_inflight=nm,
                                   evaluate=evaluator.evaluate, eval_every_waves=eval_every,
                                   log_every_waves=settings.run.log_every_waves, log_metrics=outputs.log_metrics,
                                   progress=settings.run.progress, first_vw_rank=settings.num_ps_shards,
                                   parts=parts, shard=0, watchdog_s=settings.ps.watchdog_s,
                                   eval_shards=shards if settings.num_ps_shards > 1 else None)
  service.minibatches_done = [start_mb] * n
  service.log.restore(meta)
  service.time_offset_s = float(meta.get("time_s", 0.0))
  if service._bar is not None:  # pylint: disable=protected-access
    service._bar.update(start_mb * n)  # pylint: disable=protected-access
  logging.info("[PS] %d VWs x %d minibatches (Nm=%d, D=%d, ps_apply=%s), model %s with %d parameters%s", n, num_mb, nm,
               settings.staleness_bound, settings.wsp.ps_apply, spec.name, layout.num_params,
               f", resumed at global clock {clock0}" if point else "")
  lead = Lead(ctx, service.log, config_json)
  start_unix = dict(meta.get("start_unix_s", {}))
  version_ids = list(meta.get("version_ids", [0] * n))
  shard_applied = resume_lib.resumed_shard_logs(meta, settings.num_ps_shards, lead.applied)  # shards 1..S-1
  # per VW rank, the structure of its stages' optimizer state (to read its bytes); only a run that checkpoints needs it
  templates = opt_checkpoint.rank_templates(ctx) if lead.store is not None else {}
  t0 = time.perf_counter()

  def take_reports(reps: dict) -> None:
    for vw, rep in sorted(reps.items()):
      lead.records.extend(rep["records"])
      version_ids[vw] = rep["version_id"]
      start_unix.setdefault(str(vw), rep["start_unix_s"])

  def save(end: int, cut_flat: np.ndarray, opt_buffers: dict) -> None:
    lead.save(end, cut_flat, opt_checkpoint.merge_states(templates, opt_buffers, n), time_s=service.wall_s(),
              version_ids=version_ids,
              extra={"mode": "mpi", "start_unix_s": start_unix, "num_ps_shards": settings.num_ps_shards,
                     "shard_applied": shard_applied,
                     "stage_groups": [[list(g) for g in groups] for groups in settings.stage_groups]})

  try:
    for i, (first, end) in enumerate(segs):
      if i:
        server.state = server.state.fresh()
      service.clock_offset = first
      service.expect_opt_state = settings.checkpoint.due(end, total)
      service.run()
      lead.end_segment(first, server.state)
      # the cut: every shard's slice and log (each shard has every VW's waves of the segment: none starts the next)
      cut_flat, logs = ps_shards.gather_shards(comm, shards, flat0, server.weights, [])
      for log, seg_log in zip(shard_applied, logs[1:]):
        log += [(first + w, v) for w, v in seg_log]
      take_reports(service.segment_reports if i + 1 < len(segs) else service.reports)
      if i + 1 < len(segs):
        if service.expect_opt_state:
          save(end, cut_flat, service.segment_opt)
        service.release_barrier()
    if lead.store is not None and service.expect_opt_state:
      save(total, cut_flat, service.segment_opt)
  finally:
    lead.close()
    service.close()
  wall = time.perf_counter() - t0
  byte_matrix = ps_shards.ps_byte_matrix(comm)
  final, lead_fields = lead.finish(outputs, evaluator.evaluate, cut_flat, total, sum(service.minibatches_done),
                                   service.wall_s(), shard_logs=[lead.applied, *shard_applied],
                                   write_trace=lambda: write_runtime_trace(service.reports, nm, outputs.dir))
  total_mb = n * num_mb
  trained_mb = n * (num_mb - start_mb)
  per_vw = {str(vw): {k: rep["stats"][k] for k in ("wait_s", "idle_s", "wall_time_s", "num_pulls", "num_pushes",
                                                   "peak_inflight_per_stage", "max_concurrent_tasks", "num_tasks",
                                                   "num_overruns", "overrun_s", "host_busy_s", "update_s",
                                                   "start_unix_s", "barrier_s", "ps_channel", "ps_channel_s")}
            | {"stage_devices": rep["stage_devices"]}
            for vw, rep in sorted(service.reports.items())}
  summary = Summary("mpi", wsp_results(final, config_json, service.log.loss, total_mb, num_mb),
                    rates("mpi", wall, trained_mb, settings.batch_size), settings_summary(settings, partitions, spec),
                    total, {
      **lead_fields,
      "num_ps_shards": settings.num_ps_shards,
      "ps_placement": settings.ps_placement,
      "ps_shards": {"layer_shards": list(shards.layer_shards), "shard_nodes": list(settings.shard_nodes),
                    "floats_per_shard": [shards.size(s) for s in range(shards.num_shards)],
                    "first_vw_rank": settings.num_ps_shards},
      "ps_bytes": ps_shards.ps_bytes_summary(byte_matrix, settings, partitions, layout.layer_offsets, shards,
                                               total - clock0, parts),
      **rank_setup.stage_rank_fields(settings),
      **({"stage_rank_stats": {str(vw): rep["stage_ranks"] for vw, rep in sorted(service.reports.items())}}
         if settings.stage_groups else {}),
      "trace_counts": {str(vw): rep["trace_counts"] for vw, rep in sorted(service.reports.items())},
      "per_vw": per_vw,
      "wait_s": {vw: v["wait_s"] for vw, v in per_vw.items()},
      "idle_s": {vw: v["idle_s"] for vw, v in per_vw.items()},
      "ps_service": _service_times(service.push_service_s),
      # The slowest VW's seconds in checkpoint barriers (send its state, wait for the others and the save) over the
      # run's wall time: what checkpoints cost beyond the pipeline drain at each barrier.
      "checkpoint_barrier_fraction": max(v["barrier_s"] for v in per_vw.values()) / wall,
  })
  if not math.isfinite(final["test_loss"]):
    logging.warning("[PS] final test loss is not finite")
  summary = summary.write(outputs)
  logging.info("[PS] done: test accuracy %.4f, %d minibatches in %.1f s (%.1f minibatches/s)",
               final["test_accuracy"], trained_mb, wall, trained_mb / wall)
  return summary


def _service_times(seconds: list[float]) -> dict[str, Any]:
  """The lead PS's per-wave service time (a wave update's header received to applied with the pulls it unblocked
  sent; :attr:`hetpipe_jax.mpi.ps_server.ParameterServerService.push_service_s`) in milliseconds: count, mean,
  median, 95th percentile and maximum (with several shards: the lead's slice)."""
  ms = np.asarray(seconds, float) * 1e3
  if ms.size == 0:
    return {"waves": 0}
  return {"waves": int(ms.size), "mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
          "p95_ms": float(np.percentile(ms, 95)), "max_ms": float(ms.max())}
