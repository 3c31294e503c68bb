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
(immutable per-stage params on each stage's device) and uses it on every stage; the weights change only when a
minibatch completes, on all stages together, or when pulled global weights are installed. Old versions are freed by
reference counting once no in-flight minibatch holds them.

Methods (``method``, :mod:`hetpipe_jax.rules.methods`): the pipeline rules take the method's static stage order.
HetPipe's actions are this module's; the other methods' own actions are parts of the class in their own modules:
the flush methods' step end (gpipe, 1f1b_flush, horovod: :mod:`hetpipe_jax.runtime.flush_step`; their backwards add
their gradients to the step's accumulator here, :meth:`~VirtualWorker._keep_grads`) and PipeDream's per-stage updates
(:mod:`hetpipe_jax.runtime.pipedream_updates`).

Stage ranks (``link`` / ``remote``, :mod:`hetpipe_jax.runtime.stage_ranks`; the actions in
:mod:`hetpipe_jax.runtime.linked_stages`): some of the VW's stages run on other MPI ranks. The driver's object holds
its local stages only (``local_stages``; the others' entries in versions, optimizer states and deltas are None) and
still makes every decision: a remote stage's task is a command to its rank, and each action also sends the remote
stages its version change (``remote``: inject, a minibatch's update, the pull to install, a wave end). A stage rank
holds the same object over its own stages and applies those changes in the same order
(:class:`hetpipe_jax.runtime.stage_ranks.StageRankServer`), pushing its stages' parts of each wave to the PS shards
and taking its parts of each pull from them itself; the driver pushes and pulls its own stages' parts only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from hetpipe_jax.ps.shards import rebase_on_shards
from hetpipe_jax.rules import allreduce
from hetpipe_jax.rules import methods
from hetpipe_jax.rules import schedule
from hetpipe_jax.rules import wsp
from hetpipe_jax.rules.records import MinibatchRecord, ShardedMinibatchRecord
from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.runtime import grad_clip
from hetpipe_jax.runtime import opt_state
from hetpipe_jax.runtime import optimizers
from hetpipe_jax.runtime import vw_driver
from hetpipe_jax.runtime.flush_step import FlushStep
from hetpipe_jax.runtime.linked_stages import LinkedStages
from hetpipe_jax.runtime.param_layout import ParamLayout
from hetpipe_jax.runtime.pipedream_updates import PerStageUpdates
from hetpipe_jax.runtime.ps_channel import PSChannel
from hetpipe_jax.runtime.stages import Stage
from hetpipe_jax.runtime.vw_state import (  # noqa: F401 (re-exported: the VW's types)
    InFlightMinibatch, PSClient, VWStats, WeightVersion, host_copy)


class VirtualWorker(FlushStep, PerStageUpdates, LinkedStages):
  """Runs one VW's pipeline for a fixed number of minibatches.

  Args:
    vw_id: 0-based VW index.
    stages: built by :func:`hetpipe_jax.runtime.stages.build_stages`.
    layout: flat weight layout shared with the PS.
    initial_layer_params: per-layer host params (the global initial weights W0).
    optimizer: optax transformation, or a :class:`hetpipe_jax.runtime.optimizers.PerStage` (each stage keeps its
      own state on its device).
    num_inflight: Nm >= 1.
    staleness_bound: D >= 0.
    ps: the parameter-server client.
    get_minibatch: ``minibatch_id -> (images [b, ...] float32, labels [b] int32)`` numpy arrays, or with a third,
      the examples' ids (int ``[b]``, recorded in the minibatch's ``example_ids``).
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
    ps_channel: ``"thread"``: where the VW can (:attr:`ps_channel_mode`), its wave pushes and pulls run on a PS
      channel thread during :meth:`run` (:mod:`hetpipe_jax.runtime.ps_channel`), else inline; ``"inline"``: on the
      scheduler thread always (tests and benchmarks compare the two).

  Raises:
    ValueError: ``num_inflight < 1``, ``staleness_bound < 0``, ``vw_id`` not in ``[0, num_virtual_workers)``, or
      ``ps_channel`` not ``"thread"`` / ``"inline"``.
  """

  def __init__(self, vw_id: int, stages: Sequence[Stage], layout: ParamLayout, initial_layer_params: Sequence[Any],
               optimizer: Any, num_inflight: int, staleness_bound: int, ps: PSClient,
               get_minibatch: Callable[[int], tuple[np.ndarray, np.ndarray]], *, num_virtual_workers: int,
               pull_every_wave: bool = True,
               poll_interval_s: float = 1e-3, on_minibatch: Callable[[MinibatchRecord], None] | None = None,
               task_time_s: Callable[[Task], float] | None = None,
               corrupt_update: Callable[[int, np.ndarray], None] | None = None, ps_shards: Any = None,
               method: str = "hetpipe",
               reducer: Callable[[int, np.ndarray], np.ndarray | None] | None = None,
               on_step: Callable[[int, float], None] | None = None,
               vertical_sync: bool = False, max_held: Sequence[int] | None = None, link: Any = None,
               remote: Any = None, ps_channel: str = "thread"):
    self.method = methods.get_method(method)
    if ps_channel not in ("thread", "inline"):
      raise ValueError(f"ps_channel must be 'thread' or 'inline', got {ps_channel!r}")
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
    self.ps_channel = (PSChannel(self) if ps_channel == "thread" and self.method.name == "hetpipe" and ps is not None
                       and ps_shards is None and link is None and remote is None
                       and getattr(ps, "serves_other_threads", True) else None)
    self.own_flat: dict[int, np.ndarray] = {}  # sharded PS: wave -> host copy of the own wave's flat update
    self.optimizer = optimizer
    clip_norms = {st.grad_clip_norm for st in self.stages}
    if len(clip_norms) != 1:
      raise ValueError(f"the stages clip gradients to different global norms {sorted(clip_norms)}: build them together")
    self.grad_clip_norm = clip_norms.pop()  # > 0: clip by the minibatch's global norm over every stage (grad_clip)
    local = set(self.local_stages)
    params = tuple(self._place_stage(initial_layer_params, st) if s in local else None
                   for s, st in enumerate(self.stages))
    # Constant outputs (Adam's step count, zeros) are not committed by jit: place them explicitly.
    self.opt_states = [jax.device_put(jax.jit(optimizers.for_layers(optimizer, *st.layer_range).init)(p), st.device)
                       if p is not None else None
                       for st, p in zip(self.stages, params)]
    self._zeros = [jax.device_put(jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t))(p), st.device)
                   if p is not None else None for st, p in zip(self.stages, params)]
    # Per local stage, a zero norm on its device: the update's norm argument when clipping is off.
    self._zero_norms = [jax.device_put(np.float32(0.0), st.device) if p is not None else None
                        for st, p in zip(self.stages, params)]
    # Compile the update, the rebase and a wave's ravel / a pull's unravel now, not at the first completion, wave end
    # or pull (a stall inside wave 1).
    jax.block_until_ready([(st.update(p, o, z, z, n), st.add(p, z), st.sq_norm(z) if self.grad_clip_norm else n,
                            st.unravel(st.ravel(z), z))
                           for st, p, o, z, n in zip(self.stages, params, self.opt_states, self._zeros,
                                                     self._zero_norms) if p is not None])
    # Flush methods: per stage, on its device, the micro-batches a reduced step sums (N x M: apply_mean's divisor);
    # the flush step's ravel and mean update compile now too.
    self._divisors = None
    if self.method.is_flush:
      self._divisors = jax.device_put([np.float32(num_virtual_workers * num_inflight)] * len(self.stages),
                                      [st.device for st in self.stages])
      jax.block_until_ready([st.apply_mean(p, o, st.ravel(z), d, n)
                             for st, p, o, z, d, n in zip(self.stages, params, self.opt_states, self._zeros,
                                                          self._divisors, self._zero_norms)])
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

  @property
  def ps_channel_mode(self) -> str:
    """``"thread"`` when the wave pushes and pulls of :meth:`run` go through a PS channel thread, else ``"inline"``:
    requested (``ps_channel``) and HetPipe's per-minibatch update with one PS (its client usable from another
    thread: an MPI client needs MPI_THREAD_SERIALIZED or more) and every stage in this process."""
    return "inline" if self.ps_channel is None else "thread"

  def _new_sync(self, num_inflight: int, staleness_bound: int, pull_every_wave: bool):
    if self.method.sync == "allreduce":
      if staleness_bound < 0:
        raise ValueError(f"staleness_bound must be >= 0, got {staleness_bound}")
      return allreduce.AllReduceSyncState(num_inflight)
    return wsp.VWSyncState(num_inflight, staleness_bound, pull_every_wave)

  # ---------------------------------------------------------------- placement helpers
  def _place_stage(self, layer_params: Sequence[Any], st: Stage):
    start, end = st.layer_range
    return jax.device_put(host_copy(list(layer_params[start:end])), st.device)

  def _new_version(self, params, *, local_updates=None, vector_clock=None,
                   shard_vector_clocks=None) -> WeightVersion:
    v = self.version
    return WeightVersion(tuple(params), v.local_updates if local_updates is None else local_updates,
                         v.vector_clock if vector_clock is None else tuple(vector_clock), v.version_id + 1,
                         v.shard_vector_clocks if vector_clock is None else shard_vector_clocks)

  # ---------------------------------------------------------------- the run
  def run(self, num_minibatches: int, *, completion_log: list | None = None) -> VWStats:
    """Trains ``num_minibatches`` (a multiple of Nm) and returns the VW's stats: :func:`hetpipe_jax.runtime.vw_driver.
    run` (its arguments and errors)."""
    self._prefetched.clear()  # minibatch ids are the run's (a segment's run starts at 0 again)
    return vw_driver.run(self, num_minibatches, completion_log=completion_log)

  # ---------------------------------------------------------------- tasks
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
    if self.remote is None or len(self.stages) - 1 in self.local_stages:
      y = jax.device_put(labels, self.stages[-1].device)
    else:
      y = None
    return labels, x, y, ids

  def inject(self, p: int, now: float) -> InFlightMinibatch:
    """Starts minibatch ``p`` on the current weight version; ``now`` is its injection time in seconds."""
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
    if self.method.update == "stage":
      rec.stage_versions = [-1] * len(self.stages)
    rec.example_ids = ids
    self.records.append(rec)
    if self.remote is not None:  # every stage rank learns p's version; the last stage's rank gets the labels
      self.remote.on_inject(p, v.version_id, labels)
    return InFlightMinibatch(v, x, y, {0: x}, {}, {}, {}, record=rec)

  def dispatch(self, task: Task, mb: InFlightMinibatch):
    """Dispatches ``task``; returns an array that is ready when its output has reached its consumer.

    Called on the stage's executor thread; it touches only this task's entries of ``mb``. A forward runs on the
    minibatch's weight version (PipeDream: the stage's own weights, :meth:`_stage_forward_params`); a backward's
    parameter gradients are kept for the minibatch's update (:meth:`_keep_grads`; PipeDream: the stage applies its
    own update at once, :meth:`_stage_update`) before its input gradient leaves, so a minibatch's update finds them
    on every stage. Stage ranks (``link``): a remote stage's task is a command to its rank (returns None; the
    thread that started the task sends it); an input from, or an output to, a stage on another rank goes through
    the link (the returned marker is ready once it has been received).
    """
    s = task.stage_id
    st = self.stages[s]
    link = self.link
    if link is not None and s not in self.local_stages:
      self.remote.start_task(task, mb.version.version_id,
                             self.task_time_s(task) if self.task_time_s is not None else None)
      return None
    per_stage = self.method.update == "stage"
    # PipeDream updates a stage right after its backward, unless clipping needs the minibatch's global norm first
    # (then every stage updates when the minibatch completes: grad_clip module docstring)
    keep = self._stage_update if per_stage and not self.grad_clip_norm else self._keep_grads
    if task.kind is TaskKind.BACKWARD:
      if link is None or link.is_local(s + 1):
        grad_out = mb.grad_in.pop(s)
      else:
        grad_out = jax.device_put(link.recv_gradient(s, task.minibatch_id, mb.version.version_id), st.device)
      gp, gx = st.backward(mb.residuals.pop(s), grad_out)
      keep(s, mb, gp)
      if s == 0:
        leaves = jax.tree.leaves(self.grad_acc[0] if self.method.is_flush else gp)
        return leaves[0] if leaves else grad_out  # a parameter-free stage 0 has nothing left to compute
    else:
      params = self._stage_forward_params(s, mb) if per_stage else mb.version.params[s]
      if link is None or s == 0 or link.is_local(s - 1):
        x = mb.activations.pop(s)
      else:
        x = jax.device_put(link.recv_activation(s, task.minibatch_id, mb.version.version_id), st.device)
      if task.kind is TaskKind.FORWARD:
        out, vjp = st.forward(params, x)
        mb.residuals[s] = vjp
        if link is not None and not link.is_local(s + 1):
          return link.send_activation(s, task.minibatch_id, mb.version.version_id, out)
        nxt = jax.device_put(out, self.stages[s + 1].device)
        mb.activations[s + 1] = nxt
        return nxt
      loss, gp, gx = st.forward_backward(params, x, mb.labels)
      mb.loss = loss
      keep(s, mb, gp)
      if s == 0:
        return loss
    if link is not None and not link.is_local(s - 1):
      return link.send_gradient(s, task.minibatch_id, mb.version.version_id, gx)
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

  def complete_minibatch(self, mb: InFlightMinibatch, now: float) -> None:
    """Applies minibatch p's update on every stage (a new weight version) and adds it to the wave's delta.

    An action: the driver then advances ``sync`` (``on_minibatch_complete``) and, at a wave end, calls
    :meth:`end_wave`. Flush methods: records the micro-batch's completion only (its backwards added its gradients
    to the step's accumulator, :meth:`_keep_grads`).
    """
    if self.method.is_flush or self.method.update == "stage":
      # Flush methods: the stages' backwards already added the gradients to grad_acc (_keep_grads).
      if not self.method.is_flush:  # PipeDream: every stage already applied its own update; the version counts it
        if self.grad_clip_norm:  # ... or, clipping, applies it now, by the minibatch's global norm
          norm = self.minibatch_grad_norm(mb)
          # stage 0 last: with vertical sync a later stage's forward looks up the count stage 0's forward saw, which
          # must already be in that stage's history
          for s in reversed(range(len(self.stages))):
            self._stage_update(s, mb, mb.grads.pop(s), norm)
        self.version = self._new_version(self.version.params, local_updates=self.version.local_updates + 1)
        if self.vertical_sync:
          self._prune_history()
      rec = mb.record
      rec.complete_time_s = now
      self._wave_losses.append((rec, mb.loss))
      return
    norm = self.minibatch_grad_norm(mb) if self.grad_clip_norm else None
    self.apply_update(mb, norm)
    if self.remote is not None:  # every stage rank applies p's update to its stages: the same new version
      self.remote.on_update(mb.record.minibatch_id, self.version.version_id, norm)
    rec = mb.record
    rec.complete_time_s = now
    self._wave_losses.append((rec, mb.loss))  # read back once per wave, not once per minibatch

  def apply_update(self, mb: InFlightMinibatch, norm: float | None = None) -> None:
    """Minibatch ``mb``'s optimizer step on every local stage: a new weight version, its delta added to the wave's.

    Args:
      mb: the completed minibatch (its stages' gradients in ``mb.grads``).
      norm: with clipping (``grad_clip_norm`` > 0), the minibatch's global gradient norm over every stage
        (:meth:`minibatch_grad_norm`; a stage rank gets it from the driver); ignored without clipping.
    """
    new_params, new_states, new_deltas = list(self.version.params), list(self.opt_states), list(self.wave_delta)
    norms = self._placed_norms(norm)
    for s in self.local_stages:
      st = self.stages[s]
      new_params[s], new_states[s], new_deltas[s] = st.update(self.version.params[s], self.opt_states[s], mb.grads[s],
                                                              self.wave_delta[s], norms[s])
    self.opt_states = new_states
    self.wave_delta = new_deltas
    self.version = self._new_version(new_params, local_updates=self.version.local_updates + 1)

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
      parts.update(zip(others, self.remote.sq_norms(mb.record.minibatch_id, others)))
    return grad_clip.global_norm([parts[s] for s in range(len(self.stages))])

  def _placed_norms(self, norm: float | None) -> list:
    """Per stage, the update's norm argument on its device (None for remote stages): ``norm`` when clipping, else
    zero."""
    if not self.grad_clip_norm:
      return self._zero_norms
    if norm is None:
      raise ValueError(f"[VW {self.vw_id}] clipping by the global norm needs the minibatch's norm")
    placed = jax.device_put([np.float32(norm)] * len(self.local_stages),
                            [self.stages[s].device for s in self.local_stages])
    out = [None] * len(self.stages)
    for s, x in zip(self.local_stages, placed):
      out[s] = x
    return out

  def _flat_of(self, stage_ids: Sequence[int], trees: Sequence[Any]) -> np.ndarray:
    """Stages ``stage_ids``' params-shaped device trees ``trees`` as one float32 host vector (their layers in stage
    order, :class:`ParamLayout`'s order): each stage ravels its tree on its device, then one transfer per stage (not
    one per leaf, and no flattening on the host)."""
    parts = jax.device_get([self.stages[s].ravel(t) for s, t in zip(stage_ids, trees)])
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)

  def _stage_params_of(self, s: int, flat: np.ndarray) -> Any:
    """Stage ``s``'s weights from a float32 host vector (the full model, or exactly the stage's layers), placed on its
    device as one buffer and cut into its params tree there (``Stage.unravel``)."""
    start, end = self.stages[s].layer_range
    offsets = self.layout.layer_offsets
    if flat.size == self.layout.num_params:
      flat = flat[offsets[start]:offsets[end]]
    elif flat.size != offsets[end] - offsets[start]:
      raise ValueError(f"[VW {self.vw_id}] stage {s} holds {offsets[end] - offsets[start]} floats, got {flat.size}")
    st = self.stages[s]
    if st.device.platform == "cpu":  # a CPU device array may alias its numpy buffer
      flat = host_copy(flat)
    return st.unravel(jax.device_put(flat, st.device), self._zeros[s])

  def place_pulled(self, flat: np.ndarray) -> list:
    """Per stage, its slice of pulled global weights ``flat`` (float32 ``[num_params]``) placed on its device as its
    params tree (:meth:`_stage_params_of`); None for a stage not in this process. The PS channel thread prepares a
    reply's install with it (:mod:`hetpipe_jax.runtime.ps_channel`)."""
    out = [None] * len(self.stages)
    for s in self.local_stages:
      out[s] = self._stage_params_of(s, flat)
    return out

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
    if self.ps_channel is not None and self.ps_channel.running:  # the channel thread pushes (ps_channel module)
      self.ps_channel.push(wave_id, self.wave_delta, self._wave_losses)
      self._wave_losses = []
    elif self.remote is None and self.ps_shards is None:
      self._push_wave(wave_id, self.wave_delta, self._wave_losses)
      self._wave_losses = []
    else:
      loss_sum = self._read_losses()
      if self.remote is not None:  # the stage ranks push their own parts to the shards (stage_ranks module)
        self.remote.end_wave(wave_id)
        flat = self._linked_wave_flat()
      else:
        flat = self._flat_of(range(len(self.stages)), self.wave_delta)
      self.own_flat[wave_id] = flat.copy()  # the update as computed, before a fault drill can touch it
      if self.corrupt_update is not None:  # fault drills only (config.debug_nan_update)
        self.corrupt_update(wave_id, flat)
      self.ps.push(wave_id, flat, loss_sum, self.num_inflight)
    self.stats.num_pushes += 1
    self.own_waves[wave_id] = self.wave_delta
    self.wave_delta = list(self._zeros)
    return False

  def _push_wave(self, wave_id: int, trees: Sequence[Any], wave_losses: list) -> None:
    """Pushes wave ``wave_id`` to the one PS: its losses read back (:meth:`_read_losses`), its summed delta
    (``trees``: per stage, on its device) brought to the host, the fault drill's hook, the push. Inline, or on the
    PS channel thread (:mod:`hetpipe_jax.runtime.ps_channel`): it reads no state the scheduler changes.

    Raises:
      FloatingPointError: a loss of the wave is NaN or Inf.
    """
    loss_sum = self._read_losses(wave_losses)
    flat = self._flat_of(range(len(self.stages)), trees)
    if self.corrupt_update is not None:  # fault drills only (config.debug_nan_update)
      self.corrupt_update(wave_id, flat)
    self.ps.push(wave_id, flat, loss_sum, self.num_inflight)

  def _read_losses(self, wave_losses: list | None = None) -> float:
    """Reads a wave's (step's) losses back into their records and calls ``on_minibatch`` on each; returns their sum.

    Args:
      wave_losses: the wave's ``(record, loss array)`` pairs; None: the current wave's (then cleared).

    Raises:
      FloatingPointError: a loss is NaN or Inf.
    """
    current = wave_losses is None
    if current:
      wave_losses = self._wave_losses
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
    if current:
      self._wave_losses = []
    return loss_sum

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
    placed = self.ps_channel.take_placed(flat) if self.ps_channel is not None else None
    for s in self.local_stages:
      st = self.stages[s]
      p = placed[s] if placed is not None else self._stage_params_of(s, flat)
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
      params[s] = self.stages[s].add(self._stage_params_of(s, local), self.wave_delta[s])
    self.version = self._new_version(params, vector_clock=vector_clock,
                                     shard_vector_clocks=tuple(tuple(int(c) for c in vc) for vc in shard_vector_clocks))
    if self.remote is not None:  # the stage ranks rebase their stages on their parts of the same pull
      self.remote.on_pull(self.version.version_id, own_applied)

  # ---------------------------------------------------------------- checkpoint segments
  def begin_segment(self, flat: np.ndarray) -> None:
    """Starts a new WSP segment from global weights that hold every VW's waves so far (a checkpoint barrier).

    Checkpoints are WSP barriers (WORKSPACE.md): every VW finishes the segment's last wave, the PS holds every wave,
    and each VW continues from those global weights with nothing of its own outstanding. Clocks restart at 0 for the
    segment (the job adds the segment's offsets to records and logs), the optimizer states carry over.

    Args:
      flat: the global weights, float32 ``[num_params]``.
    """
    params = [self._stage_params_of(s, flat) for s in range(len(self.stages))]
    self.version = WeightVersion(tuple(params), 0, (0,) * self.num_virtual_workers, self.version.version_id + 1)
    self.own_waves = {}
    self.wave_delta = list(self._zeros)
    self.grad_acc = list(self._zeros)
    self._wave_losses = []
    if self.ps_channel is not None:
      self.ps_channel.drop_pulls()
    self._init_stage_state(self.stage_updates)
    self.sync = self._new_sync(self.num_inflight, self.staleness_bound, self.sync.pull_every_wave)

  def set_version_id(self, version_id: int) -> None:
    """Continues a resumed VW's version numbering (records' ``version_id``) from its checkpoint."""
    self.version = dataclasses.replace(self.version, version_id=version_id)

  def opt_state_by_layer(self) -> tuple[list[np.ndarray], list[list[Any]]]:
    """The VW's optimizer state split by layer (:func:`hetpipe_jax.runtime.opt_state.split_by_layer`), all its layers
    in order; the shared scalars are stage 0's (every stage updates once per minibatch, so they agree)."""
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
    states = []
    for st, params in zip(self.stages, jax.device_get(list(self.version.params))):
      start, end = st.layer_range
      state = opt_state.join_layers(optimizers.for_layers(self.optimizer, start, end), params, scalars,
                                    per_layer[start:end])
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
