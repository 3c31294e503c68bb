"""The VW role: one VW built, resumed and fed the same way whichever transport runs it (an MPI rank, or virtual time
with every VW in one process).

Runtime layer. :mod:`hetpipe_jax.jobs.mpi_job` (a VW's driver rank and its stage ranks),
:mod:`hetpipe_jax.jobs.allreduce_job` and :mod:`hetpipe_jax.jobs.virtual_job` build their
:class:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker` here; they differ only in the PS client or reducer (MPI
messages, or the simulated outbox), the placement of the stages and the host's emulated task times.
"""

from __future__ import annotations

from typing import Any, Callable

from hetpipe_jax.data import sharding
from hetpipe_jax.jobs import resume as resume_lib
from hetpipe_jax.jobs import training_setup
from hetpipe_jax.jobs.job import Job
from hetpipe_jax.jobs.run_context import RunContext
from hetpipe_jax.runtime import placement as placement_lib
from hetpipe_jax.runtime import update_rules
from hetpipe_jax.runtime import virtual_worker as vw_lib


def wsp_settings(job: Job, vw_id: int, pull_every_wave: bool = True) -> vw_lib.WSPSettings:
  """VW ``vw_id``'s :class:`~hetpipe_jax.runtime.virtual_worker.WSPSettings` (its index, N, Nm, D and pulls)."""
  return vw_lib.WSPSettings(vw_id, job.num_virtual_workers, job.num_inflight, job.staleness_bound, pull_every_wave)


def update_settings(job: Job, optimizer: Any, vw_id: int, num_minibatches: int = 0,
                    **options: Any) -> update_rules.UpdateSettings:
  """VW ``vw_id``'s :class:`~hetpipe_jax.runtime.update_rules.UpdateSettings`: the method, the optimizer and the
  update-rule options the job sets (``vertical_sync``, ``delay_compensation`` and ``dc_lambda``,
  ``weight_prediction`` with the optimizer's hyperparameters (its schedule over ``num_minibatches``),
  ``delay_scaled_lr`` and ``pipemare_warmup_minibatches``; the plan's memory caps as ``max_held``), plus ``options``
  (the flush methods' ``reducer`` and ``on_step``)."""
  optim = job.optim
  return update_rules.UpdateSettings(optimizer, job.method, vertical_sync=job.pipeline.vertical_sync,
                        delay_compensation=optim.delay_compensation,
                        dc_lambda=float(optim.dc_lambda),
                        weight_prediction=optim.weight_prediction,
                        optimizer_step=training_setup.optimizer_step(optim, num_minibatches),
                        delay_scaled_lr=optim.delay_scaled_lr,
                        pipemare_warmup_minibatches=optim.pipemare_warmup_minibatches,
                        max_held=job.memory_caps[vw_id] if job.memory_caps else None, **options)


def wsp_vw(ctx: RunContext, vw_id: int, devices: list, ps: Any, offsets: resume_lib.Offsets, *,
           ps_shards: Any = None, placement: Any = placement_lib.ALL_LOCAL,
           task_time_s: Callable[[Any], float] | None = None) -> vw_lib.VirtualWorker:
  """A parameter-server method's VW ``vw_id`` (hetpipe, pipedream) on ``devices``, resumed at the run's resume point.

  Args:
    ctx: the run (:func:`hetpipe_jax.jobs.run_context.set_up`); its start weights are the VW's.
    vw_id: the VW's index.
    devices: one per stage.
    ps: its PS client (MPI: :class:`hetpipe_jax.mpi.ps_client.MPIPSClient`; virtual time:
      :class:`hetpipe_jax.runtime.virtual_time.RecordingPSClient`).
    offsets: the run's offsets (:class:`hetpipe_jax.jobs.resume.Offsets`): minibatch p of a checkpoint segment
      trains the data's minibatch ``offsets.minibatch + p``; the NaN drill (``config.debug_nan_update``) counts
      waves from ``offsets.clock``.
    ps_shards: the PS shards' layout when there are several (pulls carry one vector clock per shard), else None.
    placement: :data:`~hetpipe_jax.runtime.placement.ALL_LOCAL`, or the stage ranks' ``LinkedStages``.
    task_time_s: emulated devices: a task's seconds (MPI wall time), else None.
  """
  job = ctx.job
  optimizer = ctx.optimizer()
  stages = ctx.stages(vw_id, devices, optimizer)
  get = ctx.minibatches(vw_id).get_with_ids
  vw = vw_lib.VirtualWorker(
      stages, ctx.layout, ctx.layout.unflatten(ctx.flat0), wsp_settings(job, vw_id, job.wsp.pull_every_wave),
      update_settings(job, optimizer, vw_id, ctx.num_minibatches),
      vw_lib.VWHooks(lambda p: get(offsets.minibatch + p), ps, ps_shards,
                     corrupt_update=resume_lib.nan_injector(job.run.debug_nan_update, vw_id, offsets)),
      placement, vw_lib.HostSettings(task_time_s=task_time_s))
  resume(vw, ctx.point, vw_id)
  return vw


def stage_rank_vw(ctx: RunContext, vw_id: int, devices: list, link: Any) -> vw_lib.VirtualWorker:
  """The side of VW ``vw_id`` that a stage rank runs (its stages over ``link``, commanded by the VW's driver; no
  data, no PS client of its own), resumed at the run's resume point."""
  optimizer = ctx.optimizer()
  vw = vw_lib.VirtualWorker(ctx.stages(vw_id, devices, optimizer), ctx.layout, ctx.layout.unflatten(ctx.flat0),
                            wsp_settings(ctx.job, vw_id), vw_lib.UpdateSettings(optimizer, ctx.job.method),
                            placement=placement_lib.LinkedStages(link))
  resume(vw, ctx.point, vw_id)
  return vw


def flush_vw(ctx: RunContext, vw_id: int, devices: list, reducer: Any,
             on_step: Callable[..., None] | None = None,
             task_time_s: Callable[[Any], float] | None = None) -> vw_lib.VirtualWorker:
  """A flush method's VW ``vw_id`` (gpipe, 1f1b_flush, horovod: one step of M micro-batches per minibatch, its
  gradients through ``reducer``, ``on_step`` after each step), starting from W0.

  Args:
    ctx: the run; devices: one per stage.
    reducer: the all-reduce (MPI: ``Allreduce`` per segment; virtual time: the simulated one).
    on_step: called after each step (MPI: ``(step, loss)``); None: nothing.
    task_time_s: emulated devices: a task's seconds, else None.
  """
  job = ctx.job
  m = job.num_inflight
  optimizer = ctx.optimizer()  # one optimizer step per training step
  stages = ctx.stages(vw_id, devices, optimizer, remat=job.pipeline.remat)
  micro = sharding.MicroBatches(ctx.minibatches(vw_id).get_with_ids, m)  # records carry each micro-batch's ids
  return vw_lib.VirtualWorker(stages, ctx.layout, ctx.layout.unflatten(ctx.flat0),
                              vw_lib.WSPSettings(vw_id, job.num_virtual_workers, m, job.staleness_bound),
                              vw_lib.UpdateSettings(optimizer, job.method, reducer=reducer, on_step=on_step),
                              vw_lib.VWHooks(micro.get), host=vw_lib.HostSettings(task_time_s=task_time_s))


def resume(vw: vw_lib.VirtualWorker, point: Any, vw_id: int) -> None:
  """Continues VW ``vw_id`` from the resume point ``point`` (its optimizer state and weight-version numbering; a new
  plan with more VWs numbers VW v as the checkpoint's VW v mod N); nothing when ``point`` is None."""
  if point is None:
    return
  vw.load_opt_state(*point.opt_states[vw_id])
  vw.set_version_id(point.meta["version_ids"][vw_id % len(point.meta["version_ids"])])
