"""A virtual worker: pipelined model parallelism over its stages, one weight version per minibatch (HetPipe §4–§5).

Runtime layer. One :class:`VirtualWorker` per VW. Two parts: the *driver* (:func:`hetpipe_jax.runtime.vw_driver.run`,
called by :meth:`VirtualWorker.run`: the MPI runtime's event loop) makes every rule decision through
:mod:`hetpipe_jax.rules.schedule` and :mod:`hetpipe_jax.rules.wsp` and is the one caller of the VW's
:class:`~hetpipe_jax.rules.wsp.VWSyncState` transitions; the *actions* here, :meth:`~VirtualWorker.inject`,
:meth:`~VirtualWorker.dispatch`, :meth:`~VirtualWorker.complete_minibatch`, :meth:`~VirtualWorker.end_wave` and
:meth:`~VirtualWorker.install_pull`, carry the decisions out on real tensors and never advance ``sync`` (they only
read it). In virtual time the event engine is the driver instead: it advances the VW's ``sync`` (the same object)
and calls the actions from its hooks (:mod:`hetpipe_jax.runtime.virtual_time`).

Weight versions: minibatch p is injected with the VW's current :class:`~hetpipe_jax.runtime.vw_state.WeightVersion`
(immutable per-stage params on each stage's device) and uses it on every stage; old versions are freed by reference
counting once no in-flight minibatch holds them. When the weights change is the *update rule*'s (``update``, one
object per VW, :mod:`hetpipe_jax.runtime.update_rules`): HetPipe's per-minibatch rule, PipeDream's per-stage rule
or the flush methods' all-reduced step, chosen by the method's ``update`` field in the
:mod:`hetpipe_jax.rules.methods` table through :data:`UPDATE_RULES`. Where the stages run is the *placement*'s
(``placement``, :mod:`hetpipe_jax.runtime.placement`): all in this process, or some on stage ranks (the driver's
object holds its local stages only, ``local_stages``; the others' entries in versions and optimizer states are None,
and the placement sends every version change to their ranks). The VW composes the two; neither is a base class.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hetpipe_jax.rules import methods
from hetpipe_jax.rules import wsp
from hetpipe_jax.rules.records import MinibatchRecord, ShardedMinibatchRecord
from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.runtime import opt_state
from hetpipe_jax.runtime import optimizers
from hetpipe_jax.runtime import vw_driver
from hetpipe_jax.runtime import grad_clip
from hetpipe_jax.runtime.flush_step import FlushUpdate
from hetpipe_jax.runtime.minibatch_update import PerMinibatchUpdate
from hetpipe_jax.runtime.param_layout import ParamLayout
from hetpipe_jax.runtime.pipedream_updates import PerStageUpdate
from hetpipe_jax.runtime.placement import ALL_LOCAL
from hetpipe_jax.runtime.ps_channel import PSChannel
from hetpipe_jax.runtime.stages import Stage
from hetpipe_jax.runtime.update_rules import UpdateRule, UpdateSettings
from hetpipe_jax.runtime.vw_state import (  # noqa: F401 (re-exported: the VW's types)
    InFlightMinibatch, PSClient, VWStats, WeightVersion, host_copy)

# The update rule of each value of the methods table's ``update`` field (rules/methods.py).
UPDATE_RULES: dict[str, type[UpdateRule]] = {
    "minibatch": PerMinibatchUpdate,
    "stage": PerStageUpdate,
    "flush": FlushUpdate,
}


def update_rule_class(method: str) -> type[UpdateRule]:
  """The update-rule class of method ``method`` (as torch pipelining's ``get_schedule_class``).

  Raises:
    ValueError: unknown method.
  """
  return UPDATE_RULES[methods.get_method(method).update]


@dataclasses.dataclass(frozen=True)
class WSPSettings:
  """The VW's place in the synchronisation across VWs (HetPipe §5; the flush methods' all-reduce BSP uses
  ``vw_id``, ``num_virtual_workers`` and ``num_inflight`` = M, and checks ``staleness_bound >= 0``).

  Attributes:
    vw_id: 0-based VW index, in ``[0, num_virtual_workers)``.
    num_virtual_workers: N, the length of the pulled weights' vector clocks.
    num_inflight: Nm >= 1 (flush methods: M micro-batches per step).
    staleness_bound: D >= 0.
    pull_every_wave: also pull (without waiting) at every wave end; False pulls only when the bound forces it.
  """

  vw_id: int
  num_virtual_workers: int
  num_inflight: int
  staleness_bound: int = 0
  pull_every_wave: bool = True


@dataclasses.dataclass(frozen=True)
class VWHooks:
  """What the VW reads from and reports to.

  Attributes:
    get_minibatch: ``minibatch_id -> (images [b, ...] float32, labels [b] int32)`` numpy arrays, or with a third,
      the examples' ids (int ``[b]``, recorded in the minibatch's ``example_ids``). None on a stage rank.
    ps: the parameter-server client (None: the flush methods, a stage rank).
    ps_shards: sharded parameter servers (:class:`hetpipe_jax.ps.shards.ShardLayout`): pulls then carry one vector
      clock per shard and the VW re-adds its own waves shard by shard; None: one PS.
    on_minibatch: optional callback ``(MinibatchRecord) -> None`` for each completed minibatch, called at its
      wave's end (when the wave's losses are read back).
    corrupt_update: fault drills only: ``(wave_id, flat update) -> None`` may alter a wave's update before it is
      pushed (``config.debug_nan_update`` puts a NaN in one, which the PS must refuse).
  """

  get_minibatch: Callable[[int], tuple[np.ndarray, ...]] | None = None
  ps: PSClient | None = None
  ps_shards: Any = None
  on_minibatch: Callable[[MinibatchRecord], None] | None = None
  corrupt_update: Callable[[int, np.ndarray], None] | None = None


@dataclasses.dataclass(frozen=True)
class HostSettings:
  """How this host runs the VW: emulated devices and the driver's threads.

  Attributes:
    task_time_s: emulated devices: ``Task -> seconds`` the task should take on the GPU its stage stands in for
      (compute + sending its output). A task is then observed done no earlier than its emulated start
      (``max(dispatch, previous emulated end on the stage)``) plus that duration, so the VW runs like the mixed
      cluster in wall time; real work that takes longer is counted in ``VWStats.num_overruns`` / ``overrun_s``.
    poll_interval_s: the longest the scheduler blocks waiting for a completion before polling the PS again.
    ps_channel: ``"thread"``: where the VW can (:attr:`VirtualWorker.ps_channel_mode`), its wave pushes and pulls
      run on a PS channel thread during :meth:`VirtualWorker.run` (:mod:`hetpipe_jax.runtime.ps_channel`), else
      inline; ``"inline"``: on the scheduler thread always (tests and benchmarks compare the two).
  """

  task_time_s: Callable[[Task], float] | None = None
  poll_interval_s: float = 1e-3
  ps_channel: str = "thread"


class VirtualWorker:
  """Runs one VW's pipeline for a fixed number of minibatches.

  Args:
    stages: built by :func:`hetpipe_jax.runtime.stages.build_stages`.
    layout: flat weight layout shared with the PS.
    initial_layer_params: per-layer host params (the global initial weights W0).
    wsp: the VW's index, N, Nm, D and pulls (:class:`WSPSettings`).
    update: the method, optimizer and update-rule options (:class:`~hetpipe_jax.runtime.update_rules.
      UpdateSettings`); the rule is :func:`update_rule_class`'s.
    hooks: data, PS client and callbacks (:class:`VWHooks`).
    placement: :data:`~hetpipe_jax.runtime.placement.ALL_LOCAL`, or a :class:`~hetpipe_jax.runtime.placement.
      LinkedStages` (stage ranks; HetPipe's rule only).
    host: emulated task times, polling and the PS channel (:class:`HostSettings`).

  Raises:
    ValueError: ``num_inflight < 1``, ``staleness_bound < 0``, ``vw_id`` not in ``[0, num_virtual_workers)``,
      ``ps_channel`` not ``"thread"`` / ``"inline"``, an option the method's update rule does not take (or a
      missing reducer for the flush methods), stage ranks with a rule that does not run them, or stages that clip
      to different norms.
  """

  def __init__(self, stages: Sequence[Stage], layout: ParamLayout, initial_layer_params: Sequence[Any],
               wsp: WSPSettings, update: UpdateSettings, hooks: VWHooks = VWHooks(), placement: Any = ALL_LOCAL,
               host: HostSettings = HostSettings()):
    self.method = methods.get_method(update.method)
    if host.ps_channel not in ("thread", "inline"):
      raise ValueError(f"ps_channel must be 'thread' or 'inline', got {host.ps_channel!r}")
    if not 0 <= wsp.vw_id < wsp.num_virtual_workers:
      raise ValueError(f"vw_id={wsp.vw_id} must be in [0, num_virtual_workers={wsp.num_virtual_workers})")
    self.vw_id = wsp.vw_id
    self.num_virtual_workers = wsp.num_virtual_workers
    self.num_inflight = wsp.num_inflight
    self.staleness_bound = wsp.staleness_bound
    self.stages = list(stages)
    self.layout = layout
    self.placement = placement
    # the stages this process runs (stage ranks: the others' entries below are None)
    self.local_stages = [s for s in range(len(self.stages)) if placement.is_local(s)]
    self.optimizer = update.optimizer
    self.get_minibatch = hooks.get_minibatch
    self.ps = hooks.ps
    self.ps_shards = hooks.ps_shards
    self.on_minibatch = hooks.on_minibatch
    self.corrupt_update = hooks.corrupt_update
    self.task_time_s = host.task_time_s
    self.poll_interval_s = host.poll_interval_s
    clip_norms = {st.grad_clip_norm for st in self.stages}
    if len(clip_norms) != 1:
      raise ValueError(f"the stages clip gradients to different global norms {sorted(clip_norms)}: build them together")
    self.grad_clip_norm = clip_norms.pop()  # > 0: clip by the minibatch's global norm over every stage (grad_clip)
    self.update = update_rule_class(update.method)(self, update)  # validates the rule's options
    if not (placement.all_local or self.update.supports_stage_ranks):
      raise ValueError(f"stage ranks run HetPipe's pipeline, not {update.method!r}")
    self.sync = self.update.new_sync(wsp.num_inflight, wsp.staleness_bound, wsp.pull_every_wave)  # validates Nm, D
    ps = hooks.ps
    self.ps_channel = (PSChannel(self) if host.ps_channel == "thread" and self.update.supports_ps_channel
                       and ps is not None and hooks.ps_shards is None and placement.all_local
                       and getattr(ps, "serves_other_threads", True) else None)
    local = set(self.local_stages)
    params = tuple(self._place_stage(initial_layer_params, st) if s in local else None
                   for s, st in enumerate(self.stages))
    # Constant outputs (Adam's step count, zeros) are not committed by jit: place them explicitly.
    self.opt_states = [jax.device_put(jax.jit(optimizers.for_layers(self.optimizer, *st.layer_range).init)(p),
                                      st.device) if p is not None else None
                       for st, p in zip(self.stages, params)]
    self.zeros = [jax.device_put(jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t))(p), st.device)
                  if p is not None else None for st, p in zip(self.stages, params)]
    # Per local stage, a zero norm on its device: the update's norm argument when clipping is off.
    self.zero_norms = [jax.device_put(np.float32(0.0), st.device) if p is not None else None
                       for st, p in zip(self.stages, params)]
    # Compile the update, the rebase and a wave's ravel / a pull's unravel now, not at the first completion, wave end
    # or pull (a stall inside wave 1); then the rule's own programs.
    jax.block_until_ready([(st.update(p, o, z, z, n), st.add(p, z), st.sq_norm(z) if self.grad_clip_norm else n,
                            st.unravel(st.ravel(z), z))
                           for st, p, o, z, n in zip(self.stages, params, self.opt_states, self.zeros,
                                                     self.zero_norms) if p is not None])
    self.update.compile(params)
    self.version = WeightVersion(params, 0, (0,) * self.num_virtual_workers, 0)
    self.update.reset()
    self.records: list[MinibatchRecord] = []
    # (task, start, end) in seconds since the run's start: the span on the emulated device when emulated, else from
    # the dispatch to the posted completion
    self.task_log: list[tuple[str, float, float]] = []
    self.stats = VWStats()
    self._wave_losses: list = []  # (record, loss array) of the current wave
    self._prefetched: dict[int, tuple] = {}  # minibatch -> its data, read ahead of its injection (prefetch)

  @property
  def ps_channel_mode(self) -> str:
    """``"thread"`` when the wave pushes and pulls of :meth:`run` go through a PS channel thread, else ``"inline"``:
    requested (``ps_channel``), an update rule that supports it (HetPipe's) with one PS (its client usable from
    another thread: an MPI client needs MPI_THREAD_SERIALIZED or more) and every stage in this process."""
    return "inline" if self.ps_channel is None else "thread"

  @property
  def max_held(self) -> list[int] | None:
    """Per stage, the most minibatches it may hold (the update rule's memory caps), or None."""
    return self.update.max_held

  # ---------------------------------------------------------------- shared helpers (the update rules use them)
  def _place_stage(self, layer_params: Sequence[Any], st: Stage):
    start, end = st.layer_range
    return jax.device_put(host_copy(list(layer_params[start:end])), st.device)

  def new_version(self, params, *, local_updates=None, vector_clock=None,
                  shard_vector_clocks=None) -> WeightVersion:
    """The next :class:`WeightVersion` with per-stage ``params`` (fields not given: the current version's; a new
    vector clock replaces the shard clocks too)."""
    v = self.version
    return WeightVersion(tuple(params), v.local_updates if local_updates is None else local_updates,
                         v.vector_clock if vector_clock is None else tuple(vector_clock), v.version_id + 1,
                         v.shard_vector_clocks if vector_clock is None else shard_vector_clocks)

  def minibatch_grad_norm(self, mb: InFlightMinibatch) -> float:
    """Minibatch ``mb``'s global gradient norm over every stage (:mod:`hetpipe_jax.runtime.grad_clip`): the local
    stages' squared norms computed here, the remote stages' as their ranks reported them (stage ranks), added in
    stage order.

    Raises:
      FloatingPointError: the norm is NaN or Inf.
    """
    parts = dict(zip(self.local_stages, jax.device_get([self.stages[s].sq_norm(mb.grads[s])
                                                        for s in self.local_stages])))
    others = [s for s in range(len(self.stages)) if s not in parts]
    if others:  # stage ranks: reported with their backwards' completions
      parts.update(zip(others, self.placement.sq_norms(mb.record.minibatch_id, others)))
    return grad_clip.global_norm([parts[s] for s in range(len(self.stages))])

  def placed_norms(self, norm: float | None) -> list:
    """Per stage, the update's norm argument on its device (None for remote stages): ``norm`` when clipping, else
    zero.

    Raises:
      ValueError: clipping and ``norm`` is None.
    """
    if not self.grad_clip_norm:
      return self.zero_norms
    if norm is None:
      raise ValueError(f"[VW {self.vw_id}] clipping by the global norm needs the minibatch's norm")
    placed = jax.device_put([np.float32(norm)] * len(self.local_stages),
                            [self.stages[s].device for s in self.local_stages])
    out = [None] * len(self.stages)
    for s, x in zip(self.local_stages, placed):
      out[s] = x
    return out

  def flat_of(self, stage_ids: Sequence[int], trees: Sequence[Any]) -> np.ndarray:
    """Stages ``stage_ids``' params-shaped device trees ``trees`` as one float32 host vector (their layers in stage
    order, :class:`ParamLayout`'s order): each stage ravels its tree on its device, then one transfer per stage (not
    one per leaf, and no flattening on the host)."""
    parts = jax.device_get([self.stages[s].ravel(t) for s, t in zip(stage_ids, trees)])
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)

  def stage_params_of(self, s: int, flat: np.ndarray) -> Any:
    """Stage ``s``'s weights from a float32 host vector (the full model, or exactly the stage's layers), placed on its
    device as one buffer and cut into its params tree there (``Stage.unravel``).

    Raises:
      ValueError: ``flat`` is neither the full model nor the stage's layers.
    """
    start, end = self.stages[s].layer_range
    offsets = self.layout.layer_offsets
    if flat.size == self.layout.num_params:
      flat = flat[offsets[start]:offsets[end]]
    elif flat.size != offsets[end] - offsets[start]:
      raise ValueError(f"[VW {self.vw_id}] stage {s} holds {offsets[end] - offsets[start]} floats, got {flat.size}")
    st = self.stages[s]
    if st.device.platform == "cpu":  # a CPU device array may alias its numpy buffer
      flat = host_copy(flat)
    return st.unravel(jax.device_put(flat, st.device), self.zeros[s])

  def place_pulled(self, flat: np.ndarray) -> list:
    """Per stage, its slice of pulled global weights ``flat`` (float32 ``[num_params]``) placed on its device as its
    params tree (:meth:`stage_params_of`); None for a stage not in this process. The PS channel thread prepares a
    reply's install with it (:mod:`hetpipe_jax.runtime.ps_channel`)."""
    out = [None] * len(self.stages)
    for s in self.local_stages:
      out[s] = self.stage_params_of(s, flat)
    return out

  def take_wave_losses(self) -> list:
    """The current wave's ``(record, loss array)`` pairs; the wave's list starts empty again."""
    losses, self._wave_losses = self._wave_losses, []
    return losses

  def push_wave(self, wave_id: int, trees: Sequence[Any], wave_losses: list) -> None:
    """Pushes wave ``wave_id`` to the one PS: its losses read back (:meth:`read_losses`), its summed delta
    (``trees``: per stage, on its device) brought to the host, the fault drill's hook, the push. Inline, or on the
    PS channel thread (:mod:`hetpipe_jax.runtime.ps_channel`): it reads no state the scheduler changes.

    Raises:
      FloatingPointError: a loss of the wave is NaN or Inf.
    """
    loss_sum = self.read_losses(wave_losses)
    flat = self.flat_of(range(len(self.stages)), trees)
    if self.corrupt_update is not None:  # fault drills only (config.debug_nan_update)
      self.corrupt_update(wave_id, flat)
    self.ps.push(wave_id, flat, loss_sum, self.num_inflight)

  def read_losses(self, wave_losses: list | None = None) -> float:
    """Reads a wave's (step's) losses back into their records and calls ``on_minibatch`` on each; returns their sum.

    Args:
      wave_losses: the wave's ``(record, loss array)`` pairs; None: the current wave's (then cleared).

    Raises:
      FloatingPointError: a loss is NaN or Inf.
    """
    if wave_losses is None:
      wave_losses = self.take_wave_losses()
    losses = jax.device_get([loss for _, loss in wave_losses])
    loss_sum = 0.0
    for (rec, _), loss in zip(wave_losses, losses):
      rec.loss = float(loss)
      if not np.isfinite(rec.loss):
        raise FloatingPointError(f"[VW {self.vw_id}] loss is {rec.loss} at minibatch {rec.minibatch_id}: "
                                 "training diverged; lower config.learning_rate")
      loss_sum += rec.loss
      if self.on_minibatch is not None:
        self.on_minibatch(rec)
    return loss_sum

  # ---------------------------------------------------------------- the run
  def run(self, num_minibatches: int, *, completion_log: list | None = None) -> VWStats:
    """Trains ``num_minibatches`` (a multiple of Nm) and returns the VW's stats: :func:`hetpipe_jax.runtime.vw_driver.
    run` (its arguments and errors)."""
    self._prefetched.clear()  # minibatch ids are the run's (a segment's run starts at 0 again)
    return vw_driver.run(self, num_minibatches, completion_log=completion_log)

  # ---------------------------------------------------------------- the actions
  def prefetch(self, p: int) -> None:
    """Reads minibatch ``p`` and places it on its stages' devices ahead of its injection (the scheduler does so
    for the next minibatch while it waits, so a new minibatch's first task is not held up by reading it)."""
    if p not in self._prefetched:
      self._prefetched[p] = self._load(p)

  def _load(self, p: int):
    """Minibatch ``p``: ``(host labels, images on stage 0's device, labels on the last stage's device or None,
    example ids or None)``."""
    data = self.get_minibatch(p)
    images, labels = data[0], data[1]
    ids = [int(i) for i in data[2]] if len(data) > 2 else None
    x = jax.device_put(images, self.stages[0].device)
    y = jax.device_put(labels, self.stages[-1].device) if self.placement.is_local(len(self.stages) - 1) else None
    return labels, x, y, ids

  def inject(self, p: int, now: float) -> InFlightMinibatch:
    """Starts minibatch ``p`` on the current weight version (the update rule's ``on_inject`` may choose another);
    ``now`` is its injection time in seconds."""
    loaded = self._prefetched.pop(p, None)
    labels, x, y, ids = loaded if loaded is not None else self._load(p)
    v = self.version
    fields = (self.vw_id, p, wsp.wave_of(p, self.num_inflight), self.sync.local_clock, v.version_id,
              v.local_updates, v.global_clock, v.vector_clock, now)
    if self.ps_shards is None:
      rec = MinibatchRecord(*fields)
    else:
      rec = ShardedMinibatchRecord(*fields, version_shard_vector_clocks=v.shard_vector_clocks or
                                   (v.vector_clock,) * self.ps_shards.num_shards)
    v = self.update.on_inject(rec, v)
    rec.example_ids = ids
    self.records.append(rec)
    # stage ranks: every stage rank learns p's version; the last stage's rank gets the labels
    self.placement.on_inject(p, v.version_id, labels)
    return InFlightMinibatch(v, x, y, {0: x}, {}, {}, {}, record=rec)

  def dispatch(self, task: Task, mb: InFlightMinibatch):
    """Dispatches ``task``; returns an array that is ready when its output has reached its consumer.

    Called on the stage's executor thread; it touches only this task's entries of ``mb``. A forward runs on the
    weights the update rule gives (``forward_params``: the minibatch's version; PipeDream: the stage's own); a
    backward's parameter gradients go to the rule (``on_backward``) before its input gradient leaves, so a
    minibatch's update finds them on every stage. Stage ranks: a remote stage's task is a command to its rank
    (returns None; the thread that started the task sends it); an input from, or an output to, a stage on another
    rank goes through the placement's link (the returned marker is ready once it has been received).
    """
    s = task.stage_id
    st = self.stages[s]
    placement = self.placement
    if not placement.is_local(s):
      placement.start_task(task, mb.version.version_id,
                           self.task_time_s(task) if self.task_time_s is not None else None)
      return None
    if task.kind is TaskKind.BACKWARD:
      grad_out = placement.take_gradient(task, mb, st.device)
      gp, gx = st.backward(mb.residuals.pop(s), grad_out)
      done = self.update.on_backward(s, mb, gp)
      if s == 0:
        leaves = jax.tree.leaves(done)
        return leaves[0] if leaves else grad_out  # a parameter-free stage 0 has nothing left to compute
    else:
      params = self.update.forward_params(s, mb)
      x = placement.take_activation(task, mb, st.device)
      if task.kind is TaskKind.FORWARD:
        out, vjp = st.forward(params, x)
        mb.residuals[s] = vjp
        return placement.send_activation(task, mb, out, self.stages[s + 1].device)
      loss, gp, gx = st.forward_backward(params, x, mb.labels)
      mb.loss = loss
      self.update.on_backward(s, mb, gp)
      if s == 0:
        return loss
    return placement.send_gradient(task, mb, gx, self.stages[s - 1].device)

  def complete_minibatch(self, mb: InFlightMinibatch, now: float) -> None:
    """Minibatch p's last task completed: the update rule's step (HetPipe: a new weight version on every stage, its
    delta added to the wave's), then p's record is complete.

    An action: the driver then advances ``sync`` (``on_minibatch_complete``) and, at a wave end, calls
    :meth:`end_wave`.
    """
    self.update.on_complete(mb)
    rec = mb.record
    rec.complete_time_s = now
    self._wave_losses.append((rec, mb.loss))  # read back once per wave, not once per minibatch

  def end_wave(self, wave_id: int) -> bool:
    """Wave ``wave_id`` ended: the update rule pushes its update to the PS (and keeps it until the PS holds it), or
    (flush methods) hands the step's gradients and loss sum to the reducer.

    Returns:
      True when a flush method's reduced update was applied now (the reducer returned the sum).

    Raises:
      FloatingPointError: a loss of the wave is NaN or Inf.
    """
    return self.update.on_wave_end(wave_id)

  def install_pull(self, vector_clock: Sequence[int], flat: np.ndarray,
                   shard_vector_clocks: Sequence[Sequence[int]] | None = None) -> None:
    """Local weights := pulled global weights + own updates the global weights do not hold yet (the update rule's
    ``on_pull``). An action: the driver calls ``sync.on_pull_reply``.

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
    self.update.on_pull(vector_clock, flat, shard_vector_clocks)

  # ---------------------------------------------------------------- checkpoint segments
  def begin_segment(self, flat: np.ndarray) -> None:
    """Starts a new WSP segment from global weights that hold every VW's waves so far (a checkpoint barrier).

    Checkpoints are WSP barriers (docs/design.md §6): every VW finishes the segment's last wave, the PS holds every wave,
    and each VW continues from those global weights with nothing of its own outstanding. Clocks restart at 0 for the
    segment (the job adds the segment's offsets to records and logs), the optimizer states carry over.

    Args:
      flat: the global weights, float32 ``[num_params]``.
    """
    params = [self.stage_params_of(s, flat) for s in range(len(self.stages))]
    self.version = WeightVersion(tuple(params), 0, (0,) * self.num_virtual_workers, self.version.version_id + 1)
    self._wave_losses = []
    if self.ps_channel is not None:
      self.ps_channel.drop_pulls()
    self.update.reset()
    self.sync = self.update.new_sync(self.num_inflight, self.staleness_bound, self.sync.pull_every_wave)

  def set_version_id(self, version_id: int) -> None:
    """Continues a resumed VW's version numbering (records' ``version_id``) from its checkpoint."""
    self.version = dataclasses.replace(self.version, version_id=version_id)

  def opt_state_by_layer(self) -> tuple[list[np.ndarray], list[list[Any]]]:
    """The optimizer state of this process's stages (``local_stages``: all of them without stage ranks) split by layer
    (:func:`hetpipe_jax.runtime.opt_state.split_by_layer`), their layers in order; the shared scalars are the first
    local stage's (every stage updates once per minibatch, so they agree)."""
    local = self.local_stages
    host_states, host_params = jax.device_get(([self.opt_states[s] for s in local],
                                               [self.version.params[s] for s in local]))
    scalars, per_layer = None, []
    for state, params in zip(host_states, host_params):
      s, layers = opt_state.split_by_layer(state, params)
      scalars = s if scalars is None else scalars
      per_layer.extend(layers)
    return scalars, per_layer

  def load_opt_state(self, scalars: list, per_layer: list[list[Any]]) -> None:
    """Sets the optimizer state of this process's stages (``local_stages``) from :meth:`opt_state_by_layer` parts of
    all the model's layers (of any partition).

    Raises:
      ValueError: the parts do not fit this model and optimizer.
    """
    states = list(self.opt_states)
    for s in self.local_stages:
      st = self.stages[s]
      start, end = st.layer_range
      state = opt_state.join_layers(optimizers.for_layers(self.optimizer, start, end),
                                    jax.device_get(self.version.params[s]), scalars, per_layer[start:end])
      states[s] = jax.device_put(state, st.device)
    self.opt_states = states

  # ---------------------------------------------------------------- results
  def layer_params(self) -> list[Any]:
    """The VW's current weights as host per-layer params (for tests and checkpoints)."""
    out = []
    for p in jax.device_get(list(self.update.current_params())):
      out.extend(p)
    return out
