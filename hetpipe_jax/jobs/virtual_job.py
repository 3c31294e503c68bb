"""``hetpipe_jax.train --mode=virtual``: one process trains every VW of a (possibly large) cluster in simulated time.

Runtime layer. Same settings, validation and outputs as the MPI job (:mod:`hetpipe_jax.jobs.mpi_job`), with times in
simulated seconds (labelled ``simulated_*``) from the cost model's task durations (``config.emulate_stage_ms``, or
``config.plan`` with the GPU types of its cluster), driven by :mod:`hetpipe_jax.runtime.virtual_time`.
"""

from __future__ import annotations

import time

from absl import logging
import jax

from hetpipe_jax.jobs import resume as resume_lib
from hetpipe_jax.jobs.job import Job
from hetpipe_jax.jobs.lead_role import Lead, finish_allreduce
from hetpipe_jax.jobs import vw_role
from hetpipe_jax.jobs.outputs import check_replicas_identical, weights_sha256
from hetpipe_jax.jobs.run_context import RunContext, set_up
from hetpipe_jax.jobs.summary import Summary, allreduce_results, rates, settings_summary, wsp_results
from hetpipe_jax.ps.param_server import ParameterServer
from hetpipe_jax.runtime import virtual_time
from hetpipe_jax.runtime.clock_log import ClockLog, progress_bar
from hetpipe_jax.sim import engine as engine_lib
from hetpipe_jax.sim import engine_report
from hetpipe_jax.sim import trace


def run(job: Job, workdir: str) -> dict:
  """Trains in virtual time; writes the run's outputs (:mod:`hetpipe_jax.jobs.outputs`) and, every
  ``checkpoint.every_waves`` global-clock ticks, a training checkpoint (:mod:`hetpipe_jax.jobs.resume`).

  Args:
    job: :func:`hetpipe_jax.jobs.job_config.resolve_job` with mode ``"virtual"`` (``job.resume``: continue from the
      newest readable checkpoint in ``workdir``, any plan of the same model).
    workdir: the run's output directory.

  Raises:
    ConfigError: invalid settings, no task times (set ``config.emulate_stage_ms`` or use a plan), ``resume``
      without checkpoints (or checkpoints without ``resume``), or a checkpoint of another model.
  """
  ctx = set_up(job, workdir)
  # the PS methods' run, or all-reduce BSP (no PS: gpipe, 1f1b_flush, horovod), by the method's ``sync``
  return _RUNS[job.pipeline.sync](ctx)


def _run_wsp(ctx: RunContext) -> dict:
  """:func:`run` for the parameter-server methods (hetpipe, pipedream)."""
  settings, spec, partitions, point = ctx.job, ctx.spec, ctx.partitions, ctx.point
  times, num_mb = ctx.task_times, ctx.num_minibatches
  nm, n = settings.num_inflight, settings.num_virtual_workers
  start_mb = ctx.start_minibatch
  num_waves = (num_mb - start_mb) // nm  # waves of this run (after the resume point)
  clock0 = ctx.clock0
  config_json = ctx.config_json(emulate_plan=ctx.emulate_plan)
  outputs = ctx.start_outputs(config_json, "[virtual]")

  server = ParameterServer(ctx.flat0, n, settings.wsp.ps_apply, **settings.ps.scaling_kwargs())
  devices = jax.local_devices()
  outbox: dict = {}
  meta = point.meta if point else {}
  # every VW's minibatch p of a segment is the data's off.minibatch + p
  off = resume_lib.Offsets(clock0, start_mb, float(meta.get("time_s", 0.0)))
  vws = [vw_role.wsp_vw(ctx, v, stage_devices, virtual_time.RecordingPSClient(v, outbox), off)
         for v, stage_devices in enumerate(_stage_devices(partitions, devices))]

  evaluator = ctx.evaluator(devices[0])
  eval_every = ctx.eval_every
  total_waves = clock0 + num_waves
  bar = None
  if settings.run.progress:
    bar = progress_bar(total_waves, "[virtual] global clock", "wave", initial=clock0)
  log = ClockLog(outputs.log_metrics, evaluator.evaluate, eval_every, settings.run.log_every_waves, simulated=True,
                 name="[virtual]", bar=bar)
  log.restore(meta)
  lead = Lead(ctx, log, config_json)
  records = lead.records
  host_t0 = log.host_t0

  def on_clock(clock: int, t: float, losses: list) -> None:
    clock += off.clock
    log.losses += [s / max(k, 1) for _, s, k in losses]
    log.tick(clock, ctx.minibatches_at(clock) * n, t + off.time_s, lambda: server.weights)
    if bar is not None:
      bar.update(clock - bar.n)

  logging.info("[virtual] %d VWs x %d minibatches (Nm=%d, D=%d, ps_apply=%s) of %s in simulated time%s", n, num_mb,
               nm, settings.staleness_bound, settings.wsp.ps_apply, spec.name,
               f", resumed at global clock {clock0}" if point else "")
  report = None
  wait_s = (list(meta.get("wait_s", [])) + [0.0] * n)[:n]  # per VW, over the whole run (a new plan may change N)
  idle_s = (list(meta.get("idle_s", [])) + [0.0] * n)[:n]
  max_distance = int(meta.get("max_clock_distance", 0))
  try:
    for first, end in ctx.segments():
      if first != clock0 or point:
        server.state = server.state.fresh()
        for vw in vws:
          vw.begin_segment(server.weights)
      off.clock, off.minibatch = first, ctx.minibatches_at(first)
      server.wave_offset = first
      marks = [len(vw.records) for vw in vws]
      report, _ = virtual_time.run(vws, server, outbox, times, end - first, settings.staleness_bound,
                                   settings.wsp.pull_every_wave, on_clock)
      for vw, mark in zip(vws, marks):
        for rec in vw.records[mark:]:
          resume_lib.shift_record(rec, off)
          records.append(dict(rec.__dict__))
      lead.end_segment(first, server.state)
      for r in report.vws:
        wait_s[r.vw_id] += r.wait_s
        idle_s[r.vw_id] += r.idle_s
      max_distance = max(max_distance, report.max_clock_distance)
      # The barrier: the last pushes reach the PS and its weights reach every VW before the next segment starts.
      # After the last segment there is none: the run ends when its last minibatch completes, as in the engine.
      off.time_s += report.makespan_s + (max(t.push_s + t.pull_s for t in times) if end < total_waves else 0.0)
      if lead.store is not None and settings.checkpoint.due(end, total_waves):
        lead.save(end, server.weights, {v: vw.opt_state_by_layer() for v, vw in enumerate(vws)}, time_s=off.time_s,
                  version_ids=[vw.version.version_id for vw in vws],
                  extra={"mode": "virtual", "wait_s": wait_s, "idle_s": idle_s, "max_clock_distance": max_distance})
  finally:
    lead.close()
  if bar is not None:
    bar.update(total_waves - bar.n)
    bar.close()
  total = num_mb * n
  final, lead_fields = lead.finish(outputs, evaluator.evaluate, server.weights, total_waves, total, off.time_s,
                                   write_trace=lambda: _write_trace(report, outputs.dir))
  sim_time = off.time_s
  summary = Summary("virtual", wsp_results(final, config_json, log.loss, total, num_mb), {
      # The engine's network rule (rules/network: VWs on one node share its NIC), as it ran.
      **rates("virtual", sim_time, total, settings.batch_size,
              shared_nic=engine_lib.EngineConfig.shared_nic if report is None else report.config["shared_nic"]),
      "steady_minibatches_per_s": engine_report.steady_rates(
          [[r["complete_time_s"] for r in records if r["vw_id"] == v and r["minibatch_id"] >= start_mb]
           for v in range(n)], nm, warmup_waves=1)[1],
      "host_wall_time_s": time.perf_counter() - host_t0,
  }, settings_summary(settings, partitions, spec), total_waves, {
      **lead_fields,
      "wait_s": {str(v): w for v, w in enumerate(wait_s)},
      "idle_s": {str(v): w for v, w in enumerate(idle_s)},
      "max_clock_distance": max_distance,
  }).write(outputs)
  logging.info("[virtual] done: test accuracy %.4f, %d minibatches in %.1f simulated s (%.1f host s)",
               final["test_accuracy"], total, sim_time, summary["host_wall_time_s"])
  return summary


def _run_allreduce(ctx: RunContext) -> dict:
  """``--mode=virtual`` for the all-reduce methods (gpipe, 1f1b_flush, horovod): every VW in one process, the
  engine's all-reduce BSP schedule (:func:`hetpipe_jax.runtime.virtual_time.run_allreduce`), real numerics."""
  settings, spec, partitions, layout = ctx.job, ctx.spec, ctx.partitions, ctx.layout
  workdir, times, steps = ctx.workdir, ctx.task_times, ctx.num_minibatches
  n, m = settings.num_virtual_workers, settings.num_inflight
  outputs = ctx.start_outputs(ctx.config_json(emulate_plan=ctx.emulate_plan), "[virtual]")
  devices = jax.local_devices()
  outbox: dict = {}
  vws = [vw_role.flush_vw(ctx, v, stage_devices, virtual_time.HeldReducer(v, outbox))
         for v, stage_devices in enumerate(_stage_devices(partitions, devices))]
  evaluator = ctx.evaluator(devices[0])
  eval_every = ctx.eval_every
  bar = None
  if settings.run.progress:
    bar = progress_bar(steps, f"[virtual {settings.method}] step", "step")
  log = ClockLog(outputs.log_metrics, evaluator.evaluate, eval_every, settings.run.log_every_waves, simulated=True,
                 eval_before=steps, name=f"[virtual {settings.method}]", bar=bar)
  host_t0 = log.host_t0

  def on_step(step: int, t: float, loss: float) -> None:
    log.losses.append(loss)
    if bar is not None:
      bar.update(1)
    log.tick(step + 1, (step + 1) * n, t, lambda: layout.flatten(vws[0].layer_params()))

  logging.info("[virtual] %s: %d VWs x %d steps of %d micro-batches of %s in simulated time", settings.method, n,
               steps, m, spec.name)
  report, _ = virtual_time.run_allreduce(vws, outbox, times, steps, on_step)
  if bar is not None:
    bar.close()
  sim_time = report.makespan_s
  shared_nic = report.config["shared_nic"]  # the engine's network rule, as it ran
  flats = {vw.vw_id: layout.flatten(vw.layer_params()) for vw in vws}  # each replica's final weights, once
  digests = {v: weights_sha256(flat) for v, flat in flats.items()}
  final, lead_fields = finish_allreduce(
      ctx, outputs, log, evaluator.evaluate, flats[0], digests,
      [dict(rec.__dict__) for vw in vws for rec in vw.records], sim_time,
      allreduce={"steps": report.final_global_clock,
                 "allreduce_s_per_step": max(t.allreduce_time_s(shared_nic) for t in times)},
      write_trace=lambda: _write_trace(report, outputs.dir))
  total = steps * n
  summary = Summary("virtual", allreduce_results(final, log.loss, steps, n, m), {
      **rates("virtual", sim_time, total, settings.batch_size),
      "steady_minibatches_per_s": report.total_minibatches_per_s / m,
      "host_wall_time_s": time.perf_counter() - host_t0,
  }, settings_summary(settings, partitions, spec), steps, {
      "shared_nic": shared_nic,
      **lead_fields,
      "wait_s": {str(r.vw_id): r.wait_s for r in report.vws},
      "idle_s": {str(r.vw_id): r.idle_s for r in report.vws},
  }).write(outputs)
  check_replicas_identical(digests, workdir)  # a non-zero exit
  logging.info("[virtual] done: test accuracy %.4f, %d minibatches in %.1f simulated s (%.1f host s)",
               final["test_accuracy"], total, sim_time, summary["host_wall_time_s"])
  return summary


def _write_trace(report, out) -> None:
  """The engine report's Chrome trace (``trace.json``) and Gantt chart (``gantt.png``) in the run's directory."""
  from hetpipe_jax.sim import gantt  # matplotlib only when drawing
  trace.write_trace(trace.report_trace(report), str(out / "trace.json"))
  gantt.plot_report(report, str(out / "gantt.png"))


def _stage_devices(partitions: list, devices: list) -> list[list]:
  """Per VW its stages' devices: this host's devices in turn, VW after VW (wrapping around)."""
  out, nxt = [], 0
  for partition in partitions:
    out.append([devices[(nxt + s) % len(devices)] for s in range(len(partition))])
    nxt += len(partition)
  return out


_RUNS = {"wsp": _run_wsp, "allreduce": _run_allreduce}  # the methods table's ``sync`` -> its run
