"""One all-reduce BSP training job over MPI (gpipe, 1f1b_flush, horovod): one rank per VW, no parameter server.

Runtime layer; ``hetpipe_jax.train`` runs these methods here (:func:`run`); the PS methods' job is
:mod:`hetpipe_jax.jobs.mpi_job`; both set up through :func:`hetpipe_jax.jobs.run_context.set_up`. Rank r runs VW r:
every step its pipeline runs M micro-batches in the method's order (:mod:`hetpipe_jax.rules.methods`), then its
accumulated gradients (one contiguous float32 buffer in layer order, the step's loss sum last) are summed over all
ranks with ``MPI.Allreduce`` on each reduction segment (:func:`hetpipe_jax.rules.allreduce.reduce_segments`: the
stages when every VW has the same partition; MPICH's collective, in place on contiguous slices), and every rank
applies the same update with the mean gradient (:meth:`hetpipe_jax.runtime.flush_step.FlushUpdate.apply_reduced`).
Rank 0 also writes the run's outputs (:mod:`hetpipe_jax.jobs.outputs`): metrics per logged step, evaluations, every
rank's records (gathered at the end), summary.json and the final weights; the final weights of every rank are
checked to be identical.

Validation happens on every rank before any work, as in the HetPipe job. Not supported (refused with one message):
``--resume``; training checkpoints (``checkpoint_every_waves`` above 0; unset, it runs and is recorded as 0: only the
final weights are saved).
"""

from __future__ import annotations

import time

from absl import logging
import numpy as np

from hetpipe_jax.jobs import rank_setup, vw_role
from hetpipe_jax.jobs.job import Job
from hetpipe_jax.jobs.lead_role import finish_allreduce
from hetpipe_jax.jobs.outputs import check_replicas_identical, weights_sha256, write_runtime_trace
from hetpipe_jax.jobs.run_context import set_up
from hetpipe_jax.jobs.summary import Summary, allreduce_results, rates, settings_summary
from hetpipe_jax.rules import allreduce
from hetpipe_jax.runtime.clock_log import ClockLog, progress_bar
from hetpipe_jax.runtime.param_layout import ParamLayout


class MPIAllReducer:
  """Sums a VW's step buffer over every rank: one in-place ``Allreduce`` per reduction segment (contiguous slices of
  the layer-ordered buffer; the loss slot rides with the last segment).

  Args:
    comm: the communicator of the VW ranks.
    segment_offsets: per segment ``(start, end)`` element offsets into the buffer.
  """

  def __init__(self, comm, segment_offsets: list[tuple[int, int]]):
    self.comm = comm
    self.offsets = segment_offsets
    self.seconds = 0.0
    self.calls = 0

  def __call__(self, step: int, buf: np.ndarray) -> np.ndarray:
    from mpi4py import MPI  # pylint: disable=g-import-not-at-top
    del step
    t = time.perf_counter()
    for start, end in self.offsets:
      self.comm.Allreduce(MPI.IN_PLACE, buf[start:end], op=MPI.SUM)
    self.seconds += time.perf_counter() - t
    self.calls += 1
    return buf


def segment_offsets(layout: ParamLayout, segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """Element offsets of each layer segment in the step buffer (``num_params + 1``: the loss slot joins the last)."""
  out = [(layout.layer_offsets[i], layout.layer_offsets[j]) for i, j in segments]
  out[-1] = (out[-1][0], layout.num_params + 1)
  return out


def run(job: Job, workdir: str, comm) -> dict | None:
  """Runs the job on this rank; returns the summary on rank 0, None elsewhere.

  Raises:
    ConfigError: invalid settings, or ``job.resume`` (not supported for the all-reduce methods).
    fashion_mnist.DataError: missing or corrupt dataset files.
  """
  ctx = set_up(job, workdir, comm)  # ends with every rank's barrier and rank 0's W0 on every rank
  settings, spec, layout, partitions = job, ctx.spec, ctx.layout, ctx.partitions
  rank, steps, restricted, emulated = comm.Get_rank(), ctx.num_minibatches, ctx.restricted, ctx.task_times
  segments = allreduce.reduce_segments(partitions)

  n, m = settings.num_virtual_workers, settings.num_inflight
  vw_id = rank
  devices = rank_setup.stage_devices(settings, vw_id, None, restricted)
  reducer = MPIAllReducer(comm, segment_offsets(layout, segments))

  outputs = log = bar = None
  if rank == 0:
    outputs = ctx.start_outputs(ctx.config_json(), "[VW 0]")
    if job.run.progress:
      bar = progress_bar(steps, f"[{settings.method}] step", "step")
    evaluate = ctx.evaluator(devices[0]).evaluate
    log = ClockLog(outputs.log_metrics, evaluate, ctx.eval_every, job.run.log_every_waves, eval_before=steps,
                   name="[VW 0]", bar=bar)
    logging.info("[VW 0] %s: %d VWs x %d steps of %d micro-batches (all-reduce BSP over %d segments), model %s "
                 "with %d parameters", settings.method, n, steps, m, len(segments), spec.name, layout.num_params)
  t0 = [time.perf_counter()]

  def on_step(step: int, loss: float) -> None:
    if rank != 0:
      return
    log.losses.append(loss)
    if bar is not None:
      bar.update(1)
    log.tick(step + 1, (step + 1) * n, time.perf_counter() - t0[0], lambda: layout.flatten(vw.layer_params()))

  vw = vw_role.flush_vw(ctx, vw_id, devices, reducer, on_step,
                        task_time_s=emulated[vw_id].task_duration_s if emulated else None)
  stages = vw.stages
  logging.info("[VW %d] %d stages %s on %s, %d steps x %d micro-batches", vw_id, len(stages), partitions[vw_id],
               [str(d) for d in devices], steps, m)
  comm.Barrier()
  t0[0] = time.perf_counter()
  stats = vw.run(steps * m)
  comm.Barrier()
  wall = time.perf_counter() - t0[0]
  if bar is not None:
    bar.close()
  final_flat = layout.flatten(vw.layer_params())
  digest = weights_sha256(final_flat)
  report = {"records": [dict(r.__dict__) for r in vw.records], "stats": dict(stats.__dict__),
            "allreduce_s": reducer.seconds, "allreduce_calls": reducer.calls,
            "partition": [list(r) for r in partitions[vw_id]], "stage_devices": [d.id for d in devices],
            "trace_counts": {s.stage_id: dict(s.trace_counts) for s in stages},
            "tasks": vw.task_log if job.run.save_task_trace else [], "digest": digest}
  reports = comm.gather(report, root=0)
  logging.info("[VW %d] done: %.1f s, %.2f s in all-reduce", vw_id, stats.wall_time_s, reducer.seconds)
  if rank != 0:
    return None

  reports = dict(enumerate(reports))
  digests = {v: rep["digest"] for v, rep in sorted(reports.items())}
  final, lead_fields = finish_allreduce(
      ctx, outputs, log, evaluate, final_flat, digests, [r for v in sorted(reports) for r in reports[v]["records"]],
      wall, allreduce={"segments": [list(s) for s in segments], "steps": steps,
                       "seconds_per_vw": {str(v): rep["allreduce_s"] for v, rep in sorted(reports.items())}},
      write_trace=lambda: write_runtime_trace(reports, m, outputs.dir))
  keys = ("wait_s", "idle_s", "wall_time_s", "num_pulls", "num_pushes", "peak_inflight_per_stage",
          "max_concurrent_tasks", "num_tasks", "num_overruns", "overrun_s", "host_busy_s", "start_unix_s")
  per_vw = {str(v): {k: rep["stats"][k] for k in keys} | {"allreduce_s": rep["allreduce_s"],
                                                            "stage_devices": rep["stage_devices"]}
            for v, rep in sorted(reports.items())}
  total_mb = n * steps
  summary = Summary("mpi", allreduce_results(final, log.loss, steps, n, m),
                    rates("mpi", wall, total_mb, job.batch_size), settings_summary(job, partitions, spec), steps, {
      **lead_fields,
      "trace_counts": {str(v): rep["trace_counts"] for v, rep in sorted(reports.items())},
      "per_vw": per_vw,
      "wait_s": {v: s["wait_s"] for v, s in per_vw.items()},
      "idle_s": {v: s["idle_s"] for v, s in per_vw.items()},
  }).write(outputs)
  check_replicas_identical(digests, workdir)  # a non-zero exit
  logging.info("[VW 0] done: test accuracy %.4f, %d minibatches in %.1f s (%.1f images/s)", final["test_accuracy"],
               total_mb, wall, summary["images_per_s"])
  return summary
