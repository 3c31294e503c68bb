"""Wave Synchronous Parallel (WSP) rules shared by the runtime and the engine (HetPipe §5).

Planning layer: pure Python. Terms (see the glossary in docs/design.md):

* a *wave* is Nm consecutive minibatches of one VW; minibatch p belongs to wave ``p // Nm``;
* a VW's ``local_clock`` is the number of waves it has completed; at the end of wave c it pushes that wave's
  aggregated update and its local clock becomes c + 1;
* the PS's ``global_clock`` is the minimum local clock over VWs; the global weights hold every VW's updates of
  waves ``0..global_clock-1`` and, under ``ps_apply="on_receipt"`` (the paper's WSP, the default), whatever later
  waves faster VWs have already pushed: the PS adds each wave update to the global weights when it arrives (§5:
  "When the parameter server receives the updates ũ from the virtual worker, the parameter server updates the
  global version of the weights as w_global = w_global + ũ"). Under ``ps_apply="clock_aligned"`` (our
  deterministic variant) a wave is applied only once every VW pushed it, in VW order, so the global weights hold
  exactly waves ``0..global_clock-1``;
* a *vector clock* says which updates a copy of the global weights holds: per VW, how many of its waves
  (waves ``0..vc[v]-1``; each VW pushes in wave order, so the applied waves of a VW are always a prefix). Its
  minimum is the global clock of the copy;
* ``staleness_bound`` D: a VW with local clock c must use weights holding every VW's updates of waves
  ``0..c-D-1``, i.e. weights pulled at global clock >= c - D. D = 0 is BSP with pipelining.

Each rule lives here once and every driver calls it: the MPI runtime (``vw_driver.run`` and
``mpi.ps_server``), the event engine (``engine.Engine``) and virtual time (the engine driving ``VirtualWorker``'s
actions). Per VW: :func:`injection_step` (local Nm rule + run length + WSP gate, and the pull it triggers) and
:class:`VWSyncState` (clocks, wave-end push and pull); after a pull, :func:`own_waves_after_pull`. For the PS:
:class:`ParameterServerState` (waves applied once in a fixed order, pending pulls answered in arrival order).

One driver per VW advances its :class:`VWSyncState`: ``VirtualWorker.run`` in the MPI runtime, the engine in the
engine and in virtual time (where it drives the VWs' own state objects, and ``VirtualWorker``'s hooks only act on
its decisions and never advance the state).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

from hetpipe_jax.rules import schedule

PS_APPLY_MODES = ("on_receipt", "clock_aligned")
PS_STALENESS_SCALINGS = ("none", "inverse", "exp")


def check_ps_staleness_scaling(scaling: str, alpha: float) -> None:
  """Checks a wave-update staleness scaling (:func:`staleness_scale`).

  Raises:
    ValueError: ``scaling`` not one of :data:`PS_STALENESS_SCALINGS`, or ``alpha <= 0`` with ``"exp"``.
  """
  if scaling not in PS_STALENESS_SCALINGS:
    raise ValueError(f"ps_staleness_scaling={scaling!r} is not a staleness scaling: use 'none', 'inverse' "
                     "(1/(1 + tau)) or 'exp' (exp(-ps_staleness_alpha * tau))")
  if scaling == "exp" and not alpha > 0:
    raise ValueError(f"ps_staleness_alpha={alpha} with ps_staleness_scaling='exp': alpha must be > 0")


def staleness_scale(scaling: str, alpha: float, tau: int) -> float:
  """The factor s(tau) a wave update of staleness ``tau`` is applied with (arXiv 1511.05950's staleness-aware step).

  Args:
    scaling: ``"none"`` (1), ``"inverse"`` (``1 / (1 + tau)``) or ``"exp"`` (``exp(-alpha * tau)``).
    alpha: the ``"exp"`` rate, > 0.
    tau: waves of other VWs applied since the pull the update's VW last got (:meth:`ParameterServerState.push`).
  """
  if scaling == "inverse":
    return 1.0 / (1 + tau)
  if scaling == "exp":
    return math.exp(-alpha * tau)
  return 1.0


def check_ps_apply(ps_apply: str) -> str:
  """Returns ``ps_apply`` if it names a PS application mode.

  Raises:
    ValueError: not one of :data:`PS_APPLY_MODES`.
  """
  if ps_apply not in PS_APPLY_MODES:
    raise ValueError(f"ps_apply={ps_apply!r} is not a PS application mode: use 'on_receipt' (HetPipe §5, the PS "
                     "adds each wave update when it arrives) or 'clock_aligned' (a wave is added once every VW "
                     "pushed it)")
  return ps_apply


def wave_of(minibatch_id: int, num_inflight: int) -> int:
  """Wave of a minibatch (0-based): ``minibatch_id // Nm``."""
  return minibatch_id // num_inflight


def is_wave_end(minibatch_id: int, num_inflight: int) -> bool:
  """True when completing ``minibatch_id`` completes its wave (it is the wave's last minibatch)."""
  return (minibatch_id + 1) % num_inflight == 0


def required_global_clock(local_clock: int, staleness_bound: int) -> int:
  """The smallest global clock the VW's weights must include: ``max(0, c - D)`` (HetPipe §5)."""
  return max(0, local_clock - staleness_bound)


def may_inject(local_clock: int, weights_global_clock: int, staleness_bound: int) -> bool:
  """Global-staleness rule: may a VW with ``local_clock`` start a minibatch on weights of ``weights_global_clock``?"""
  return weights_global_clock >= required_global_clock(local_clock, staleness_bound)


def clock_distance(local_clocks: list[int]) -> int:
  """Difference in local clock between the fastest and slowest VW (bounded by D + 1 under WSP)."""
  return max(local_clocks) - min(local_clocks)


def global_clock_of(vector_clock: Sequence[int]) -> int:
  """The global clock a copy of the global weights guarantees: ``min_v vc[v]`` (every VW's waves below it)."""
  return min(vector_clock)


def extra_updates(vector_clock: Sequence[int], vw_id: int) -> int:
  """Waves of *other* VWs a copy holds beyond its global clock g: ``sum_{u != v} (vc[u] - g)`` (HetPipe §6's
  "extra updates of other workers"; always 0 under ``clock_aligned``)."""
  g = min(vector_clock)
  return sum(c - g for u, c in enumerate(vector_clock) if u != vw_id)


def own_waves_after_pull(own_waves: Iterable[int], own_waves_applied: int) -> list[int]:
  """The VW's own pushed waves to keep on top of pulled global weights (HetPipe §5).

  The pulled weights hold the VW's own waves ``0..own_waves_applied-1`` (its entry of the pull's vector clock;
  the global clock under ``clock_aligned``, every wave it had pushed when the PS answered under ``on_receipt``).
  Its later pushed waves are not applied at the PS yet, so the VW re-adds them (and its current partial wave,
  which it has not pushed) to the pulled weights: local = global + own waves >= own_waves_applied + partial wave.
  Waves below ``own_waves_applied`` are dropped (the global weights hold them).

  Args:
    own_waves: wave indices of the own pushed updates the VW still holds (any order).
    own_waves_applied: how many of the VW's own waves the pulled weights hold.

  Returns:
    The waves to keep, ascending (the order they are re-added in).
  """
  return sorted(c for c in own_waves if c >= own_waves_applied)


@dataclasses.dataclass
class ParameterServerState:
  """The PS's bookkeeping, without tensors: waves pushed and applied, the global clock, pending pulls (HetPipe §5).

  Args:
    num_virtual_workers: N >= 1.
    ps_apply: ``"on_receipt"`` (HetPipe §5; default): a pushed wave is applied at once, so the global weights also
      hold faster VWs' newer waves; ``"clock_aligned"``: wave c is applied once every VW pushed it, VWs in order.
    staleness_scaling: ``"none"`` (default; HetPipe), ``"inverse"`` or ``"exp"``: each applied wave update is
      scaled by :func:`staleness_scale` of its staleness tau.
    staleness_alpha: the ``"exp"`` rate (> 0).

  Staleness of an applied wave (``staleness``, one ``(tau, scale)`` per entry of ``applied``): tau of VW v's wave
  is the number of *other* VWs' waves in the global weights just before it is added that were not in the last
  pull reply the PS sent v: ``sum_{u != v} (vc_now[u] - vc_pulled_v[u])``, with ``vc_now`` the vector clock of the
  global weights at that point of the application order (under ``clock_aligned``, the VWs before v in the same
  wave count) and ``vc_pulled_v`` the vector clock of the last reply sent to v (:meth:`note_pull`; all zeros
  before the first: W0). The PS cannot know when v installed a reply or which minibatches ran on it, so the last
  reply *sent* is the version the rule measures from (a wave partly computed on an older version has at least this
  staleness). One VW: tau = 0 always. It depends on the order the PS applies and answers in, so a sharded PS
  (shards see arrivals in their own orders) refuses a scaling (``job_config.with_ps_shards``).

  The caller adds each wave update returned by :meth:`push` to the global weights in the returned order; the
  whole order is kept in ``applied`` (the log a replay follows). Any copy of the global weights is
  ``W0 + the first sum(vc) entries of applied``, named by its vector clock vc (:meth:`vector_clock`). The global
  clock (``min_v`` of VW v's pushed waves) moves the same way under both modes.

  Pulls: :meth:`request_pull` when a VW's request arrives (answer now, or keep it pending); after every push,
  :meth:`serve_pending_pulls` names the pending VWs to answer now, in the order their requests arrived. The MPI
  service, the engine and the in-process client all keep their pending pulls here.

  Raises:
    ValueError: ``num_virtual_workers < 1`` or an unknown ``ps_apply``.
  """

  num_virtual_workers: int
  ps_apply: str = "on_receipt"
  pushed_waves: list[int] = dataclasses.field(default_factory=list)  # per VW: waves pushed (= its local clock)
  applied_waves: list[int] = dataclasses.field(default_factory=list)  # per VW: waves in the global weights
  global_clock: int = 0
  applied: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (wave, vw) in application order
  # vw -> required global clock of its unanswered pull, in the order the requests arrived (at most one per VW).
  pending_pulls: dict[int, int] = dataclasses.field(default_factory=dict)
  staleness_scaling: str = "none"
  staleness_alpha: float = 1.0
  # per VW: the vector clock of the last pull reply sent to it (note_pull)
  pulled_clocks: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
  staleness: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (tau, scale) per entry of applied

  def __post_init__(self):
    if self.num_virtual_workers < 1:
      raise ValueError(f"num_virtual_workers must be >= 1, got {self.num_virtual_workers}")
    check_ps_apply(self.ps_apply)
    check_ps_staleness_scaling(self.staleness_scaling, self.staleness_alpha)
    if not self.pushed_waves:
      self.pushed_waves = [0] * self.num_virtual_workers
    if not self.applied_waves:
      self.applied_waves = [0] * self.num_virtual_workers
    if not self.pulled_clocks:
      self.pulled_clocks = [(0,) * self.num_virtual_workers] * self.num_virtual_workers

  def fresh(self) -> "ParameterServerState":
    """A new state with the same settings (a checkpoint segment's PS: every VW pulled everything at the barrier)."""
    return ParameterServerState(self.num_virtual_workers, self.ps_apply, staleness_scaling=self.staleness_scaling,
                                staleness_alpha=self.staleness_alpha)

  def note_pull(self, vw_id: int, vector_clock: Sequence[int]) -> None:
    """The PS sends VW ``vw_id`` the global weights of ``vector_clock`` (its pull reply): later waves of ``vw_id``
    measure their staleness from it."""
    self.pulled_clocks[vw_id] = tuple(vector_clock)

  def _record_staleness(self, ready: list[tuple[int, int]], vector_clock: Sequence[int]) -> None:
    """Appends ``(tau, scale)`` for each of ``ready`` (applied in order onto weights of ``vector_clock``)."""
    vc = list(vector_clock)
    for _, vw in ready:
      pulled = self.pulled_clocks[vw]
      tau = sum(vc[u] - pulled[u] for u in range(self.num_virtual_workers) if u != vw)
      self.staleness.append((tau, staleness_scale(self.staleness_scaling, self.staleness_alpha, tau)))
      vc[vw] += 1

  def push(self, vw_id: int, wave_id: int) -> list[tuple[int, int]]:
    """Records VW ``vw_id``'s update of ``wave_id``; returns the (wave, vw) updates to apply now, in order.

    ``on_receipt``: just this one. ``clock_aligned``: every VW's update of each wave that every VW has now pushed.

    Raises:
      ValueError: unknown VW, or a wave pushed twice or out of order (each wave is pushed exactly once, in order).
    """
    if not 0 <= vw_id < self.num_virtual_workers:
      raise ValueError(f"push from unknown VW {vw_id} (have {self.num_virtual_workers})")
    if wave_id != self.pushed_waves[vw_id]:
      raise ValueError(f"VW {vw_id} pushed wave {wave_id}, expected wave {self.pushed_waves[vw_id]}")
    pushed = self.pushed_waves
    pushed[vw_id] += 1
    before = tuple(self.applied_waves)
    if self.ps_apply == "on_receipt":
      ready = [(wave_id, vw_id)]
      self.applied_waves[vw_id] += 1
      if wave_id == self.global_clock:
        self.global_clock = min(pushed)
    else:
      ready = []
      while min(pushed) > self.global_clock:
        wave = self.global_clock
        ready.extend((wave, v) for v in range(self.num_virtual_workers))
        self.global_clock += 1
      if ready:
        self.applied_waves = [self.global_clock] * self.num_virtual_workers
    self.applied.extend(ready)
    self._record_staleness(ready, before)
    return ready

  def vector_clock(self) -> tuple[int, ...]:
    """Per VW, how many of its waves the global weights hold now (``min`` = the global clock)."""
    return tuple(self.applied_waves)

  def can_serve_pull(self, required_clock: int) -> bool:
    """True when the global weights include waves ``0..required_clock-1``."""
    return self.global_clock >= required_clock

  def request_pull(self, vw_id: int, required_clock: int) -> bool:
    """VW ``vw_id``'s pull request arrives: True when it is answered now, else it is kept pending.

    A pending request is answered by a later :meth:`serve_pending_pulls`, once the global clock reaches
    ``required_clock``; the reply always carries the global weights current when it is answered.

    Args:
      vw_id: the requesting VW.
      required_clock: the smallest global clock the reply may carry.

    Returns:
      True: answer now (nothing is recorded); False: pending.

    Raises:
      ValueError: unknown VW, or the VW already has a pending pull (a VW has at most one pull outstanding).
    """
    if not 0 <= vw_id < self.num_virtual_workers:
      raise ValueError(f"pull from unknown VW {vw_id} (have {self.num_virtual_workers})")
    if vw_id in self.pending_pulls:
      raise ValueError(f"VW {vw_id} requested a pull at clock {required_clock} while its pull at clock "
                       f"{self.pending_pulls[vw_id]} is pending (one pull outstanding per VW)")
    if self.global_clock >= required_clock:
      return True
    self.pending_pulls[vw_id] = required_clock
    return False

  def serve_pending_pulls(self) -> list[int]:
    """The pending pulls the global clock now allows, removed from the pending set.

    Returns:
      Their VWs, in the order the requests arrived (the order to answer them in).
    """
    pending = self.pending_pulls
    if not pending:
      return []
    clock = self.global_clock
    ready = [v for v, required in pending.items() if required <= clock]
    for v in ready:
      del pending[v]
    return ready


@dataclasses.dataclass
class VWSyncState:
  """One VW's side of WSP, without tensors: its clocks and the pull it is waiting for (HetPipe §5).

  The runtime (:mod:`hetpipe_jax.runtime.virtual_worker`) and the event engine drive the same object, each VW's
  state advanced by exactly one driver (module docstring):

  * :meth:`injection_gate` before injecting a minibatch (through :func:`injection_step`): may it start, and which
    pull to request if not;
  * :meth:`on_minibatch_complete` when a minibatch completes: whether a wave ended (push it) and which pull to
    request without waiting (``pull_every_wave``; it asks for the clock the bound requires during the next wave,
    or during the one after when the weights already satisfy the next, so the reply arrives before it is needed);
  * :meth:`on_pull_reply` when pulled global weights are installed.

  Args:
    num_inflight: Nm >= 1.
    staleness_bound: D >= 0.
    pull_every_wave: also pull, without waiting, at every wave end.
  """

  num_inflight: int
  staleness_bound: int
  pull_every_wave: bool = True
  max_injected = None  # no cap beyond Nm in flight (all-reduce BSP caps injections at the flush)
  local_clock: int = 0
  weights_global_clock: int = 0
  pull_required: int | None = None  # requirement of the outstanding pull, None when none is outstanding

  def __post_init__(self):
    if self.num_inflight < 1:
      raise ValueError(f"num_inflight must be >= 1, got {self.num_inflight}")
    if self.staleness_bound < 0:
      raise ValueError(f"staleness_bound must be >= 0, got {self.staleness_bound}")

  def injection_gate(self) -> tuple[bool, int | None]:
    """Returns ``(may_inject, pull_to_request)``; a pull is requested (and recorded) only when none is outstanding."""
    if may_inject(self.local_clock, self.weights_global_clock, self.staleness_bound):
      return True, None
    if self.pull_required is None:
      self.pull_required = required_global_clock(self.local_clock, self.staleness_bound)
      return False, self.pull_required
    return False, None

  def on_minibatch_complete(self, minibatch_id: int) -> tuple[int | None, int | None]:
    """Returns ``(wave_to_push, pull_to_request)`` after ``minibatch_id`` completed (None for no action)."""
    if not is_wave_end(minibatch_id, self.num_inflight):
      return None, None
    wave = wave_of(minibatch_id, self.num_inflight)
    self.local_clock = wave + 1
    if self.pull_every_wave and self.pull_required is None:
      # Ask for what the bound requires during the next wave, answered as soon as the PS holds it (with the
      # freshest global weights then). When the weights already satisfy the coming wave, look one wave further
      # ahead, so the reply is in hand before it is needed and VWs in step never wait for a pull; never ask beyond
      # the coming wave's need otherwise, so a VW at the bound does not wait for more than it needs (and, with
      # D = 0, never for its own unfinished wave).
      ahead = 1 if may_inject(self.local_clock, self.weights_global_clock, self.staleness_bound) else 0
      self.pull_required = required_global_clock(self.local_clock + ahead, self.staleness_bound)
      return wave, self.pull_required
    return wave, None

  def on_pull_reply(self, global_clock: int) -> None:
    """Pulled weights of ``global_clock`` are installed.

    Raises:
      AssertionError: the reply goes back in time.
    """
    if global_clock < self.weights_global_clock:
      raise AssertionError(f"pull went back in time: clock {global_clock} < {self.weights_global_clock}")
    self.weights_global_clock = global_clock
    self.pull_required = None


_NO_MINIBATCHES = range(0)


def injection_step(rules: schedule.PipelineRules, sync: VWSyncState,
                   num_minibatches: int) -> tuple[range, int | None, bool]:
  """One VW's injection step: inject every minibatch the local rule, the run's length and WSP allow now.

  The rule (HetPipe §4 local staleness, §5 global staleness): while fewer than Nm minibatches are in flight and
  fewer than ``num_minibatches`` (and, under all-reduce BSP, fewer than ``sync.max_injected``: the flush) were
  injected, a minibatch is injected if ``sync.injection_gate()`` allows it.
  The gate is consulted only when the local rules leave room; when it refuses, the VW waits for the PS, and the
  gate names the pull to request unless one is outstanding. Both the MPI runtime (``VirtualWorker.run``) and the
  engine call this whenever the rules may have changed (a minibatch completed, a pull reply was installed, and,
  in the runtime, every loop iteration); the callers act on the result (the minibatches' data, records, hooks,
  the pull request and their own wait accounting).

  Args:
    rules: the VW's pipeline rules; ``rules.inject()`` is called for each minibatch injected.
    sync: the VW's WSP state (:meth:`VWSyncState.injection_gate` records a requested pull), or its
      :class:`hetpipe_jax.rules.allreduce.AllReduceSyncState`.
    num_minibatches: minibatches the VW trains in the whole run.

  Returns:
    ``(injected, pull_to_request, waiting)``: the minibatch ids injected now (consecutive, maybe empty); the
    global clock of a pull to request now, or None; True when the WSP gate holds back a minibatch the local rules
    allow (the VW is waiting for a pull; it then injects nothing).
  """
  first = rules.num_injected
  room = rules.num_inflight - first + rules.num_completed  # the local rule: Nm in flight
  if num_minibatches - first < room:  # the run's length
    room = num_minibatches - first
  cap = sync.max_injected
  if cap is not None and cap - first < room:  # all-reduce BSP: the next step waits for this one's update
    room = cap - first
  if room <= 0:
    return _NO_MINIBATCHES, None, False
  allowed, pull = sync.injection_gate()
  if not allowed:
    return _NO_MINIBATCHES, pull, True
  for _ in range(room):
    rules.inject()
  return range(first, first + room), None, False
