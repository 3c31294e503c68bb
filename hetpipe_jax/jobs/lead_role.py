"""The lead role: what a run keeps and writes at its end, the same under MPI and in virtual time.

Jobs layer. The transports differ in how the training runs (MPI messages, or the engine driving in-process VWs) and
in their own summary fields; the lead's bookkeeping is here, once per synchronisation (the methods table's ``sync``):
- :class:`Lead`, the parameter-server methods (hetpipe, pipedream: the lead PS shard of
  :func:`hetpipe_jax.jobs.mpi_job.run`, or :func:`hetpipe_jax.jobs.virtual_job.run`): the minibatch records, the
  PS's ``(wave, vw)`` application order and each application's ``(tau, scale)`` over checkpoint segments (continued
  from a resume point), the training checkpoints at segment ends, and the run's end.
- :func:`finish_allreduce`, the all-reduce methods (gpipe, 1f1b_flush, horovod: rank 0 of
  :func:`hetpipe_jax.jobs.allreduce_job.run`, or virtual time): the run's end; no parameter server, no checkpoints.

Both ends evaluate the final weights, write the final metrics line, ``minibatches.jsonl``, the task trace when asked
and the final weights' checkpoint, and return the summary fields every transport writes.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from hetpipe_jax.jobs import resume as resume_lib
from hetpipe_jax.jobs.checkpoint import TrainingCheckpoints
from hetpipe_jax.jobs.outputs import RunOutputs
from hetpipe_jax.jobs.run_context import RunContext
from hetpipe_jax.runtime.clock_log import TIME_KEYS, ClockLog


class Lead:
  """The run's lead (module docstring): its logs over segments, checkpoints and final outputs.

  Args:
    ctx: the run's :class:`~hetpipe_jax.jobs.run_context.RunContext` (its resume point's logs are continued).
    log: the run's :class:`~hetpipe_jax.runtime.clock_log.ClockLog` (metrics lines and evaluations).
    config_json: ``config.json`` as written (a checkpoint keeps it).

  Attributes:
    records: the minibatch records (dicts, ``minibatches.jsonl``'s rows) of the run so far.
    applied: the lead PS's ``(wave, vw)`` applications, waves counted from the run's first clock.
    staleness: per application its ``(tau, scale)`` (:class:`hetpipe_jax.rules.wsp.ParameterServerState`).
    resumes: the run's resumes (this one included).
    store: the run's :class:`~hetpipe_jax.jobs.checkpoint.TrainingCheckpoints` (None: no checkpoints).
  """

  def __init__(self, ctx: RunContext, log: ClockLog, config_json: dict):
    self.ctx, self.log, self.config_json = ctx, log, config_json
    self.records, self.applied, self.staleness, self.resumes = ctx.resumed_logs()
    every = ctx.job.checkpoint
    self.store = TrainingCheckpoints(ctx.workdir, every.max_to_keep) if every.every_waves > 0 else None
    self._ckpt_stats: list[dict] = []

  def end_segment(self, first: int, state: Any) -> None:
    """Adds a segment's applications: ``state`` the PS's :class:`~hetpipe_jax.rules.wsp.ParameterServerState` of
    the segment that started at global clock ``first`` (its waves counted from there)."""
    self.applied += [(first + w, v) for w, v in state.applied]
    self.staleness += state.staleness

  def save(self, clock: int, flat: np.ndarray, opt_states: dict, *, time_s: float, version_ids: list,
           extra: dict) -> None:
    """The training checkpoint at global clock ``clock`` (:meth:`RunContext.save_checkpoint`, with this run's logs):
    ``flat`` the global weights there, float32 ``[num_params]``; ``opt_states`` per VW its stages' optimizer state by
    layer; ``time_s`` the run's time there (wall or simulated seconds); ``version_ids`` per VW its newest weight
    version's id; ``extra`` the transport's own fields (``mode`` and what its resume reads). The staleness log goes
    along as ``applied_staleness`` (:meth:`RunContext.resumed_logs` reads it back)."""
    self._ckpt_stats.append(self.ctx.save_checkpoint(
        self.store, clock, flat, opt_states, self.log, applied=self.applied, records=self.records, time_s=time_s,
        config_json=self.config_json, resumes=self.resumes, version_ids=version_ids,
        extra={**extra, "applied_staleness": self.staleness}))

  def close(self) -> None:
    """Closes the checkpoint store (waits for an asynchronous save); also after an error."""
    if self.store is not None:
      self.store.close()

  def finish(self, outputs: RunOutputs, evaluate: Callable[[np.ndarray], dict], flat: np.ndarray, clock: int,
             minibatches: int, time_s: float, *, shard_logs: list | None = None,
             write_trace: Callable[[], None] | None = None) -> tuple[dict, dict[str, Any]]:
    """The run's end: evaluates the final global weights ``flat`` (float32 ``[num_params]``), writes the final
    metrics line (at global clock ``clock``, ``minibatches`` in all, ``time_s``), ``minibatches.jsonl``,
    ``ps_applied.jsonl`` (``shard_logs``: per PS shard its application order, sharded PS only), the task trace
    (``write_trace``, when ``config.save_task_trace``) and the final weights' checkpoint.

    Returns:
      ``(final evaluation, the summary fields every transport writes)``: the application order's and the records'
      fields, ``evaluations``, ``checkpoint`` (the final weights' path) and the checkpoint segments' fields.
    """
    job = self.ctx.job
    final = evaluate(flat)
    self.log.line(clock, minibatches, time_s, final, final=True)
    record_fields = outputs.write_minibatches(self.records)
    applied_fields = outputs.write_ps_applied(self.applied, job.num_virtual_workers, shard_logs,
                                              job.ps.staleness_log(self.staleness))
    if job.run.save_task_trace and write_trace is not None:
      write_trace()
    ckpt = outputs.save_checkpoint(self.ctx.layout.unflatten(flat))
    return final, {**applied_fields, **record_fields, "evaluations": self.log.evals, "checkpoint": str(ckpt),
                   **resume_lib.checkpoint_summary(job.checkpoint, self._ckpt_stats, self.resumes)}


def finish_allreduce(ctx: RunContext, outputs: RunOutputs, log: ClockLog, evaluate: Callable[[np.ndarray], dict],
                     flat: np.ndarray, digests: dict[int, str], records: list[dict], time_s: float, *,
                     allreduce: dict[str, Any], write_trace: Callable[[], None] | None = None
                     ) -> tuple[dict, dict[str, Any]]:
  """The end of an all-reduce run (module docstring): evaluates the final weights ``flat`` (VW 0's, float32
  ``[num_params]``), writes the final metrics line (at global clock = steps, every VW's minibatches, ``time_s``: wall
  or simulated seconds as ``log`` keeps them), ``minibatches.jsonl`` (``records``: every VW's rows), the task trace
  (``write_trace``, when ``config.save_task_trace``) and the final weights' checkpoint.

  Args:
    digests: per VW :func:`hetpipe_jax.jobs.outputs.weights_sha256` of its final weights; the caller checks them
      (:func:`hetpipe_jax.jobs.outputs.check_replicas_identical`) after writing the summary.
    allreduce: the transport's ``allreduce`` summary fields; the replicas' digests are added to them.

  Returns:
    ``(final evaluation, the summary fields every transport writes)``.
  """
  job, steps = ctx.job, ctx.num_minibatches
  final = evaluate(flat)
  log.line(steps, steps * job.num_virtual_workers, time_s, final, final=True)
  record_fields = outputs.write_minibatches(records)
  if job.run.save_task_trace and write_trace is not None:
    write_trace()
  ckpt = outputs.save_checkpoint(ctx.layout.unflatten(flat))
  return final, {"allreduce": {**allreduce, "replicas_identical": len(set(digests.values())) == 1,
                               "replica_sha256": {str(v): d for v, d in sorted(digests.items())}},
                 **record_fields,
                 "evaluations": log.evals + [{"global_clock": steps, TIME_KEYS[log.simulated][0]: time_s, **final}],
                 "checkpoint": str(ckpt), "checkpoint_every_waves": job.checkpoint.every_waves}
