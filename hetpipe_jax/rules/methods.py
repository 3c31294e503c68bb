"""The training methods and their rules, once: per-stage task order, update rule and synchronisation across VWs.

Planning layer: pure Python. ``config.method`` (default ``"hetpipe"``) names one of :data:`METHODS`; the MPI runtime
(``runtime/virtual_worker``), the event engine (``sim/engine``), virtual time and the planner all read the method's
rules from here.

Within a virtual worker (the pipeline schedule) x across VWs (the synchronisation):

========== ================================================ ===================== ===========================
method     per-stage order                                  update                across VWs
========== ================================================ ===================== ===========================
hetpipe    FIFO among ready tasks, forwards and backwards   every stage, when a   WSP (parameter server)
           each in order, Nm minibatches in flight           minibatch completes
           (HetPipe §4)                                      (one version per mb)
pipedream  1F1B: stage s runs K_s = max(1, Nm - s) forwards  each stage after its  WSP (parameter server)
           then alternates backward / forward (PipeDream)    own backward (weight
                                                             stashing)
gpipe      per step of M micro-batches: all forwards, then  one update per step   all-reduce BSP (no PS)
           all backwards (GPipe)                             (flush), gradients
                                                             accumulated
1f1b_flush per step of M micro-batches: K_s = min(S - s, M)  as gpipe             all-reduce BSP (no PS)
           forwards, then 1F1B, then the remaining
           backwards (PipeDream-Flush / Megatron)
horovod    one stage (the whole model on one GPU), M         as gpipe             all-reduce BSP (no PS)
           micro-batches (gradient accumulation; M = 1)
fsdp       one stage (every GPU runs the whole model on its  one update per step,  sharded (ZeRO-3 / FSDP):
           share of the batch, its parameters gathered       each GPU on its own   per layer all-gather fwd
           layer by layer), M = 1                            shard of the state    and bwd, reduce-scatter
========== ================================================ ===================== ===========================

``fsdp`` (fully sharded data parallelism: ZeRO-3, PyTorch FSDP, ``jax.sharding`` over a data axis) is in the table
for the cost model (:mod:`hetpipe_jax.costs.fsdp_cost`), the engine and ``compare``; its runtime is one host's
``jax.sharding`` step (``experiments/fsdp_validate.py``), not the MPI / virtual-time harness (``hetpipe_jax.train``
trains :data:`HARNESS_METHODS`). In the engine it runs as ``horovod`` does (one-stage VWs, one per GPU, all-reduce
BSP: every step waits for the slowest GPU, then the step's collectives), with the collectives' exposed time in
place of the all-reduce.

The last stage always runs forward + backward of a (micro-)batch as one task (``FB``), so its order is ``FB0, FB1,
...`` under every method. For the static orders (every method but ``hetpipe``) a stage starts exactly the next task
of its order, once that task's input has arrived (:class:`StageOrder`, used by
:class:`hetpipe_jax.rules.schedule.PipelineRules`); ``hetpipe`` keeps its dynamic FIFO rule.

For the flush methods a *step* is M micro-batches (``num_inflight = M``; the rules' "minibatch" is a micro-batch and
a step plays the role of a wave): the step's M micro-batches are injected together once the previous step's update
is applied (:class:`hetpipe_jax.rules.allreduce.AllReduceSyncState`), the step ends when its last micro-batch
completes, its gradients are summed over the VWs by an all-reduce and every replica applies the same update.
"""

from __future__ import annotations

import dataclasses

from hetpipe_jax.rules.schedule import Task, TaskKind

METHODS = ("hetpipe", "pipedream", "gpipe", "1f1b_flush", "horovod", "fsdp")
ORDERS = ("fifo", "1f1b", "gpipe")


@dataclasses.dataclass(frozen=True)
class Method:
  """One method's rules (module docstring).

  Attributes:
    name: one of :data:`METHODS`.
    order: ``"fifo"`` (HetPipe's dynamic rule), ``"1f1b"`` or ``"gpipe"`` (static per-stage orders).
    update: ``"minibatch"`` (every stage when a minibatch completes), ``"stage"`` (each stage after its own
      backward) or ``"flush"`` (one update per step of M micro-batches, gradients accumulated).
    sync: ``"wsp"`` (parameter server, HetPipe §5) or ``"allreduce"`` (all-reduce BSP, no PS).
    flush_window: the static order restarts every step of M micro-batches (gpipe, 1f1b_flush, horovod); False: one
      window over the whole run (pipedream).
    single_stage: every VW is one GPU running the whole model (horovod, fsdp).
    sharded: parameters, gradients and optimizer state are sharded over the GPUs (fsdp); not run by the MPI /
      virtual-time harness (:data:`HARNESS_METHODS`).
    config_defaults: ``(config field, default)`` pairs the method changes from the job's defaults without a plan
      (horovod: the whole model on one GPU, one micro-batch per step; pipedream: ``num_inflight`` None, i.e. the
      number of stages, PipeDream's NOAM).
    sharded_ps: a WSP method that runs with sharded parameter servers (pipedream's per-stage updates: not yet).
    planner: the planner recipe that plans it (``hetpipe_jax.planning.planner.RECIPES``: ``"hetpipe"`` allocation
      search and Nm, ``"pipedream"`` NOAM, ``"flush"`` best M, ``"horovod"`` one-stage VWs, ``"sharded"`` no plan
      file: ``hetpipe_jax.costs.fsdp_cost``).
    inflight_name: what ``num_inflight`` counts: ``"Nm"`` minibatches in flight or ``"M"`` micro-batches per step.
    weight_copies: weight versions a non-last stage keeps besides its own (memory model, ``CostModelConfig
      .weight_versions``): ``"inflight"`` one per minibatch in flight (HetPipe), ``"held"`` one per minibatch it
      holds (PipeDream's stashing), ``"none"`` (flush: one version per step).
    remat: ``CostModelConfig.remat`` applies (flush methods: a held micro-batch keeps only its input).
    schedule_peaks: its held counts may be the engine's schedule peaks (``inflight_memory="schedule"``, enforced as
      per-stage memory caps by ``schedule.PipelineRules``): the FIFO rule, whose closed form is only a bound.

  The runtime names each ``update`` value's class (``hetpipe_jax.runtime.virtual_worker.UPDATE_RULES``: per-minibatch,
  per-stage, flush), as torch pipelining's ``get_schedule_class`` names a schedule's, and each ``sync`` value's job;
  the layers above look the other fields up the same way: ``planner`` in ``planning.planner.RECIPES``, ``sync`` in
  ``sim.engine.SYNCS`` (sync states, all-reduce), ``planning.plan_times`` (task times), ``planning.compare.SYNCS``
  (bottleneck share, waves) and the plan table's totals. A new method is a row here (plus a recipe or a class
  only where it brings a new one).
  """

  name: str
  order: str
  update: str
  sync: str
  flush_window: bool
  single_stage: bool = False
  sharded: bool = False
  config_defaults: tuple[tuple[str, int | None], ...] = ()
  sharded_ps: bool = True
  planner: str = "hetpipe"
  inflight_name: str = "Nm"
  weight_copies: str = "inflight"
  remat: bool = False
  schedule_peaks: bool = False

  @property
  def uses_ps(self) -> bool:
    return self.sync == "wsp"

  @property
  def is_flush(self) -> bool:
    return self.update == "flush"


_FLUSH = dict(flush_window=True, inflight_name="M", weight_copies="none", remat=True)
_TABLE = {
    "hetpipe": Method("hetpipe", "fifo", "minibatch", "wsp", flush_window=False, schedule_peaks=True),
    "pipedream": Method("pipedream", "1f1b", "stage", "wsp", flush_window=False,
                        config_defaults=(("num_inflight", None),), sharded_ps=False, planner="pipedream",
                        weight_copies="held"),
    "gpipe": Method("gpipe", "gpipe", "flush", "allreduce", planner="flush", **_FLUSH),
    "1f1b_flush": Method("1f1b_flush", "1f1b", "flush", "allreduce", planner="flush", **_FLUSH),
    "horovod": Method("horovod", "gpipe", "flush", "allreduce", single_stage=True,
                      config_defaults=(("num_stages", 1), ("num_inflight", 1)), planner="horovod", **_FLUSH),
    "fsdp": Method("fsdp", "gpipe", "flush", "allreduce", single_stage=True, sharded=True, planner="sharded",
                   **_FLUSH),
}
# The methods ``hetpipe_jax.train`` runs (MPI and virtual time); fsdp's runtime is experiments/fsdp_validate.py.
HARNESS_METHODS = tuple(m for m in METHODS if not _TABLE[m].sharded)
PS_METHODS = tuple(m for m in METHODS if _TABLE[m].uses_ps)  # WSP across VWs through a parameter server
FLUSH_METHODS = tuple(m for m in METHODS if _TABLE[m].is_flush)  # one update per step of M micro-batches


def get_method(name: str) -> Method:
  """The rules of method ``name``.

  Raises:
    ValueError: unknown name (the message lists the methods).
  """
  try:
    return _TABLE[name]
  except KeyError:
    raise ValueError(f"unknown method {name!r}: use one of {list(METHODS)}") from None


def minibatches_per_wave(method: Method, num_inflight: int) -> int:
  """Minibatches per wave: Nm (WSP methods), or 1 for the flush methods (a step is one minibatch of M
  micro-batches)."""
  return 1 if method.is_flush else num_inflight


def micro_batches_per_minibatch(method: Method, num_inflight: int) -> int:
  """The tasks' (micro-)batches per minibatch: M = ``num_inflight`` for the flush methods (each minibatch is split),
  else 1."""
  return num_inflight if method.is_flush else 1


def num_ps_ranks(method: Method, num_ps_shards: int) -> int:
  """MPI ranks of parameter servers: the shards (WSP methods), none (all-reduce methods)."""
  return num_ps_shards if method.uses_ps else 0


def forwards_before_first_backward(method: Method, num_stages: int, num_inflight: int, stage_id: int,
                                   window: int) -> int:
  """K_s: forwards a non-last stage runs before its first backward within a window of ``window`` micro-batches.

  ``gpipe``: every forward of the step (K = M). ``1f1b`` with a flush (PipeDream-Flush, Megatron): ``S - s`` (the
  warm-up ``S - s - 1`` plus the first steady forward), at most M. ``1f1b`` without a flush (PipeDream): stage s
  keeps ``Nm - s`` minibatches in flight (PipeDream's NOAM = S gives ``S - s``), at least 1. Always in ``[1, window]``.
  """
  if method.order == "gpipe":
    k = window
  elif method.flush_window:
    k = num_stages - stage_id
  else:
    k = num_inflight - stage_id
  return max(1, min(k, window))


class StageOrder:
  """The static order of tasks on every stage of one VW (every method but ``hetpipe``).

  Args:
    method: the method (its ``order`` must not be ``"fifo"``).
    num_stages: S.
    num_inflight: M (flush methods: micro-batches per step) or Nm (pipedream).
    num_minibatches: (micro-)batches of the run (a multiple of M for the flush methods).

  :meth:`task` gives the i-th task of a stage; ``None`` past the run's last.
  """

  def __init__(self, method: Method, num_stages: int, num_inflight: int, num_minibatches: int):
    if method.order == "fifo":
      raise ValueError(f"method {method.name!r} has no static stage order")
    if method.flush_window and num_minibatches % num_inflight:
      raise ValueError(f"method {method.name!r}: {num_minibatches} micro-batches are not whole steps of "
                       f"M={num_inflight}")
    self.num_stages = num_stages
    self.num_minibatches = num_minibatches
    self.window = num_inflight if method.flush_window else num_minibatches
    self._k = [forwards_before_first_backward(method, num_stages, num_inflight, s, self.window)
               for s in range(num_stages)]

  def warmup(self, stage_id: int) -> int:
    """K_s of stage ``stage_id`` (:func:`forwards_before_first_backward`)."""
    return self._k[stage_id]

  def task(self, stage_id: int, index: int) -> Task | None:
    """The ``index``-th task (0-based) stage ``stage_id`` runs, or None when the stage has no more."""
    w = self.window
    if stage_id == self.num_stages - 1:
      return Task(stage_id, TaskKind.FORWARD_BACKWARD, index) if index < self.num_minibatches else None
    step, i = divmod(index, 2 * w)
    base = step * w
    if base >= self.num_minibatches:
      return None
    k = self._k[stage_id]
    if i < k:
      return Task(stage_id, TaskKind.FORWARD, base + i)
    if i < 2 * w - k:
      j = i - k
      if j % 2 == 0:
        return Task(stage_id, TaskKind.BACKWARD, base + j // 2)
      return Task(stage_id, TaskKind.FORWARD, base + k + j // 2)
    return Task(stage_id, TaskKind.BACKWARD, base + i - w)

  def stage_tasks(self, stage_id: int) -> list[Task]:
    """Every task of a stage, in order (for tests and traces)."""
    out, i = [], 0
    while (t := self.task(stage_id, i)) is not None:
      out.append(t)
      i += 1
    return out


def stage_order(method: Method, num_stages: int, num_inflight: int, num_minibatches: int) -> StageOrder | None:
  """The VW's :class:`StageOrder`, or None for ``hetpipe`` (its FIFO rule needs none)."""
  if method.order == "fifo":
    return None
  return StageOrder(method, num_stages, num_inflight, num_minibatches)


def max_held_per_stage(method: Method, num_stages: int, num_inflight: int) -> list[int]:
  """Most (micro-)batches each stage holds at once (forward done, backward not) under the method's order.

  ``hetpipe``: Nm on every non-last stage (:func:`hetpipe_jax.costs.cost_model.max_inflight_per_stage`, the safe
  bound of the FIFO rule). Static orders: K_s on stage s (it starts forward ``p + K_s`` only after backward p);
  the last stage holds 1 (its FB task).
  """
  if num_stages == 1:
    return [1]
  if method.order == "fifo":
    return [num_inflight] * (num_stages - 1) + [1]
  window = num_inflight
  return [forwards_before_first_backward(method, num_stages, num_inflight, s, window)
          for s in range(num_stages - 1)] + [1]
