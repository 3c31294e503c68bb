"""Discrete-event engine: N virtual workers and the parameter server in virtual time (HetPipe §4, §5, §8).

Simulation layer: standard library only. The engine executes exactly the rules the runtime (``vw_driver.run``)
executes, through the same pure objects: per VW a :class:`schedule.PipelineRules`
(which task a stage runs next, Nm in flight) and a :class:`wsp.VWSyncState` (may a minibatch be injected, what to
push and pull), and one :class:`wsp.ParameterServerState` for the PS. Only time is simulated:

* every stage is one in-order device: as in the runtime, a ready task is handed to its stage's device queue at once
  (``PipelineRules.pop_ready``, FIFO) and starts when the device is free; it lasts ``VWTaskTimes.task_duration_s``
  (compute + sending its output), and its successor becomes ready when it ends (its output has arrived). So
  ``peak_inflight_per_stage`` (``PipelineRules.peak_held``) counts a forward from its dispatch, like the runtime's;
* a minibatch completes when its backward on stage 0 ends; then the VW's weights update, and at a wave end the VW
  sends the wave's push, which arrives at the PS ``push_s`` later, and (``pull_every_wave``) a non-waiting pull
  request;
* the PS applies a push when it arrives (``ps_apply="on_receipt"``, HetPipe §5) or once every VW pushed that wave
  (``"clock_aligned"``), through ``ParameterServerState.push``;
* a pull request is a tiny message on the same ordered channel as the VW's pushes, so it reaches the PS no earlier
  than the VW's last push; the PS answers it at once or keeps it pending (``ParameterServerState.request_pull``,
  then ``serve_pending_pulls`` after each push that advances the global clock, in arrival order); the reply (the
  global weights as they are when it is answered, named by their vector clock) arrives ``pull_s`` later and is
  installed (``VWSyncState.on_pull_reply``). With no records and no pull hooks nothing reads the vector clock, so
  the reply carries only its minimum, the global clock (an O(1) reply instead of O(N));
* minibatches are injected by ``wsp.injection_step`` (Nm in flight, the run's length, the WSP gate and the pull
  it requests), re-run whenever its inputs can change (a minibatch completes, a pull reply arrives).

The engine is the one driver of every VW's :class:`wsp.VWSyncState` (``on_minibatch_complete``, ``on_pull_reply``
and, through ``injection_step``, ``injection_gate``): each transition happens once, here, and the hooks are told
its outcome (``on_wave_end``, ``on_pull_reply``). In virtual time the engine is handed the ``VirtualWorker``s' own
state objects (``sync_states``), so each VW has one state, which the engine advances and the hooks only read.

Methods (``EngineConfig.method``, :mod:`hetpipe_jax.rules.methods`): the pipeline rules take the method's static
per-stage order (every method but ``hetpipe``), and the all-reduce methods (``gpipe``, ``1f1b_flush``, ``horovod``)
replace the PS by all-reduce BSP (:mod:`hetpipe_jax.rules.allreduce`): a step is ``num_inflight`` = M
micro-batches, injected together once the previous step's update is applied (``AllReduceSyncState.max_injected``);
when a VW's last micro-batch of a step completes it enters the step's all-reduce (``AllReduceState.enter``); when the
last VW enters, the reduction takes ``max_v VWTaskTimes.allreduce_s`` and then every VW applies the update
(``AllReduceSyncState.on_reduced``) and injects the next step. So the step waits for the slowest replica. A VW's
``wait_s`` is then its time inside all-reduces (waiting for the slowest replica, plus the reduction).
Hooks of the all-reduce methods: ``on_wave_end(vw_id, step, t)`` when a VW enters a step's all-reduce (its
gradients are final), ``on_allreduce(step, t)`` when the last VW enters it, ``on_reduced(vw_id, step, t)`` when the
reduced update is applied on a VW (then its injections and task starts follow, as after a pull reply).
``fsdp`` runs as ``horovod`` does, one one-GPU VW per GPU in lock-step, its task times and "all-reduce" (the
collectives' exposed time) from :func:`hetpipe_jax.costs.task_times.fsdp_task_times`.

Shared network interfaces (``shared_nic``, on by default for every method; :mod:`hetpipe_jax.rules.network`): each
node's NIC carries its inter-node traffic one transfer at a time per direction, in request order. A task whose
output crosses nodes (``VWTaskTimes.output_leg``) computes for its compute time, then its send waits for the sending
node's NIC and the receiving node's NIC and takes ``send_*_s``; the stage stays occupied until the output has
arrived (as without the rule). A wave push and a pull reply are their ``push_legs`` / ``pull_legs``, one after
another through the NICs they cross, each leg requested when the previous one has arrived (``_LEG`` events; a pull
request sent behind a push still on its way waits for that push's arrival, as on an ordered channel); an all-reduce takes ``VWTaskTimes.allreduce_time_s(shared_nic)`` (rings
sharing a NIC served one after another). Transfers inside a node, and task times with no nodes (synthetic
``uniform_task_times``), touch no NIC. ``shared_nic=False``: every transfer at full link speed (the per-link model).
The report's ``nic_busy_s`` gives each node's NIC send and receive busy seconds.

Optional PS link contention (``ps_link_contention``, off by default): in addition, every push and every pull reply
crosses one shared link at the PS, one transfer at a time in request order (a single PS link for all shards); with
it, a transfer's NIC legs are booked when it is sent.

Speed (timing-only mode, ``records=False``): an event does only the work its outcome needs. It examines only the
stages whose device or queue it changed (``_start_ready``), looks for pending pulls to answer only after a push that
advanced the global clock, and builds a reply's O(N) vector clock only when records or pull hooks read it. A task's
end whose output moves on (most events) completes it in the rules, dispatches its successor and starts at most two
tasks (``_start``: durations read off the device), with no per-event dicts, closures or scans. Its speed is measured
by ``scripts/bench_engine.py`` (records in docs/measurements/engine_speed.md); ``scripts/engine_fingerprint.py``
checks that a speed-up leaves every result bit-identical.

Hooks (``hooks`` argument; any object, each method optional) are called in event order: events run in order of
virtual time, ties in the order they were created. Within one event:

1. t = 0, per VW in order: ``on_inject`` for each minibatch injected, then ``on_task_start`` per stage started
   (stage order).
2. A task ends: ``on_minibatch_complete(vw_id, minibatch_id, t)`` if it completes its minibatch, then
   ``VWSyncState.on_minibatch_complete``; if that ends a wave, ``on_wave_end(vw_id, wave_id, t)`` and the wave's
   push is sent; then any pull request is sent; then ``on_inject(vw_id, minibatch_id, t)`` per injection; then
   ``on_task_start(vw_id, task, t)`` per stage that starts a task (stage order).
3. A push arrives at the PS: ``on_push(vw_id, wave_id, t_arrival)``, then the PS applies it
   (``ParameterServerState.push``) and answers the pulls it can now serve: ``on_pull_sent(vw_id, vector_clock, t)``
   per answered pull, in the order the requests arrived (also when a pull request arrives and is answered at once).
4. A pull reply arrives: ``on_pull_reply(vw_id, vector_clock, t)`` (the vector clock of the weights as they were
   when the PS answered), then ``VWSyncState.on_pull_reply``, then ``on_inject`` / ``on_task_start`` as in 2.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
import random
import time
from typing import Any, Callable, Sequence

from hetpipe_jax.costs.task_times import VWTaskTimes
from hetpipe_jax.rules import allreduce
from hetpipe_jax.rules import methods
from hetpipe_jax.rules import network
from hetpipe_jax.rules import schedule
from hetpipe_jax.rules import wsp
from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.sim import engine_report
from hetpipe_jax.sim.engine_report import EngineReport, GPUReport, MinibatchRecord, TaskEvent, VWReport

_TASK_END, _PUSH_ARRIVAL, _PULL_REQUEST, _PULL_REPLY, _REDUCED, _SEND, _LEG = 0, 1, 2, 3, 4, 5, 6
_BACKWARD = TaskKind.BACKWARD
_STAGE_0 = (0,)
_heappush = heapq.heappush
_FORWARD = TaskKind.FORWARD
_HOOK_NAMES = ("on_inject", "on_task_start", "on_minibatch_complete", "on_wave_end", "on_push", "on_pull_sent",
               "on_pull_reply", "on_allreduce", "on_reduced")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """What to run.

  Attributes:
    num_waves: waves each VW trains (``num_waves * num_inflight`` minibatches).
    num_inflight: Nm, minibatches in flight per VW (= per wave), HetPipe §4.
    staleness_bound: D >= 0, HetPipe §5.
    pull_every_wave: pull without waiting at every wave end (our refinement); False pulls only when the staleness
      bound requires it, at the wave end, and waits (HetPipe §5's policy).
    ps_apply: ``"on_receipt"`` (HetPipe §5: the PS adds a wave update when it arrives) or ``"clock_aligned"``.
    records: keep per-minibatch records, per-task events, PS waits and the PS's application order; False is the
      timing-only mode.
    ps_link_contention: serialise all pushes and pull replies on one shared PS link (module docstring).
    shared_nic: the VWs on one node share its network interface for inter-node traffic (activations and gradients,
      PS pushes and pulls, all-reduces; :mod:`hetpipe_jax.rules.network`, HetPipe §8.1's one InfiniBand NIC per
      node). False: every transfer runs at full link speed.
    method: one of :data:`hetpipe_jax.rules.methods.METHODS` (its stage order and synchronisation); for the
      all-reduce methods ``num_inflight`` is M (micro-batches per step) and ``num_waves`` the steps.
    task_time_cv: per-task timing jitter, the coefficient of variation (std / mean) of a task's compute time: each
      task's compute lasts its ``VWTaskTimes`` time times an independent log-normal factor of mean 1 (a real GPU's
      kernels, clocks and host dispatch vary from minibatch to minibatch; identical deterministic VWs never drift
      apart, which HetPipe §8.4's waiting statistics depend on). Sends and PS transfers are not jittered. 0 (the
      default): deterministic, bit-identical to the engine without jitter.
    jitter_seed: seed of the jitter's random stream (draws are made in event order, so a run is reproducible).
    max_held: per VW, per stage, the most minibatches the stage may hold (``schedule.PipelineRules``'s memory
      caps, ``hetpipe`` only; a plan's ``held_per_stage``); None: no caps.
  """

  num_waves: int
  num_inflight: int
  staleness_bound: int = 0
  pull_every_wave: bool = True
  records: bool = True
  ps_link_contention: bool = False
  ps_apply: str = "on_receipt"
  method: str = "hetpipe"
  shared_nic: bool = True
  task_time_cv: float = 0.0
  jitter_seed: int = 0
  max_held: tuple[tuple[int, ...], ...] | None = None

  def __post_init__(self):
    wsp.check_ps_apply(self.ps_apply)
    if self.max_held is not None:
      if not methods.get_method(self.method).schedule_peaks:
        raise ValueError(f"max_held (memory caps) is for method 'hetpipe', not {self.method!r}")
      object.__setattr__(self, "max_held", tuple(tuple(int(h) for h in caps) for caps in self.max_held))
    if not (math.isfinite(self.task_time_cv) and 0.0 <= self.task_time_cv <= 10.0):
      raise ValueError(f"task_time_cv must be a finite coefficient of variation in [0, 10], got {self.task_time_cv}")
    methods.get_method(self.method)
    if self.num_waves < 1:
      raise ValueError(f"num_waves must be >= 1, got {self.num_waves}")
    if self.num_inflight < 1:
      raise ValueError(f"num_inflight (Nm) must be >= 1, got {self.num_inflight}")
    if self.staleness_bound < 0:
      raise ValueError(f"staleness_bound (D) must be >= 0, got {self.staleness_bound}")


class _GPU:
  """One stage's device: its queue of dispatched tasks, the task it runs, its accounting, and its task times (kept
  here so that starting a task reads them off the device, not the VW's per-stage lists)."""

  __slots__ = ("stage_id", "queue", "task", "started", "busy_s", "num_tasks", "dur_fwd", "dur_bwd", "leg_fwd",
               "leg_bwd", "comp_fwd", "comp_bwd")

  def __init__(self, stage_id: int):
    self.stage_id = stage_id
    self.queue = collections.deque()  # popped (dispatched), waiting for the device
    self.task: Task | None = None
    self.started = 0.0
    self.busy_s = 0.0
    self.num_tasks = 0
    # Set by _VW: the duration of the stage's forward (FB) / backward task, its inter-node output send (or None),
    # and the compute part that EngineConfig.task_time_cv jitters.
    self.dur_fwd = self.dur_bwd = self.comp_fwd = self.comp_bwd = 0.0
    self.leg_fwd = self.leg_bwd = None


class _VW:
  """One virtual worker's engine state (rules + devices + accounting)."""

  __slots__ = ("vw_id", "times", "rules", "sync", "num_stages", "total", "gpus", "active",
               "idle_since", "idle_s", "wait_since", "wait_s", "completions", "version_id", "num_pushes", "num_pulls",
               "last_push_arrival", "records", "vector_clock", "fifo", "reduce_entered", "leg_pushes_sent",
               "leg_pushes_arrived", "deferred_pulls")

  def __init__(self, vw_id: int, times: VWTaskTimes, config: EngineConfig, sync: wsp.VWSyncState | None,
               num_vws: int):
    s_count = times.num_stages
    self.vw_id = vw_id
    self.times = times
    self.total = config.num_waves * config.num_inflight
    method = methods.get_method(config.method)
    order = methods.stage_order(method, s_count, config.num_inflight, self.total)
    caps = None if config.max_held is None else config.max_held[vw_id]
    self.rules = schedule.PipelineRules(s_count, config.num_inflight, order, max_held=caps)
    # HetPipe's FIFO rule without memory caps: the event loop's fast paths apply (a newly ready task starts at once).
    # With caps a forward may wait for a backward on its stage: the general path re-examines every changed stage.
    self.fifo = order is None and caps is None
    if sync is None:
      sync = SYNCS[method.sync].vw_state(config)
    self.sync = sync
    self.num_stages = s_count
    # Per stage (on its device): duration of its forward (FB on the last stage) and of its backward task.
    last = s_count - 1
    self.gpus = gpus = [_GPU(s) for s in range(s_count)]
    for s, gpu in enumerate(gpus):
      gpu.dur_fwd = times.task_duration_s(Task(s, TaskKind.FORWARD if s < last else TaskKind.FORWARD_BACKWARD, 0))
      gpu.dur_bwd = times.task_duration_s(Task(s, TaskKind.BACKWARD, 0)) if s < last else 0.0
      # Their compute parts (what EngineConfig.task_time_cv jitters).
      gpu.comp_fwd = times.forward_backward_s if s == last else times.forward_s[s]
      gpu.comp_bwd = times.backward_s[s] if s < last else 0.0
    # Shared NICs: per stage, the inter-node send ending its forward (FB) / backward task, else None. Such a task
    # computes for its duration minus the send, then the send waits for the NICs (network rule).
    if config.shared_nic:
      for s in range(s_count):
        gpus[s].leg_fwd = times.output_leg(Task(s, TaskKind.FORWARD if s < last else TaskKind.FORWARD_BACKWARD, 0))
        if s < last:
          gpus[s].leg_bwd = times.output_leg(Task(s, TaskKind.BACKWARD, 0))
    self.active = 0  # tasks ready or running
    self.idle_since: float | None = 0.0
    self.idle_s = 0.0
    self.wait_since: float | None = None
    self.wait_s = 0.0
    self.completions: list[float] = []
    self.version_id = 0
    self.num_pushes = 0
    self.num_pulls = 0
    self.last_push_arrival = 0.0
    # Pushes that go leg by leg through shared NICs (their arrival is not known when sent): sent, arrived, and the
    # pull requests sent behind one of them, as (pushes that must arrive first, required clock), in request order.
    self.leg_pushes_sent = 0
    self.leg_pushes_arrived = 0
    self.deferred_pulls: collections.deque[tuple[int, int]] = collections.deque()
    self.records: dict[int, MinibatchRecord] = {}
    self.vector_clock = (0,) * num_vws  # of the installed pulled weights
    self.reduce_entered = 0.0  # when the VW entered its current all-reduce


def _check_allreduce_states(sync_states: Sequence[allreduce.AllReduceSyncState], config: EngineConfig) -> None:
  """Raises ValueError unless every state is a fresh :class:`allreduce.AllReduceSyncState` with ``config``'s M."""
  for v, sync in enumerate(sync_states):
    if not isinstance(sync, allreduce.AllReduceSyncState) or sync.num_microbatches != config.num_inflight:
      raise ValueError(f"sync_states[{v}] must be an AllReduceSyncState with M = {config.num_inflight} for "
                       f"method {config.method!r}")
    if sync.local_clock or sync.applied_steps:
      raise ValueError(f"sync_states[{v}] is not fresh")


def _check_wsp_states(sync_states: Sequence[wsp.VWSyncState], config: EngineConfig) -> None:
  """Raises ValueError unless every state is fresh with ``config``'s Nm, D and pulls."""
  want = (config.num_inflight, config.staleness_bound, config.pull_every_wave)
  for v, sync in enumerate(sync_states):
    got = (sync.num_inflight, sync.staleness_bound, sync.pull_every_wave)
    if got != want:
      raise ValueError(f"sync_states[{v}] has (num_inflight, staleness_bound, pull_every_wave) = {got}; the "
                       f"engine config has {want}")
    if sync.local_clock or sync.weights_global_clock or sync.pull_required is not None:
      raise ValueError(f"sync_states[{v}] is not fresh (local clock {sync.local_clock}, weights global clock "
                       f"{sync.weights_global_clock}, pull outstanding {sync.pull_required})")


@dataclasses.dataclass(frozen=True)
class _Sync:
  """How the engine synchronises VWs under one ``Method.sync``.

  Attributes:
    vw_state: a VW's fresh sync state from the engine config.
    check: raises ValueError unless the given per-VW states are fresh and match the config.
    reducer: the all-reduce shared by the VWs (given their number), or None (the parameter server,
      ``Engine.ps``).
  """

  vw_state: Callable[[EngineConfig], wsp.VWSyncState | allreduce.AllReduceSyncState]
  check: Callable[[Sequence[Any], EngineConfig], None]
  reducer: Callable[[int], allreduce.AllReduceState | None]


SYNCS = {
    "wsp": _Sync(lambda c: wsp.VWSyncState(c.num_inflight, c.staleness_bound, c.pull_every_wave), _check_wsp_states,
                 lambda num_vws: None),
    "allreduce": _Sync(lambda c: allreduce.AllReduceSyncState(c.num_inflight), _check_allreduce_states,
                       allreduce.AllReduceState),
}


def _check_sync_states(sync_states: Sequence[wsp.VWSyncState], num_vws: int, config: EngineConfig) -> None:
  """Raises ValueError unless ``sync_states`` holds ``num_vws`` fresh states with ``config``'s Nm, D and pulls."""
  if len(sync_states) != num_vws:
    raise ValueError(f"sync_states has {len(sync_states)} entries for {num_vws} virtual workers")
  SYNCS[methods.get_method(config.method).sync].check(sync_states, config)


class Engine:
  """Runs ``task_times`` (one entry per VW) under ``config``; see the module docstring.

  Args:
    task_times: per VW its task and PS-transfer durations.
    config: what to run.
    hooks: optional object with any of ``on_inject``, ``on_task_start``, ``on_minibatch_complete``,
      ``on_wave_end``, ``on_push``, ``on_pull_reply`` (signatures and order in the module docstring).
    gpu_ids: per VW, per stage, a GPU name for the report (default ``"vw<v>/s<s>"``).
    sync_states: per VW, the fresh :class:`wsp.VWSyncState` to drive (virtual time passes its VirtualWorkers'
      own, so each VW has one); default: the engine makes them from ``config``.

  Raises:
    ValueError: no VWs, ``gpu_ids`` of the wrong shape, or ``sync_states`` of the wrong length, not fresh, or
      with Nm, D or ``pull_every_wave`` other than ``config``'s.
  """

  def __init__(self, task_times: Sequence[VWTaskTimes], config: EngineConfig, hooks: Any = None,
               gpu_ids: Sequence[Sequence[str]] | None = None,
               sync_states: Sequence[wsp.VWSyncState] | None = None):
    if not task_times:
      raise ValueError("task_times is empty: need at least one virtual worker")
    self.config = config
    if config.max_held is not None and len(config.max_held) != len(task_times):
      raise ValueError(f"max_held has caps for {len(config.max_held)} virtual workers, the run has {len(task_times)}")
    if sync_states is None:
      sync_states = [None] * len(task_times)
    else:
      _check_sync_states(sync_states, len(task_times), config)
    self.vws = [_VW(v, t, config, sync, len(task_times)) for v, (t, sync) in enumerate(zip(task_times, sync_states))]
    if gpu_ids is None:
      gpu_ids = [[f"vw{v}/s{s}" for s in range(w.num_stages)] for v, w in enumerate(self.vws)]
    if len(gpu_ids) != len(self.vws) or any(len(g) != w.num_stages for g, w in zip(gpu_ids, self.vws)):
      raise ValueError("gpu_ids must list one name per stage of every virtual worker")
    self.gpu_ids = [list(g) for g in gpu_ids]
    self.method = methods.get_method(config.method)
    self.ps = wsp.ParameterServerState(len(self.vws), config.ps_apply)  # unused by the all-reduce methods
    self.reducer = SYNCS[self.method.sync].reducer(len(self.vws))
    self.allreduce_s = max(t.allreduce_time_s(config.shared_nic) for t in task_times)
    self.nic = network.NicState()  # used only with config.shared_nic
    self.hooks = {name: getattr(hooks, name, None) for name in _HOOK_NAMES}
    self._on_task_start = self.hooks["on_task_start"]
    self._on_inject = self.hooks["on_inject"]
    self._on_minibatch_complete = self.hooks["on_minibatch_complete"]
    self._on_wave_end = self.hooks["on_wave_end"]
    self._records = config.records
    # Per-task jitter (EngineConfig.task_time_cv): log-normal factor with mean 1 and that coefficient of variation.
    self._jitter = None
    if config.task_time_cv > 0:
      sigma = math.sqrt(math.log1p(config.task_time_cv ** 2))
      self._jitter = (random.Random(config.jitter_seed).lognormvariate, -0.5 * sigma * sigma, sigma)
    # A pull reply carries the vector clock of the weights it holds only when someone reads it (records, pull
    # hooks); otherwise just their global clock (the vector clock's minimum), which is all the VW's rules need.
    self._vector_clocks = (config.records or self.hooks["on_pull_sent"] is not None
                           or self.hooks["on_pull_reply"] is not None)
    self._heap: list = []
    self._seq = itertools.count(1)  # creation order of events: breaks ties in time
    self._next_seq = self._seq.__next__
    self._ps_link_free = 0.0
    self._task_events: list = []
    self._ps_waits: list[tuple[int, float, float]] = []
    # Local clocks: count of VWs at each clock value, to track max - min incrementally.
    self._clock_counts = [0] * (config.num_waves + 2)
    self._clock_counts[0] = len(self.vws)
    self._min_clock = self._max_clock = 0
    self._max_distance = 0
    self._clock_samples: list[tuple[float, int, int, int]] = []

  # ------------------------------------------------------------------ scheduling helpers
  def _push_event(self, t: float, code: int, vw_id: int, arg) -> None:
    _heappush(self._heap, (t, self._next_seq(), code, vw_id, arg))

  def _ps_transfer_arrival(self, t: float, duration: float, legs) -> float:
    """When a push (pull reply) of ``duration`` seconds sent at ``t`` arrives: through the shared PS link
    (``ps_link_contention``) and the NICs its ``legs`` cross (``shared_nic``)."""
    contention = self.config.ps_link_contention
    start = max(t, self._ps_link_free) if contention else t
    if self.config.shared_nic and legs is not None:
      end = self.nic.transfer_end(start, legs)
    else:
      end = start + duration
    if contention:
      self._ps_link_free = end
    return end

  def _send_ps_transfer(self, t: float, duration: float, legs, code: int, v: int, arg) -> float | None:
    """Sends a push (``code`` _PUSH_ARRIVAL) or a pull reply (_PULL_REPLY) at ``t``; its arrival event carries
    ``arg``. Returns the arrival time, or None when it goes leg by leg through shared NICs: each leg is served when
    the previous one has arrived (a ``_LEG`` event), so the NICs are requested when the data is there."""
    if self.config.shared_nic and legs and not self.config.ps_link_contention:
      self._push_event(t, _LEG, v, (legs, 0, code, arg))
      return None
    arrival = self._ps_transfer_arrival(t, duration, legs)
    self._push_event(arrival, code, v, arg)
    return arrival

  def _request_pull(self, vw: _VW, required: int, t: float) -> None:
    if vw.leg_pushes_arrived < vw.leg_pushes_sent:  # behind a push still crossing the NICs: sent when it arrived
      vw.deferred_pulls.append((vw.leg_pushes_sent, required))
      return
    self._push_event(max(t, vw.last_push_arrival), _PULL_REQUEST, vw.vw_id, required)

  def _send_pull_reply(self, v: int, t: float) -> None:
    """The PS answers VW ``v``'s pull at ``t``: the reply carries the weights' vector clock (or, when no one reads
    it, only their global clock)."""
    if self._vector_clocks:
      reply = self.ps.vector_clock()
      hook = self.hooks["on_pull_sent"]
      if hook is not None:
        hook(v, reply, t)
    else:
      reply = self.ps.global_clock
    times = self.vws[v].times
    self._send_ps_transfer(t, times.pull_s, times.pull_legs, _PULL_REPLY, v, reply)

  def _try_inject(self, vw: _VW, t: float) -> None:
    """Runs the VW's injection step (``wsp.injection_step``) and accounts for its outcome at time ``t``."""
    injected, pull, waiting = wsp.injection_step(vw.rules, vw.sync, vw.total)
    if pull is not None:
      self._request_pull(vw, pull, t)
    if waiting:
      if vw.wait_since is None:
        vw.wait_since = t
      return
    if not injected:
      return
    if vw.wait_since is not None:
      vw.wait_s += t - vw.wait_since
      if self._records:
        self._ps_waits.append((vw.vw_id, vw.wait_since, t))
      vw.wait_since = None
    if vw.active == 0 and vw.idle_since is not None:
      vw.idle_s += t - vw.idle_since
      vw.idle_since = None
    vw.active += len(injected)
    on_inject = self._on_inject
    if self._records:
      rules, sync = vw.rules, vw.sync
      for p in injected:
        vw.records[p] = MinibatchRecord(vw.vw_id, p, wsp.wave_of(p, rules.num_inflight), sync.local_clock,
                                        vw.version_id, rules.num_completed, sync.weights_global_clock,
                                        vw.vector_clock, t)
    if on_inject is not None:
      for p in injected:
        on_inject(vw.vw_id, p, t)
    rules, q = vw.rules, vw.gpus[0].queue
    if not vw.fifo:  # a static order (or memory caps) starts what stage 0's rules allow (the caller dispatches)
      while rules.has_ready(0):
        q.append(rules.pop_ready(0))
      return
    for _ in injected:  # each injection made one task ready on stage 0 (the ready queues were empty)
      q.append(rules.pop_ready(0))

  def _dispatch_all(self, vw: _VW) -> None:
    """Hands every ready task to its stage's device queue (``pop_ready``, FIFO, as the runtime hands it to the
    stage's executor)."""
    rules, gpus = vw.rules, vw.gpus
    for s in range(vw.num_stages):
      q = gpus[s].queue
      while rules.has_ready(s):
        q.append(rules.pop_ready(s))

  def _start_ready(self, vw: _VW, t: float, stages) -> None:
    """Starts the head of each free device's queue among ``stages`` (ascending), whose ready tasks are dispatched.

    Between events every ready task is dispatched and every free device's queue is empty, and an event changes only
    the stages it names here (the one a task ended on, the one its successor became ready on, stage 0 after
    injections), so starting those in stage order is starting every stage in stage order.
    """
    gpus = vw.gpus
    start = self._start
    for s in stages:
      gpu = gpus[s]
      if gpu.task is None and gpu.queue:
        start(vw.vw_id, gpu, gpu.queue.popleft(), t)

  def _start(self, v: int, gpu: _GPU, task: Task, t: float) -> None:
    """Starts ``task`` on VW ``v``'s free device ``gpu`` at ``t``: its end (or, with an inter-node output, its
    send) becomes an event."""
    gpu.task = task
    gpu.started = t
    if task.kind is _BACKWARD:
      d, leg = gpu.dur_bwd, gpu.leg_bwd
    else:
      d, leg = gpu.dur_fwd, gpu.leg_fwd
    if self._jitter is not None:  # the compute part only: sends keep their times
      draw, mu, sigma = self._jitter
      d += (gpu.comp_bwd if task.kind is _BACKWARD else gpu.comp_fwd) * (draw(mu, sigma) - 1.0)
    if leg is None:
      _heappush(self._heap, (t + d, self._next_seq(), _TASK_END, v, gpu))
    else:  # compute, then the output's inter-node send through the NICs (a _SEND event)
      _heappush(self._heap, (t + (d - leg.seconds), self._next_seq(), _SEND, v, gpu))
    if self._on_task_start is not None:
      self._on_task_start(v, task, t)

  def _complete_minibatch(self, vw: _VW, p: int, t: float) -> None:
    vw.completions.append(t)
    vw.version_id += 1
    if self._records:
      vw.records[p].complete_time_s = t
    hook = self._on_minibatch_complete
    if hook is not None:
      hook(vw.vw_id, p, t)
    wave, pull = vw.sync.on_minibatch_complete(p)
    if wave is not None and self.reducer is not None:
      hook = self._on_wave_end
      if hook is not None:
        hook(vw.vw_id, wave, t)
      self._enter_allreduce(vw, wave, t)
      self._advance_clock(wave, t)
      return
    if wave is not None:
      hook = self._on_wave_end
      if hook is not None:
        hook(vw.vw_id, wave, t)
      vw.num_pushes += 1
      arrival = self._send_ps_transfer(t, vw.times.push_s, vw.times.push_legs, _PUSH_ARRIVAL, vw.vw_id, wave)
      if arrival is None:
        vw.leg_pushes_sent += 1
      else:
        vw.last_push_arrival = arrival
      self._advance_clock(wave, t)
    if pull is not None:
      self._request_pull(vw, pull, t)

  def _enter_allreduce(self, vw: _VW, step: int, t: float) -> None:
    """VW ``vw`` enters the all-reduce of ``step``; when it is the last, every VW's update lands after the
    reduction (``allreduce_s``)."""
    vw.reduce_entered = t
    vw.num_pushes += 1
    if not self.reducer.enter(vw.vw_id, step):
      return
    hook = self.hooks["on_allreduce"]
    if hook is not None:
      hook(step, t)
    done = t + self.allreduce_s
    for w in self.vws:
      self._push_event(done, _REDUCED, w.vw_id, step)

  def _advance_clock(self, old: int, t: float) -> None:
    counts = self._clock_counts
    counts[old] -= 1
    counts[old + 1] += 1
    if old + 1 > self._max_clock:
      self._max_clock = old + 1
    while counts[self._min_clock] == 0:
      self._min_clock += 1
    d = self._max_clock - self._min_clock
    if d > self._max_distance:
      self._max_distance = d
    self._clock_samples.append((t, d, self._min_clock, self._max_clock))

  # ------------------------------------------------------------------ main loop
  def run(self) -> EngineReport:
    """Processes every event; returns the report.

    Raises:
      RuntimeError: the run stalled with minibatches left (a rule deadlock; the message names the VW's state).
    """
    wall0 = time.perf_counter()
    for vw in self.vws:
      self._try_inject(vw, 0.0)
      self._dispatch_all(vw)
      self._start_ready(vw, 0.0, range(vw.num_stages))
    heap, vws, records, ps = self._heap, self.vws, self.config.records, self.ps
    task_events = self._task_events
    heappop = heapq.heappop
    start_ready, start_task, next_seq = self._start_ready, self._start, self._next_seq
    vector_clocks = self._vector_clocks
    while heap:
      t, _, code, v, arg = heappop(heap)
      vw = vws[v]
      if code == _TASK_END:
        gpu = arg
        task = gpu.task
        gpu.task = None
        start = gpu.started
        gpu.busy_s += t - start
        gpu.num_tasks += 1
        if records:
          task_events.append((v, task, start, t))
        rules = vw.rules
        num_completed = rules.num_completed
        new = rules.complete(task)
        if not vw.fifo:  # static order / caps: only the task's stage, its successor's and (injections) stage 0 change
          vw.active += len(new) - 1
          changed = {gpu.stage_id}
          if rules.num_completed != num_completed:
            self._complete_minibatch(vw, task.minibatch_id, t)
            self._try_inject(vw, t)
            changed.add(0)
          if vw.active == 0 and rules.num_completed < vw.total:
            vw.idle_since = t
          for nt in new:
            changed.add(nt.stage_id)
          changed = sorted(changed)
          for cs in changed:
            q = vw.gpus[cs].queue
            while rules.has_ready(cs):
              q.append(rules.pop_ready(cs))
          start_ready(vw, t, changed)
          continue
        if new and rules.num_completed == num_completed:  # the output moves on (a task has at most one successor)
          ns = new[0].stage_id
          successor = vw.gpus[ns]
          nt = rules.pop_ready(ns)  # its only ready task (every other one was dispatched)
          q = gpu.queue
          if successor.task is not None:  # busy: the task waits in its queue; this device starts its queue's head
            successor.queue.append(nt)
            if q:
              start_task(v, gpu, q.popleft(), t)
          elif q and gpu.stage_id < ns:  # both start, in stage order (a free device's queue is empty)
            start_task(v, gpu, q.popleft(), t)
            start_task(v, successor, nt, t)
          else:
            start_task(v, successor, nt, t)
            if q:
              start_task(v, gpu, q.popleft(), t)
          continue
        vw.active += len(new) - 1
        if rules.num_completed != num_completed:  # the task completed its minibatch (schedule.completes_minibatch)
          self._complete_minibatch(vw, task.minibatch_id, t)
          self._try_inject(vw, t)
        if vw.active == 0 and rules.num_completed < vw.total:
          vw.idle_since = t
        if new or gpu.stage_id:
          self._dispatch_all(vw)
          start_ready(vw, t, range(vw.num_stages))
        else:  # stage 0 completed a minibatch: only stage 0 changed (its device, its injections)
          start_ready(vw, t, _STAGE_0)
      elif code == _SEND:  # a task's compute ended; its output's inter-node send goes through the NICs
        gpu = arg
        leg = gpu.leg_bwd if gpu.task.kind is _BACKWARD else gpu.leg_fwd
        _heappush(heap, (self.nic.leg_end(t, leg), next_seq(), _TASK_END, v, gpu))
      elif code == _LEG:  # leg i of a PS transfer is ready at t: through the NICs, then the next leg or arrival
        legs, i, final, final_arg = arg
        end = self.nic.leg_end(t, legs[i])
        if i + 1 < len(legs):
          _heappush(heap, (end, next_seq(), _LEG, v, (legs, i + 1, final, final_arg)))
        else:
          _heappush(heap, (end, next_seq(), final, v, final_arg))
      elif code == _PUSH_ARRIVAL:
        hook = self.hooks["on_push"]
        if hook is not None:
          hook(v, arg, t)
        clock = ps.global_clock
        ps.push(v, arg)
        if ps.global_clock != clock:  # pending pulls wait for a larger global clock: only now can one be served
          for w in ps.serve_pending_pulls():
            self._send_pull_reply(w, t)
        if vw.leg_pushes_arrived < vw.leg_pushes_sent:  # a push that went leg by leg (they arrive in order)
          vw.leg_pushes_arrived += 1
          deferred = vw.deferred_pulls
          while deferred and deferred[0][0] <= vw.leg_pushes_arrived:  # pull requests sent behind it go now
            self._push_event(t, _PULL_REQUEST, v, deferred.popleft()[1])
      elif code == _PULL_REQUEST:
        if ps.request_pull(v, arg):
          self._send_pull_reply(v, t)
      elif code == _REDUCED:  # the all-reduced update of step ``arg`` is applied on VW v
        hook = self.hooks["on_reduced"]
        if hook is not None:
          hook(v, arg, t)
        vw.sync.on_reduced(arg)
        vw.wait_s += t - vw.reduce_entered
        if records:
          self._ps_waits.append((v, vw.reduce_entered, t))
        vw.version_id += 1
        vw.num_pulls += 1
        self._try_inject(vw, t)
        self._dispatch_all(vw)
        start_ready(vw, t, range(vw.num_stages))
      else:  # _PULL_REPLY: arg is the reply's vector clock (its global clock alone when none is kept)
        hook = self.hooks["on_pull_reply"]
        if hook is not None:
          hook(v, arg, t)
        vw.sync.on_pull_reply(min(arg) if vector_clocks else arg)
        # Read by the records only, which keep vector clocks (without them, arg is the global clock, never read).
        vw.vector_clock = arg
        vw.version_id += 1
        vw.num_pulls += 1
        self._try_inject(vw, t)
        start_ready(vw, t, _STAGE_0)
    for vw in vws:
      if vw.rules.num_completed < vw.total:
        if self.reducer is not None:
          raise RuntimeError(f"[VW {vw.vw_id}] stalled after {vw.rules.num_completed}/{vw.total} micro-batches: "
                             f"local clock {vw.sync.local_clock}, steps applied {vw.sync.applied_steps}, "
                             f"all-reduce entered {self.reducer.entered}")
        raise RuntimeError(f"[VW {vw.vw_id}] stalled after {vw.rules.num_completed}/{vw.total} minibatches: local "
                           f"clock {vw.sync.local_clock}, weights global clock {vw.sync.weights_global_clock}, "
                           f"PS global clock {self.ps.global_clock}, pending pulls {self.ps.pending_pulls}")
    num_events = next_seq() - 1  # every event created was processed
    return self._report(num_events, time.perf_counter() - wall0)

  def _report(self, num_events: int, wall_s: float) -> EngineReport:
    nm = self.config.num_inflight
    makespan = max(vw.completions[-1] for vw in self.vws)
    per_vw, total_steady, window = engine_report.steady_rates([vw.completions for vw in self.vws], nm,
                                                              warmup_waves=1)
    total_plain = sum(vw.total for vw in self.vws) / makespan if makespan > 0 else float("inf")
    if total_steady != total_steady:  # NaN: no common steady window
      total_steady = total_plain
    vws, gpus = [], []
    for vw, rate in zip(self.vws, per_vw):
      last = vw.completions[-1]
      vws.append(VWReport(vw.vw_id, vw.total, rate, vw.total / last if last > 0 else float("inf"),
                          vw.completions[nm - 1], last, vw.wait_s, vw.idle_s, vw.num_pushes, vw.num_pulls,
                          list(vw.rules.peak_held)))
      for s in range(vw.num_stages):
        gpu = vw.gpus[s]
        gpus.append(GPUReport(vw.vw_id, s, self.gpu_ids[vw.vw_id][s], gpu.num_tasks, gpu.busy_s,
                              gpu.busy_s / makespan if makespan > 0 else 0.0))
    records, events = [], []
    if self.config.records:
      records = [r for vw in self.vws for _, r in sorted(vw.records.items())]
      events = [TaskEvent(v, str(task), task.stage_id, task.minibatch_id, task.minibatch_id // nm, start, end)
                for v, task, start, end in self._task_events]
    config = dict(dataclasses.asdict(self.config), num_vws=len(self.vws),
                  num_stages=[vw.num_stages for vw in self.vws])
    return EngineReport(
        config=config, makespan_s=makespan, total_minibatches_per_s=total_steady,
        total_minibatches_per_s_plain=total_plain, steady_window_s=window, vws=vws, gpus=gpus,
        final_global_clock=self.ps.global_clock if self.reducer is None else self.reducer.reduced_steps,
        max_clock_distance=self._max_distance,
        clock_distance_samples=self._clock_samples, ps_applied=list(self.ps.applied) if self.config.records else [],
        ps_waits=list(self._ps_waits), minibatch_records=records, task_events=events, num_events=num_events,
        engine_wall_s=wall_s, nic_busy_s={node: tuple(b) for node, b in sorted(self.nic.busy_s.items())})


def run(task_times: Sequence[VWTaskTimes], config: EngineConfig, hooks: Any = None,
        gpu_ids: Sequence[Sequence[str]] | None = None,
        sync_states: Sequence[wsp.VWSyncState] | None = None) -> EngineReport:
  """Builds an :class:`Engine` and runs it (see the module docstring for semantics and hook order)."""
  return Engine(task_times, config, hooks, gpu_ids, sync_states).run()
