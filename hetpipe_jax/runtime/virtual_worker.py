"""A virtual worker: host-side scheduler driving pipelined model parallelism over its stages (HetPipe §4–§5).

Runtime layer. One :class:`VirtualWorker` per VW. It keeps per-stage FIFO ready queues through the pure rules of
:mod:`hetpipe_jax.rules.schedule`, hands each ready task to its stage's in-order executor thread
(:mod:`hetpipe_jax.runtime.stage_executor`), which dispatches it to the stage's device (JAX async dispatch; explicit
``device_put`` of the output to the consumer's device) and reports when the output has arrived, and injects new
minibatches under the local rule (Nm in flight) and the WSP rule of :mod:`hetpipe_jax.rules.wsp`
(:func:`~hetpipe_jax.rules.wsp.injection_step`).

Two parts: the *driver* :meth:`VirtualWorker.run` (the MPI runtime's event loop) makes every rule decision through
:mod:`hetpipe_jax.rules.schedule` and :mod:`hetpipe_jax.rules.wsp` and is the one caller of the VW's
:class:`~hetpipe_jax.rules.wsp.VWSyncState` transitions; the *actions* :meth:`~VirtualWorker.inject`,
:meth:`~VirtualWorker.dispatch`, :meth:`~VirtualWorker.complete_minibatch`, :meth:`~VirtualWorker.end_wave` and
:meth:`~VirtualWorker.install_pull` carry the decisions out on real tensors and never advance ``sync`` (they only
read it). In virtual time the event engine is the driver instead: it advances the VW's ``sync`` (the same object)
and calls the actions from its hooks (:mod:`hetpipe_jax.runtime.virtual_time`).

Weight versions: minibatch p is injected with the VW's current :class:`WeightVersion` (immutable per-stage params
on each stage's device) and uses it on every stage; the weights change only when a minibatch completes, on all
stages together, or when pulled global weights are installed. Old versions are freed by reference counting once no
in-flight minibatch holds them.

Methods (``method``, :mod:`hetpipe_jax.rules.methods`): the pipeline rules take the method's static stage order. The
flush methods (gpipe, 1f1b_flush, horovod) work in micro-batches (``num_inflight`` = M per step): a completed
micro-batch's gradients are added to the stage's accumulator (:meth:`complete_minibatch`); at the step's end
(:meth:`end_wave`) the accumulated gradients and the step's loss sum go, as one float32 buffer in layer order, to the
``reducer`` (MPI: ``Allreduce`` per reduction segment; virtual time: held until the engine's all-reduce), and
:meth:`apply_reduced` applies the mean gradient over the N VWs' M micro-batches on every stage (one new version per
step; every replica applies the same update, so replicas stay identical).

PipeDream (``method="pipedream"``, per-stage updates): each stage keeps its own latest weights; a forward uses them
(or, with ``vertical_sync``, the stage's weights after as many own updates as stage 0's forward of that minibatch
used) and its VJP closure stashes them for the backward (weight stashing); right after its backward (FB on the last
stage) the stage applies its own optimizer step, adding the delta to that minibatch's wave accumulator. Records
carry the per-stage versions (``stage_versions``). At a wave end the VW pushes every stage's wave delta, and a pull
rebases every stage (global + own waves the PS lacks + deltas not pushed yet), under a per-stage lock because the
stage executors update concurrently.

Stage ranks (``link`` / ``remote``, :mod:`hetpipe_jax.runtime.stage_ranks`): some of the VW's stages run on other MPI
ranks. The driver's object holds its local stages only (``local_stages``; the others' entries in versions, optimizer
states and deltas are None) and still makes every decision in :meth:`run`: a remote stage's executor sends its rank
"start task X at version V" (:meth:`dispatch` of a remote stage's task sends that command), and each action also
sends the remote stages its version change (``remote``: inject, a minibatch's update, the pull to install, a wave
end). A stage rank holds the same object over its own stages and applies those changes in the same order
(:class:`hetpipe_jax.runtime.stage_ranks.StageRankServer`), pushing its stages' parts of each wave to the PS shards
and taking its parts of each pull from them itself; the driver pushes and pulls its own stages' parts only. Between stages of different
ranks :meth:`dispatch` sends and receives activations and gradients through ``link``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import queue
import threading
import time
import types
from typing import Any, Callable, Protocol, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetpipe_jax.rules import allreduce
from hetpipe_jax.rules import methods
from hetpipe_jax.rules import schedule
from hetpipe_jax.rules import wsp
from hetpipe_jax.rules.records import MinibatchRecord, ShardedMinibatchRecord
from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.ps.shards import rebase_on_shards
from hetpipe_jax.runtime.param_layout import ParamLayout
from hetpipe_jax.runtime.stage_executor import OVERRUN_TOLERANCE_S, StageExecutor, clock_pair
from hetpipe_jax.runtime.stages import Stage


def _host_copy(tree):
  """Copies host arrays before ``device_put``: on the CPU backend a device array may alias the numpy buffer it came
  from, and the buffers weights come from (the PS's global weights) change in place while computations that read
  them may still be running asynchronously."""
  return jax.tree.map(lambda a: np.array(a, copy=True), tree)


class PSClient(Protocol):
  """What a VW needs from the parameter server (in-process or over MPI)."""

  def push(self, wave_id: int, flat_delta: np.ndarray, loss_sum: float, num_minibatches: int) -> None:
    """Sends wave ``wave_id``'s aggregated update (float32 ``[num_params]``)."""

  def request_pull(self, required_clock: int) -> None:
    """Asks for the global weights once the global clock is >= ``required_clock``."""

  def poll_pull(self) -> tuple[tuple[int, ...], np.ndarray] | None:
    """Non-blocking: ``(vector clock, float32 [num_params])`` if a pull reply arrived, else None.

    The vector clock has one entry per VW (how many of its waves the weights hold); its minimum is the global
    clock.
    """


@dataclasses.dataclass(frozen=True)
class WeightVersion:
  """One consistent version of a VW's weights.

  Attributes:
    params: per stage, that stage's per-layer params on its device.
    local_updates: how many of this VW's own minibatch updates it includes (minibatches ``0..local_updates-1``).
    vector_clock: per VW, how many of its waves the last pulled global weights hold (HetPipe §5; entries above
      the minimum are extra updates, under ``ps_apply="on_receipt"``).
    version_id: increments on every change.
  """

  params: tuple
  local_updates: int
  vector_clock: tuple[int, ...]
  version_id: int
  shard_vector_clocks: tuple[tuple[int, ...], ...] | None = None  # sharded PS: per shard, its slice's vector clock

  @property
  def global_clock(self) -> int:
    """The guaranteed global clock: every VW's waves ``0..global_clock-1`` are included."""
    return min(self.vector_clock)


@dataclasses.dataclass
class VWStats:
  """Per-VW timing: seconds waiting for the PS (WSP bound) and seconds with no runnable task."""

  wait_s: float = 0.0
  idle_s: float = 0.0
  wall_time_s: float = 0.0
  start_unix_s: float = 0.0  # the run's start on the machine clock (record times are relative to it)
  num_pulls: int = 0
  num_pushes: int = 0
  peak_inflight_per_stage: list[int] = dataclasses.field(default_factory=list)
  max_concurrent_tasks: int = 0
  num_tasks: int = 0
  host_busy_s: float = 0.0  # scheduler thread's time not blocked waiting for completions
  update_s: float = 0.0  # ... of which applying minibatch updates and pushing waves (weights' compute/transfers)
  sync_s: float = 0.0  # ... of which installing pulled global weights
  inject_s: float = 0.0  # ... of which reading minibatches and placing them on stage devices
  dispatch_s: float = 0.0  # stage executors' time inside task dispatch calls
  executor_book_s: float = 0.0  # stage executors' time booking their completions and starting what they made ready
  num_overruns: int = 0  # emulated tasks whose real work outlasted their target duration
  overrun_s: float = 0.0


@dataclasses.dataclass
class InFlightMinibatch:
  version: WeightVersion
  images: jax.Array
  labels: jax.Array
  activations: dict  # stage -> input activation on that stage's device
  residuals: dict  # stage -> vjp closure
  grad_in: dict  # stage -> gradient arriving from stage + 1
  grads: dict  # stage -> param grads
  loss: Any = None
  record: MinibatchRecord | None = None


class VirtualWorker:
  """Runs one VW's pipeline for a fixed number of minibatches.

  Args:
    vw_id: 0-based VW index.
    stages: built by :func:`hetpipe_jax.runtime.stages.build_stages`.
    layout: flat weight layout shared with the PS.
    initial_layer_params: per-layer host params (the global initial weights W0).
    optimizer: optax transformation (each stage keeps its own state on its device).
    num_inflight: Nm >= 1.
    staleness_bound: D >= 0.
    ps: the parameter-server client.
    get_minibatch: ``minibatch_id -> (images [b, ...] float32, labels [b] int32)`` numpy arrays.
    num_virtual_workers: N, the length of the pulled weights' vector clocks.
    pull_every_wave: also pull (without waiting) at every wave end; False pulls only when the bound forces it.
    poll_interval_s: the longest the scheduler blocks waiting for a completion before polling the PS again.
    on_minibatch: optional callback ``(MinibatchRecord) -> None`` for each completed minibatch, called at its
      wave's end (when the wave's losses are read back).
    task_time_s: emulated devices: ``Task -> seconds`` the task should take on the GPU its stage stands in for
      (compute + sending its output). A task is then observed done no earlier than its emulated start
      (``max(dispatch, previous emulated end on the stage)``) plus that duration, so the VW runs like the mixed
      cluster in wall time; real work that takes longer is counted in ``VWStats.num_overruns`` / ``overrun_s``.
    corrupt_update: fault drills only: ``(wave_id, flat update) -> None`` may alter a wave's update before it is
      pushed (``config.debug_nan_update`` puts a NaN in one, which the PS must refuse).
    ps_shards: sharded parameter servers (:class:`hetpipe_jax.ps.shards.ShardLayout`): pulls then carry one vector
      clock per shard and the VW re-adds its own waves shard by shard; None: one PS.
    method: the training method (:mod:`hetpipe_jax.rules.methods`; module docstring).
    reducer: flush methods: ``(step, buffer) -> summed buffer | None``; ``buffer`` is float32 ``[num_params + 1]``
      (the accumulated gradients in layer order, then the step's loss sum); a returned sum over every VW is applied
      at once (MPI), None means the caller applies it later with :meth:`apply_reduced` (virtual time).
    on_step: flush methods: ``(step, mean loss over every VW's micro-batches) -> None`` after each applied step.
    vertical_sync: pipedream: every stage uses, for a minibatch, its weights after as many own updates as stage 0
      used for it (PipeDream's vertical sync); False: each stage's latest weights.
    max_held: hetpipe: per stage, the most minibatches it may hold (the memory caps of
      :class:`hetpipe_jax.rules.schedule.PipelineRules`; a ``schedule`` plan's ``held_per_stage``); None: none.
    link: stage ranks: the :class:`hetpipe_jax.runtime.stage_ranks.StageLink` of this rank (which stages are local,
      activations and gradients to and from stages on other ranks); None: every stage is local.
    remote: stage ranks, on the driver: the :class:`hetpipe_jax.runtime.stage_ranks.RemoteStages` its actions send
      their version changes and remote tasks to; None on a stage rank and without stage ranks.

  Raises:
    ValueError: ``num_inflight < 1``, ``staleness_bound < 0``, or ``vw_id`` not in ``[0, num_virtual_workers)``.
  """

  def __init__(self, vw_id: int, stages: Sequence[Stage], layout: ParamLayout, initial_layer_params: Sequence[Any],
               optimizer: optax.GradientTransformation, num_inflight: int, staleness_bound: int, ps: PSClient,
               get_minibatch: Callable[[int], tuple[np.ndarray, np.ndarray]], *, num_virtual_workers: int,
               pull_every_wave: bool = True,
               poll_interval_s: float = 1e-3, on_minibatch: Callable[[MinibatchRecord], None] | None = None,
               task_time_s: Callable[[Task], float] | None = None,
               corrupt_update: Callable[[int, np.ndarray], None] | None = None, ps_shards: Any = None,
               method: str = "hetpipe",
               reducer: Callable[[int, np.ndarray], np.ndarray | None] | None = None,
               on_step: Callable[[int, float], None] | None = None,
               vertical_sync: bool = False, max_held: Sequence[int] | None = None, link: Any = None,
               remote: Any = None):
    self.method = methods.get_method(method)
    if max_held is not None and self.method.name != "hetpipe":
      raise ValueError(f"max_held (memory caps) is a HetPipe rule, not {method!r}'s")
    self.max_held = schedule.check_max_held(max_held, len(stages))
    self.sync = self._new_sync(num_inflight, staleness_bound, pull_every_wave)  # validates Nm and D
    if self.method.is_flush and reducer is None:
      raise ValueError(f"method {method!r} needs a reducer (the all-reduce across VWs)")
    self.reducer = reducer
    self.on_step = on_step
    if vertical_sync and self.method.update != "stage":
      raise ValueError(f"vertical_sync is a PipeDream setting, not {method!r}'s")
    self.vertical_sync = vertical_sync
    if not 0 <= vw_id < num_virtual_workers:
      raise ValueError(f"vw_id={vw_id} must be in [0, num_virtual_workers={num_virtual_workers})")
    self.num_virtual_workers = num_virtual_workers
    self.vw_id = vw_id
    self.stages = list(stages)
    if (link is not None or remote is not None) and self.method.name != "hetpipe":
      raise ValueError(f"stage ranks run HetPipe's pipeline, not {method!r}")
    self.link = link
    self.remote = remote
    # the stages this process runs (stage ranks: the others' entries below are None)
    self.local_stages = [s for s in range(len(self.stages)) if link is None or link.is_local(s)]
    self.layout = layout
    self.num_inflight = num_inflight
    self.staleness_bound = staleness_bound
    self.ps = ps
    self.get_minibatch = get_minibatch
    self.poll_interval_s = poll_interval_s
    self.on_minibatch = on_minibatch
    self.task_time_s = task_time_s
    self.corrupt_update = corrupt_update
    self.ps_shards = ps_shards
    self.own_flat: dict[int, np.ndarray] = {}  # sharded PS: wave -> host copy of the own wave's flat update
    self.optimizer = optimizer
    local = set(self.local_stages)
    params = tuple(self._place_stage(initial_layer_params, st) if s in local else None
                   for s, st in enumerate(self.stages))
    # Constant outputs (Adam's step count, zeros) are not committed by jit: place them explicitly.
    self.opt_states = [jax.device_put(jax.jit(optimizer.init)(p), st.device) if p is not None else None
                       for st, p in zip(self.stages, params)]
    self._zeros = [jax.device_put(jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t))(p), st.device)
                   if p is not None else None for st, p in zip(self.stages, params)]
    # Compile the update and the rebase now, not at the first completion / pull (a stall inside wave 1).
    jax.block_until_ready([(st.update(p, o, z, z), st.add(p, z))
                           for st, p, o, z in zip(self.stages, params, self.opt_states, self._zeros) if p is not None])
    # Flush methods: per stage, on its device, the micro-batches a reduced step sums (N x M: apply_mean's divisor);
    # the flush step's ravel and mean update compile now too.
    self._divisors = None
    if self.method.is_flush:
      self._divisors = jax.device_put([np.float32(num_virtual_workers * num_inflight)] * len(self.stages),
                                      [st.device for st in self.stages])
      jax.block_until_ready([st.apply_mean(p, o, st.ravel(z), d)
                             for st, p, o, z, d in zip(self.stages, params, self.opt_states, self._zeros,
                                                       self._divisors)])
    self.version = WeightVersion(params, 0, (0,) * num_virtual_workers, 0)
    self.wave_delta = list(self._zeros)
    self.grad_acc = list(self._zeros)  # flush methods: the step's accumulated gradients per stage
    self._init_stage_state()
    self.own_waves: dict[int, list] = {}  # wave -> per-stage delta, own waves not yet in pulled global weights
    self.records: list[MinibatchRecord] = []
    # (task, start, end) in seconds since the run's start: the span on the emulated device when emulated, else from
    # the dispatch to the posted completion
    self.task_log: list[tuple[str, float, float]] = []
    self.stats = VWStats()
    self._wave_losses: list = []  # (record, loss array) of the current wave
    self._prefetched: dict[int, tuple] = {}  # minibatch -> its data, read ahead of its injection (prefetch)
    # Flush methods: per stage, its accumulated gradients of the current step on the host, float32 [its params]
    # (written by the stage's executor after its last backward of the step; read at the flush).
    self._step_flat: list = [None] * len(self.stages)

  def _init_stage_state(self, updates: list[int] | None = None) -> None:
    """PipeDream: per-stage latest weights, own-update counts, per-wave deltas, version history and locks."""
    import threading  # pylint: disable=g-import-not-at-top
    n = len(self.stages)
    self.stage_params = list(self.version.params)
    self.stage_updates = list(updates) if updates is not None else [0] * n
    self.stage_wave_delta: list[dict[int, Any]] = [{} for _ in range(n)]
    self.stage_history: list[dict[int, Any]] = ([{k: p} for k, p in zip(self.stage_updates, self.stage_params)]
                                                if self.vertical_sync else [])
    self.stage_locks = [threading.Lock() for _ in range(n)]

  def _stage_update(self, s: int, mb: "InFlightMinibatch", grads) -> None:
    """PipeDream: stage ``s`` applies its own optimizer step for ``mb`` (on its executor thread)."""
    st = self.stages[s]
    wave = mb.record.wave_id  # the segment's wave (the job shifts records after the run)
    with self.stage_locks[s]:
      acc = self.stage_wave_delta[s].get(wave, self._zeros[s])
      p, o, d = st.update(self.stage_params[s], self.opt_states[s], grads, acc)
      self.stage_params[s] = p
      self.opt_states[s] = o
      self.stage_wave_delta[s][wave] = d
      self.stage_updates[s] += 1
      if self.vertical_sync:
        self.stage_history[s][self.stage_updates[s]] = p

  def _stage_forward_params(self, s: int, mb: "InFlightMinibatch"):
    """PipeDream: the weights stage ``s``'s forward of ``mb`` uses (recorded in ``stage_versions``)."""
    with self.stage_locks[s]:
      if self.vertical_sync and s > 0:
        k = mb.record.stage_versions[0]
        params = self.stage_history[s][k]
      else:
        k = self.stage_updates[s]
        params = self.stage_params[s]
    mb.record.stage_versions[s] = k
    return params

  def _new_sync(self, num_inflight: int, staleness_bound: int, pull_every_wave: bool):
    if self.method.sync == "allreduce":
      if staleness_bound < 0:
        raise ValueError(f"staleness_bound must be >= 0, got {staleness_bound}")
      return allreduce.AllReduceSyncState(num_inflight)
    return wsp.VWSyncState(num_inflight, staleness_bound, pull_every_wave)

  # ---------------------------------------------------------------- placement helpers
  def _place_stage(self, layer_params: Sequence[Any], st: Stage):
    start, end = st.layer_range
    return jax.device_put(_host_copy(list(layer_params[start:end])), st.device)

  def _new_version(self, params, *, local_updates=None, vector_clock=None,
                   shard_vector_clocks=None) -> WeightVersion:
    v = self.version
    return WeightVersion(tuple(params), v.local_updates if local_updates is None else local_updates,
                         v.vector_clock if vector_clock is None else tuple(vector_clock), v.version_id + 1,
                         v.shard_vector_clocks if vector_clock is None else shard_vector_clocks)

  # ---------------------------------------------------------------- main loop
  def run(self, num_minibatches: int, *, completion_log: list | None = None) -> VWStats:
    """Trains ``num_minibatches`` (a multiple of Nm, so every wave is whole) and returns the VW's stats.

    Each loop iteration takes the posted completions off the queue, hands the tasks they made ready to the stage
    executors, and only then applies the completed minibatches' updates, pushes wave ends and injects: the updates
    (on the CPU backend they compute inline, in this thread) never delay a ready task, and a new minibatch still
    starts on the weights that include every completed minibatch. The garbage collector leaves the objects created
    before the run alone until it returns (``gc.freeze``), so its collections stay short.

    Args:
      num_minibatches: minibatches to train.
      completion_log: instrumentation (benchmarks): when given, ``(completion, received_s, woke)`` is appended for
        every task: its :class:`~hetpipe_jax.runtime.stage_executor.Completion`, when this thread took it off the
        queue (seconds since the run's start), and whether it woke this thread from waiting (else it had been
        queued while this thread was busy).

    Raises:
      ValueError: ``num_minibatches`` is not a positive multiple of Nm.
      FloatingPointError: a loss is NaN or Inf.
    """
    if num_minibatches <= 0 or num_minibatches % self.num_inflight:
      raise ValueError(f"num_minibatches={num_minibatches} must be a positive multiple of num_inflight="
                       f"{self.num_inflight} (whole waves)")
    num_stages = len(self.stages)
    rules = schedule.PipelineRules(num_stages, self.num_inflight,
                                   methods.stage_order(self.method, num_stages, self.num_inflight, num_minibatches),
                                   max_held=self.max_held)
    inflight: dict[int, InFlightMinibatch] = {}
    done: queue.SimpleQueue = queue.SimpleQueue()  # to this thread: minibatch ends, remote completions, errors
    # The rules, ``inflight`` and ``num_running`` are shared by this thread and the local stages' executors, which
    # book their own completions (see ``post``): every access to them holds this lock.
    lock = threading.Lock()
    stats = self.stats
    # The objects that exist before the run (modules, compiled functions, data: over 100,000) stay out of the
    # collections during it: a full collection over them holds the GIL, so it stops every stage thread, for
    # 0.1-0.3 s on this machine (scripts/bench_runtime.py reports the collections during its runs).
    gc.freeze()
    self._prefetched.clear()  # minibatch ids are the run's (a segment's run starts at 0 again)
    t0, stats.start_unix_s = clock_pair()  # the run's clock, which stage ranks share
    if self.remote is not None:  # stage ranks: they start their executors on the same clock
      self.remote.begin_run(done, t0, stats.start_unix_s, num_minibatches)
    num_running = 0
    num_finished = 0  # minibatches whose completion this thread has processed (update, wave end)
    first = None
    wait_since = idle_since = None

    def submit_ready() -> None:
      """Hands every ready task to its stage's executor, FIFO per stage (caller holds ``lock``). A stage stops at a
      task whose minibatch is injected but not yet placed on the devices (this thread is still reading it)."""
      nonlocal num_running
      for s in range(num_stages):
        while True:
          task = rules.peek_ready(s)
          if task is None:
            break
          mb = inflight.get(task.minibatch_id)
          if mb is None:
            break
          rules.pop_ready(s)
          duration = self.task_time_s(task) if self.task_time_s is not None else None
          executors[s].submit(task, functools.partial(self.dispatch, task, mb), duration)
          num_running += 1

    def book(c, woke: bool) -> bool:
      """Books completion ``c`` in the rules, logs and stats (caller holds ``lock``); True when it completes its
      minibatch (this thread then applies the update)."""
      nonlocal num_running
      if completion_log is not None:
        completion_log.append((c, time.perf_counter() - t0, woke))
      num_running -= 1
      if c.loss is not None:  # a remote last stage's loss, reported with its FB task
        inflight[c.task.minibatch_id].loss = c.loss
      self.task_log.append((str(c.task), c.start_s, c.device_end_s))
      if c.overrun_s > OVERRUN_TOLERANCE_S:
        stats.num_overruns += 1
        stats.overrun_s += c.overrun_s
      rules.complete(c.task)
      stats.num_tasks += 1
      stats.dispatch_s += c.dispatch_s
      return schedule.completes_minibatch(c.task)

    # Per stage, its completions posted to this thread and not yet booked: a stage's completions are booked in its
    # order, so while one waits here the stage's later ones follow it.
    routed = [0] * num_stages

    def post(c) -> None:
      """Where the local stages' executors post completions: a task that does not complete its minibatch is booked
      on the executor's own thread, which then starts the tasks it made ready, so a cross-stage hop wakes one thread
      (the next stage's executor), not two (this scheduler thread, then the executor). A minibatch's last task
      goes to ``done``: this thread books it and applies the update together, so the rules never count a minibatch
      complete before its update is in the weights that new minibatches start on (the local staleness rule); the
      stage's next completions follow it there until it is booked."""
      if c.error is None:
        try:
          with lock:
            s = c.task.stage_id
            if not routed[s] and not schedule.completes_minibatch(c.task):
              t = time.perf_counter()
              book(c, False)
              submit_ready()
              stats.executor_book_s += time.perf_counter() - t
              return
            routed[s] += 1
        except BaseException as e:  # a broken rule: reported to the scheduler thread, which re-raises it
          c = dataclasses.replace(c, error=e)
      done.put(c)

    posted = types.SimpleNamespace(put=post)  # an executor's completion queue
    executors = [StageExecutor(s, posted, t0) if self.remote is None or s in self.local_stages
                 else self.remote.executor(s) for s in range(num_stages)]

    try:
      with jax.transfer_guard("disallow"):
        while num_finished < num_minibatches:
          loop_start = time.perf_counter()
          # 1. PS replies (no PS under all-reduce BSP).
          reply = self.ps.poll_pull() if self.ps is not None else None
          if reply is not None:
            t = time.perf_counter()
            self.sync.on_pull_reply(wsp.global_clock_of(reply[0]))
            self.install_pull(*reply)
            stats.sync_s += time.perf_counter() - t
          # 2. Completions posted here: minibatch ends, remote stages' completions (each stage reports in its own
          # order; the queue keeps completion order).
          finished = []
          taken = False
          while True:
            woke = first is not None
            if woke:
              c, first = first, None
            else:
              try:
                c = done.get_nowait()
              except queue.Empty:
                break
            if c.error is not None:
              raise c.error
            with lock:
              if routed[c.task.stage_id]:  # a local stage's (remote stages' completions all come this way)
                routed[c.task.stage_id] -= 1
              if book(c, woke):
                finished.append(c)
            taken = True
          # 3. The tasks those completions made ready start now, before the updates below.
          if taken:
            with lock:
              submit_ready()
          # 4. Completed minibatches: every stage's update (a new weight version), wave ends and their pulls.
          if finished:
            t = time.perf_counter()
            for c in finished:
              p = c.task.minibatch_id
              with lock:
                mb = inflight.pop(p)
              self.complete_minibatch(mb, c.end_s)
              num_finished += 1
              wave, pull = self.sync.on_minibatch_complete(p)
              if wave is not None and self.end_wave(wave):
                self.sync.on_reduced(wave)  # the all-reduce is a blocking collective: the update is applied
              if pull is not None:
                self.ps.request_pull(pull)
            stats.update_s += time.perf_counter() - t
          # 5. Injection under the local rule and WSP (on the weights that include every completed minibatch); each
          # minibatch's first task starts as soon as its data is placed, before the next one is read.
          with lock:
            injected, pull, waiting = wsp.injection_step(rules, self.sync, num_minibatches)
          if pull is not None:
            self.ps.request_pull(pull)
          if waiting:
            if wait_since is None:
              wait_since = time.perf_counter()
          elif injected and wait_since is not None:
            stats.wait_s += time.perf_counter() - wait_since
            wait_since = None
          for p in injected:
            t = time.perf_counter()
            mb = self.inject(p, t - t0)
            stats.inject_s += time.perf_counter() - t
            with lock:
              inflight[p] = mb
              submit_ready()
          stats.max_concurrent_tasks = max(stats.max_concurrent_tasks, num_running)
          # 6. Idle accounting, then block until a minibatch completes (or time out to poll the PS).
          if not num_running:
            if idle_since is None:
              idle_since = time.perf_counter()
          elif idle_since is not None:
            stats.idle_s += time.perf_counter() - idle_since
            idle_since = None
          # 7. Read the next minibatch ahead while waiting (off the path from a completion to the next injection).
          if rules.num_injected < num_minibatches:
            t = time.perf_counter()
            self.prefetch(rules.num_injected)
            stats.inject_s += time.perf_counter() - t
          stats.host_busy_s += time.perf_counter() - loop_start
          if num_finished < num_minibatches:
            try:
              first = done.get(timeout=self.poll_interval_s)  # processed first in the next iteration
            except queue.Empty:
              pass
      if idle_since is not None:
        stats.idle_s += time.perf_counter() - idle_since
    finally:
      for ex in executors:
        ex.close()
      gc.unfreeze()
    stats.wall_time_s = time.perf_counter() - t0
    stats.peak_inflight_per_stage = list(rules.peak_held)
    return stats

  # ---------------------------------------------------------------- tasks
  def prefetch(self, p: int) -> None:
    """Reads minibatch ``p`` and places it on its stages' devices ahead of its injection (the scheduler does so
    for the next minibatch while it waits, so a new minibatch's first task is not held up by reading it)."""
    if p not in self._prefetched:
      self._prefetched[p] = self._load(p)

  def _load(self, p: int):
    """Minibatch ``p``: ``(host labels, images on stage 0's device, labels on the last stage's device or None)``."""
    images, labels = self.get_minibatch(p)
    x = jax.device_put(images, self.stages[0].device)
    if self.remote is None or len(self.stages) - 1 in self.local_stages:
      y = jax.device_put(labels, self.stages[-1].device)
    else:
      y = None
    return labels, x, y

  def inject(self, p: int, now: float) -> "InFlightMinibatch":
    """Starts minibatch ``p`` on the current weight version; ``now`` is its injection time in seconds."""
    loaded = self._prefetched.pop(p, None)
    labels, x, y = loaded if loaded is not None else self._load(p)
    v = self.version
    fields = (self.vw_id, p, wsp.wave_of(p, self.num_inflight), self.sync.local_clock, v.version_id,
              v.local_updates, v.global_clock, v.vector_clock, now)
    if self.ps_shards is None:
      rec = MinibatchRecord(*fields)
    else:
      rec = ShardedMinibatchRecord(*fields, version_shard_vector_clocks=v.shard_vector_clocks or
                                   (v.vector_clock,) * self.ps_shards.num_shards)
    if self.method.update == "stage":
      rec.stage_versions = [-1] * len(self.stages)
    self.records.append(rec)
    if self.remote is not None:  # every stage rank learns p's version; the last stage's rank gets the labels
      self.remote.on_inject(p, v.version_id, labels)
    return InFlightMinibatch(v, x, y, {0: x}, {}, {}, {}, record=rec)

  def dispatch(self, task: Task, mb: InFlightMinibatch):
    """Dispatches ``task``; returns an array that is ready when its output has reached its consumer.

    Called on the stage's executor thread; it touches only this task's entries of ``mb``.
    """
    s = task.stage_id
    st = self.stages[s]
    if self.method.update == "stage":
      return self._dispatch_per_stage(task, mb)
    if self.link is not None:
      return self._dispatch_linked(task, mb)
    params = mb.version.params[s]
    if task.kind is TaskKind.FORWARD:
      out, vjp = st.forward(params, mb.activations.pop(s))
      mb.residuals[s] = vjp
      nxt = jax.device_put(out, self.stages[s + 1].device)
      mb.activations[s + 1] = nxt
      return nxt
    if task.kind is TaskKind.FORWARD_BACKWARD:
      loss, gp, gx = st.forward_backward(params, mb.activations.pop(s), mb.labels)
      mb.loss = loss
      self._keep_grads(s, mb, gp)
      if s == 0:
        return loss
      g = jax.device_put(gx, self.stages[s - 1].device)
      mb.grad_in[s - 1] = g
      return g
    grad_out = mb.grad_in.pop(s)
    gp, gx = st.backward(mb.residuals.pop(s), grad_out)
    self._keep_grads(s, mb, gp)
    if s == 0:
      leaves = jax.tree.leaves(self.grad_acc[0] if self.method.is_flush else gp)
      return leaves[0] if leaves else grad_out  # a parameter-free stage 0 has nothing left to compute
    g = jax.device_put(gx, self.stages[s - 1].device)
    mb.grad_in[s - 1] = g
    return g

  def _keep_grads(self, s: int, mb: InFlightMinibatch, grads) -> None:
    """A backward's parameter gradients: kept for the minibatch's update, or (flush methods) added to the step's
    accumulator right away, on the stage's executor thread (the only writer of ``grad_acc[s]`` during a step; the
    stage's backwards run in micro-batch order, so the sum is the same as adding them at each completion)."""
    if self.method.is_flush:
      st = self.stages[s]
      self.grad_acc[s] = st.add(self.grad_acc[s], grads)
      if (mb.record.minibatch_id + 1) % self.num_inflight == 0:
        # The stage's last micro-batch of the step: its part of the step buffer goes to the host now, off the flush's
        # critical path for every stage but the one that ends the step.
        self._step_flat[s] = jax.device_get(st.ravel(self.grad_acc[s]))
    else:
      mb.grads[s] = grads

  def _dispatch_linked(self, task: Task, mb: InFlightMinibatch):
    """:meth:`dispatch` with stage ranks: a remote stage's task is a command to its rank (the driver's remote
    executor calls this on whichever thread started it: the scheduler's, or a local executor's that booked a
    completion; returns None); a local stage's input from a stage on another rank
    arrives through the link, and its output to one leaves through it (the returned marker is ready once it has
    been received). Parameter gradients are kept before the input gradient is sent, so a minibatch's update (sent
    once stage 0's backward completed) finds them on every stage."""
    s = task.stage_id
    st = self.stages[s]
    p = task.minibatch_id
    if s not in self.local_stages:
      self.remote.start_task(task, mb.version.version_id,
                             self.task_time_s(task) if self.task_time_s is not None else None)
      return None
    version = mb.version.version_id
    params = mb.version.params[s]
    link = self.link
    if task.kind is TaskKind.BACKWARD:
      if link.is_local(s + 1):
        grad_out = mb.grad_in.pop(s)
      else:
        grad_out = jax.device_put(link.recv_gradient(s, p, version), st.device)
      gp, gx = st.backward(mb.residuals.pop(s), grad_out)
      mb.grads[s] = gp
      if s == 0:
        leaves = jax.tree.leaves(gp)
        return leaves[0] if leaves else grad_out
    else:
      if s == 0 or link.is_local(s - 1):
        x = mb.activations.pop(s)
      else:
        x = jax.device_put(link.recv_activation(s, p, version), st.device)
      if task.kind is TaskKind.FORWARD:
        out, vjp = st.forward(params, x)
        mb.residuals[s] = vjp
        if link.is_local(s + 1):
          nxt = jax.device_put(out, self.stages[s + 1].device)
          mb.activations[s + 1] = nxt
          return nxt
        return link.send_activation(s, p, version, out)
      loss, gp, gx = st.forward_backward(params, x, mb.labels)
      mb.loss = loss
      mb.grads[s] = gp
      if s == 0:
        return loss
    if link.is_local(s - 1):
      g = jax.device_put(gx, self.stages[s - 1].device)
      mb.grad_in[s - 1] = g
      return g
    return link.send_gradient(s, p, version, gx)

  def _dispatch_per_stage(self, task: Task, mb: InFlightMinibatch):
    """PipeDream's :meth:`dispatch`: forwards on the stage's current (or vertically synced) weights, stashed in the
    VJP closure; each backward (FB) followed by the stage's own update."""
    s = task.stage_id
    st = self.stages[s]
    if task.kind is TaskKind.FORWARD:
      out, vjp = st.forward(self._stage_forward_params(s, mb), mb.activations.pop(s))
      mb.residuals[s] = vjp
      nxt = jax.device_put(out, self.stages[s + 1].device)
      mb.activations[s + 1] = nxt
      return nxt
    if task.kind is TaskKind.FORWARD_BACKWARD:
      loss, gp, gx = st.forward_backward(self._stage_forward_params(s, mb), mb.activations.pop(s), mb.labels)
      mb.loss = loss
      self._stage_update(s, mb, gp)
      if s == 0:
        return loss
      g = jax.device_put(gx, self.stages[s - 1].device)
      mb.grad_in[s - 1] = g
      return g
    grad_out = mb.grad_in.pop(s)
    gp, gx = st.backward(mb.residuals.pop(s), grad_out)
    self._stage_update(s, mb, gp)
    if s == 0:
      leaves = jax.tree.leaves(gp)
      return leaves[0] if leaves else grad_out
    g = jax.device_put(gx, self.stages[s - 1].device)
    mb.grad_in[s - 1] = g
    return g

  def complete_minibatch(self, mb: InFlightMinibatch, now: float) -> None:
    """Applies minibatch p's update on every stage (a new weight version) and adds it to the wave's delta.

    An action: the driver then advances ``sync`` (``on_minibatch_complete``) and, at a wave end, calls
    :meth:`end_wave`. Flush methods: records the micro-batch's completion only (its backwards added its gradients
    to the step's accumulator, :meth:`_keep_grads`).
    """
    if self.method.is_flush or self.method.update == "stage":
      # Flush methods: the stages' backwards already added the gradients to grad_acc (_keep_grads).
      if not self.method.is_flush:  # PipeDream: every stage already applied its own update; the version counts it
        self.version = self._new_version(self.version.params, local_updates=self.version.local_updates + 1)
        if self.vertical_sync:
          self._prune_history()
      rec = mb.record
      rec.complete_time_s = now
      self._wave_losses.append((rec, mb.loss))
      return
    self.apply_update(mb)
    if self.remote is not None:  # every stage rank applies p's update to its stages: the same new version
      self.remote.on_update(mb.record.minibatch_id, self.version.version_id)
    rec = mb.record
    rec.complete_time_s = now
    self._wave_losses.append((rec, mb.loss))  # read back once per wave, not once per minibatch

  def apply_update(self, mb: InFlightMinibatch) -> None:
    """Minibatch ``mb``'s optimizer step on every local stage: a new weight version, its delta added to the wave's."""
    new_params, new_states, new_deltas = list(self.version.params), list(self.opt_states), list(self.wave_delta)
    for s in self.local_stages:
      st = self.stages[s]
      new_params[s], new_states[s], new_deltas[s] = st.update(self.version.params[s], self.opt_states[s], mb.grads[s],
                                                              self.wave_delta[s])
    self.opt_states = new_states
    self.wave_delta = new_deltas
    self.version = self._new_version(new_params, local_updates=self.version.local_updates + 1)

  def take_wave_delta(self) -> np.ndarray:
    """The local stages' wave delta, flat (their layers in stage order), and a fresh zero delta (a stage rank's side
    of a wave end)."""
    host = jax.device_get([self.wave_delta[s] for s in self.local_stages])
    flat = self._flat_of(self.local_stages, host)
    for s in self.local_stages:
      self.wave_delta[s] = self._zeros[s]
    return flat

  def _flat_of(self, stage_ids: Sequence[int], host: Sequence[Any]) -> np.ndarray:
    parts = [self.layout.flatten(h, self.stages[s].layer_range[0]) for s, h in zip(stage_ids, host)]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)

  def install_rebased(self, flat: np.ndarray) -> None:
    """A stage rank's side of a pull: its stages' rebased weights (the pulled global weights plus the own waves the
    PS lacks, computed by the driver; its stages' layers in stage order) plus its current partial wave: a new
    version."""
    params = list(self.version.params)
    pos = 0
    offsets = self.layout.layer_offsets
    for s in self.local_stages:
      st = self.stages[s]
      start, end = st.layer_range
      n = offsets[end] - offsets[start]
      p = jax.device_put(_host_copy(self.layout.unflatten(flat[pos:pos + n], start, end)), st.device)
      params[s] = st.add(p, self.wave_delta[s])
      pos += n
    if pos != flat.size:
      raise ValueError(f"[VW {self.vw_id}] rebased weights of {flat.size} floats for stages {self.local_stages} "
                       f"holding {pos}")
    self.version = self._new_version(params)

  def end_wave(self, wave_id: int) -> bool:
    """Pushes wave ``wave_id``'s summed delta and losses to the PS and keeps the delta until the PS holds it.

    Flush methods: hands the step's accumulated gradients and loss sum to the reducer (module docstring).

    Returns:
      True when a flush method's reduced update was applied now (the reducer returned the sum).

    Raises:
      FloatingPointError: a loss of the wave is NaN or Inf.
    """
    if self.method.is_flush:
      return self._reduce_step(wave_id)
    if self.method.update == "stage":
      return self._push_stage_waves(wave_id)
    loss_sum = self._read_losses()
    if self.remote is not None:  # the stage ranks push their own parts to the shards (stage_ranks module)
      self.remote.end_wave(wave_id)
      flat = self._linked_wave_flat()
    else:
      host = jax.device_get(self.wave_delta)
      flat = np.concatenate([self.layout.flatten(h, st.layer_range[0]) for h, st in zip(host, self.stages)])
    if self.ps_shards is not None or self.remote is not None:
      self.own_flat[wave_id] = flat.copy()  # the update as computed, before a fault drill can touch it
    if self.corrupt_update is not None:  # fault drills only (config.debug_nan_update)
      self.corrupt_update(wave_id, flat)
    self.ps.push(wave_id, flat, loss_sum, self.num_inflight)
    self.stats.num_pushes += 1
    self.own_waves[wave_id] = self.wave_delta
    self.wave_delta = list(self._zeros)
    return False

  def _linked_wave_flat(self) -> np.ndarray:
    """Stage ranks: the local stages' wave delta in a float32 ``[num_params]`` vector (zeros elsewhere: the stage
    ranks push their stages' parts themselves)."""
    offsets = self.layout.layer_offsets
    flat = np.zeros(self.layout.num_params, np.float32)
    host = jax.device_get([self.wave_delta[s] for s in self.local_stages])
    for s, h in zip(self.local_stages, host):
      start, end = self.stages[s].layer_range
      flat[offsets[start]:offsets[end]] = self.layout.flatten(h, start)
    return flat

  def _read_losses(self) -> float:
    """Reads the current wave's (step's) losses back into their records; returns their sum.

    Raises:
      FloatingPointError: a loss is NaN or Inf.
    """
    losses = jax.device_get([loss for _, loss in self._wave_losses])
    loss_sum = 0.0
    for (rec, _), loss in zip(self._wave_losses, losses):
      rec.loss = float(loss)
      if not np.isfinite(rec.loss):
        raise FloatingPointError(f"[VW {self.vw_id}] loss is {rec.loss} at minibatch {rec.minibatch_id}: "
                                 "training diverged; lower config.learning_rate")
      loss_sum += rec.loss
      if self.on_minibatch is not None:
        self.on_minibatch(rec)
    self._wave_losses = []
    return loss_sum

  def _push_stage_waves(self, wave_id: int) -> bool:
    """PipeDream: pushes every stage's delta of wave ``wave_id`` (each stage updated itself after its backwards)."""
    loss_sum = self._read_losses()
    deltas = []
    for s in range(len(self.stages)):
      with self.stage_locks[s]:
        deltas.append(self.stage_wave_delta[s].pop(wave_id, self._zeros[s]))
    host = jax.device_get(deltas)
    flat = np.concatenate([self.layout.flatten(h, st.layer_range[0]) for h, st in zip(host, self.stages)])
    if self.corrupt_update is not None:
      self.corrupt_update(wave_id, flat)
    self.ps.push(wave_id, flat, loss_sum, self.num_inflight)
    self.stats.num_pushes += 1
    self.own_waves[wave_id] = deltas
    return False

  def _prune_history(self) -> None:
    """Vertical sync: drops the stage versions no minibatch can still ask for (older than stage 0's forwards of the
    minibatches in flight, and than stage 0's current count)."""
    pending = [r.stage_versions[0] for r in self.records[-2 * self.num_inflight - 2:]
               if r.complete_time_s != r.complete_time_s and r.stage_versions[0] >= 0]
    keep = min(pending + [self.stage_updates[0]])
    for s in range(1, len(self.stages)):
      with self.stage_locks[s]:
        for k in [k for k in self.stage_history[s] if k < keep]:
          del self.stage_history[s][k]

  def _reduce_step(self, step: int) -> bool:
    """Flush methods: the step's gradients and loss sum, as one buffer, to the reducer; applies a returned sum."""
    loss_sum = self._read_losses()
    flats, self._step_flat = self._step_flat, [None] * len(self.stages)
    buf = np.empty(self.layout.num_params + 1, np.float32)
    pos = 0
    for flat in flats:
      buf[pos:pos + flat.size] = flat
      pos += flat.size
    buf[-1] = loss_sum
    if self.corrupt_update is not None:  # fault drills only (config.debug_nan_update)
      self.corrupt_update(step, buf[:-1])
    self.grad_acc = list(self._zeros)
    self.stats.num_pushes += 1
    summed = self.reducer(step, buf)
    if summed is None:
      return False
    self.apply_reduced(step, summed)
    return True

  def apply_reduced(self, step: int, summed: np.ndarray) -> None:
    """Flush methods: applies the all-reduced step on every stage (an action: the driver advances ``sync``).

    Args:
      step: the step (0-based within the run).
      summed: float32 ``[num_params + 1]``: every VW's accumulated gradients summed, then their loss sums summed.

    Raises:
      FloatingPointError: the reduced gradients hold NaN or Inf (some VW diverged).
    """
    count = self.num_virtual_workers * self.num_inflight
    grads = np.asarray(summed[:-1], np.float32)
    if not np.isfinite(grads).all():  # the mean (sum / count, count >= 1) is finite exactly when the sum is
      raise FloatingPointError(f"[VW {self.vw_id}] the all-reduced gradients of step {step} hold NaN/Inf: training "
                               "diverged; lower config.learning_rate")
    offsets = self.layout.layer_offsets
    # One contiguous copy per stage (a device array may alias its numpy source on the CPU backend), placed in one
    # call; each stage divides by the count and unflattens on its device.
    slices = jax.device_put([np.array(grads[offsets[st.layer_range[0]]:offsets[st.layer_range[1]]])
                             for st in self.stages], [st.device for st in self.stages])
    params, states = [], []
    for s, (st, g, d) in enumerate(zip(self.stages, slices, self._divisors)):
      p, o = st.apply_mean(self.version.params[s], self.opt_states[s], g, d)
      params.append(p)
      states.append(o)
    self.opt_states = states
    done = self.version.local_updates + 1
    self.version = self._new_version(params, local_updates=done, vector_clock=(done,) * self.num_virtual_workers)
    self.stats.num_pulls += 1
    if self.on_step is not None:
      self.on_step(step, float(summed[-1]) / count)

  def install_pull(self, vector_clock: Sequence[int], flat: np.ndarray,
                   shard_vector_clocks: Sequence[Sequence[int]] | None = None) -> None:
    """Local weights := pulled global weights + own updates the global weights do not hold yet.

    The own waves kept are :func:`hetpipe_jax.rules.wsp.own_waves_after_pull`'s (those beyond the vector clock's own
    entry), then the current partial wave. An action: the driver calls ``sync.on_pull_reply``.

    Args:
      vector_clock: the pulled weights' vector clock (per VW, how many of its waves they hold).
      flat: the pulled global weights, float32 ``[num_params]``.
      shard_vector_clocks: sharded PS: per shard, the vector clock of its slice (``vector_clock`` is their
        element-wise minimum). Own waves a shard does not hold yet are re-added on that shard's layers only.

    Raises:
      ValueError: the vector clock does not have one entry per VW.
    """
    if len(vector_clock) != self.num_virtual_workers:
      raise ValueError(f"[VW {self.vw_id}] pulled weights with vector clock {list(vector_clock)}: expected "
                       f"{self.num_virtual_workers} entries")
    self.stats.num_pulls += 1
    if shard_vector_clocks is not None:
      self._install_sharded_pull(vector_clock, flat, shard_vector_clocks)
      return
    keep = wsp.own_waves_after_pull(self.own_waves, vector_clock[self.vw_id])
    self.own_waves = {c: self.own_waves[c] for c in keep}
    if self.method.update == "stage":
      self._install_pull_per_stage(vector_clock, flat, keep)
      return
    params = [None] * len(self.stages)
    for s in self.local_stages:
      st = self.stages[s]
      start, end = st.layer_range
      p = jax.device_put(_host_copy(self.layout.unflatten(flat, start, end)), st.device)
      for c in keep:
        p = st.add(p, self.own_waves[c][s])
      params[s] = st.add(p, self.wave_delta[s])
    self.version = self._new_version(params, vector_clock=vector_clock)
    if self.remote is not None:  # the stage ranks rebase their stages on their parts of the same pull
      self.own_flat = {c: self.own_flat[c] for c in keep}
      self.remote.on_pull(self.version.version_id, [vector_clock[self.vw_id]])
    logging.log_every_n_seconds(logging.INFO, "[VW %d] pulled global clock %d, vector clock %s (local clock %d)", 10,
                                self.vw_id, self.version.global_clock, list(vector_clock), self.sync.local_clock)

  def _install_sharded_pull(self, vector_clock, flat, shard_vector_clocks) -> None:
    """:meth:`install_pull` for sharded parameter servers: per shard, pulled slice + own waves it lacks."""
    own_applied = [vc[self.vw_id] for vc in shard_vector_clocks]
    local, self.own_flat = rebase_on_shards(flat, self.own_flat, own_applied, self.ps_shards.index)
    self.own_waves = {c: self.own_waves[c] for c in self.own_flat}
    params = [None] * len(self.stages)
    for s in self.local_stages:
      st = self.stages[s]
      start, end = st.layer_range
      p = jax.device_put(self.layout.unflatten(local, start, end), st.device)
      params[s] = st.add(p, self.wave_delta[s])
    self.version = self._new_version(params, vector_clock=vector_clock,
                                     shard_vector_clocks=tuple(tuple(int(c) for c in vc) for vc in shard_vector_clocks))
    if self.remote is not None:  # the stage ranks rebase their stages on their parts of the same pull
      self.remote.on_pull(self.version.version_id, own_applied)

  def _install_pull_per_stage(self, vector_clock, flat: np.ndarray, keep: list[int]) -> None:
    """PipeDream's pull: every stage := global + its own pushed waves the PS lacks + its deltas not pushed yet (under
    the stage's lock; with vertical sync the kept history moves by the same correction)."""
    for s, st in enumerate(self.stages):
      start, end = st.layer_range
      p = jax.device_put(_host_copy(self.layout.unflatten(flat, start, end)), st.device)
      for c in keep:
        p = st.add(p, self.own_waves[c][s])
      with self.stage_locks[s]:
        for _, d in sorted(self.stage_wave_delta[s].items()):
          p = st.add(p, d)
        if self.vertical_sync:
          correction = jax.tree.map(lambda a, b: a - b, p, self.stage_params[s])
          for k in self.stage_history[s]:
            self.stage_history[s][k] = st.add(self.stage_history[s][k], correction)
        self.stage_params[s] = p
    self.version = self._new_version(self.stage_params, vector_clock=vector_clock)

  # ---------------------------------------------------------------- checkpoint segments
  def begin_segment(self, flat: np.ndarray) -> None:
    """Starts a new WSP segment from global weights that hold every VW's waves so far (a checkpoint barrier).

    Checkpoints are WSP barriers (WORKSPACE.md): every VW finishes the segment's last wave, the PS holds every wave,
    and each VW continues from those global weights with nothing of its own outstanding. Clocks restart at 0 for the
    segment (the job adds the segment's offsets to records and logs), the optimizer states carry over.

    Args:
      flat: the global weights, float32 ``[num_params]``.
    """
    params = []
    for st in self.stages:
      start, end = st.layer_range
      params.append(jax.device_put(_host_copy(self.layout.unflatten(flat, start, end)), st.device))
    self.version = WeightVersion(tuple(params), 0, (0,) * self.num_virtual_workers, self.version.version_id + 1)
    self.own_waves = {}
    self.wave_delta = list(self._zeros)
    self.grad_acc = list(self._zeros)
    self._wave_losses = []
    self._init_stage_state(self.stage_updates)
    self.sync = self._new_sync(self.num_inflight, self.staleness_bound, self.sync.pull_every_wave)

  def set_version_id(self, version_id: int) -> None:
    """Continues a resumed VW's version numbering (records' ``version_id``) from its checkpoint."""
    self.version = dataclasses.replace(self.version, version_id=version_id)

  def opt_state_by_layer(self) -> tuple[list[np.ndarray], list[list[Any]]]:
    """The VW's optimizer state split by layer (:func:`hetpipe_jax.runtime.opt_state.split_by_layer`), all its layers
    in order; the shared scalars are stage 0's (every stage updates once per minibatch, so they agree)."""
    from hetpipe_jax.runtime import opt_state  # pylint: disable=g-import-not-at-top
    host_states, host_params = jax.device_get((self.opt_states, list(self.version.params)))
    scalars, per_layer = None, []
    for state, params in zip(host_states, host_params):
      s, layers = opt_state.split_by_layer(state, params)
      scalars = s if scalars is None else scalars
      per_layer.extend(layers)
    return scalars, per_layer

  def load_opt_state(self, scalars: list, per_layer: list[list[Any]]) -> None:
    """Sets every stage's optimizer state from :meth:`opt_state_by_layer` parts (of any partition).

    Raises:
      ValueError: the parts do not fit this model and optimizer.
    """
    from hetpipe_jax.runtime import opt_state  # pylint: disable=g-import-not-at-top
    states = []
    for st, params in zip(self.stages, jax.device_get(list(self.version.params))):
      start, end = st.layer_range
      state = opt_state.join_layers(self.optimizer, params, scalars, per_layer[start:end])
      states.append(jax.device_put(state, st.device))
    self.opt_states = states

  # ---------------------------------------------------------------- results
  def layer_params(self) -> list[Any]:
    """The VW's current weights as host per-layer params (for tests and checkpoints)."""
    out = []
    current = self.stage_params if self.method.update == "stage" else self.version.params
    for p in jax.device_get(list(current)):
      out.extend(p)
    return out
