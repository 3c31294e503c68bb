"""Wave Synchronous Parallel (WSP) rules shared by the runtime and the engine (HetPipe §5).

Planning layer: pure Python. Terms (see WORKSPACE.md glossary):

* a *wave* is Nm consecutive minibatches of one VW; minibatch p belongs to wave ``p // Nm``;
* a VW's ``local_clock`` is the number of waves it has completed; at the end of wave c it pushes that wave's
  aggregated update and its local clock becomes c + 1;
* the PS's ``global_clock`` is the minimum local clock over VWs; the global weights hold every VW's updates of
  waves ``0..global_clock-1`` and nothing else (a wave is applied once every VW pushed it, in VW order);
* ``staleness_bound`` D: a VW with local clock c must use weights holding every VW's updates of waves
  ``0..c-D-1``, i.e. weights pulled at global clock >= c - D. D = 0 is BSP with pipelining.
"""

from __future__ import annotations

import dataclasses


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


@dataclasses.dataclass
class ParameterServerState:
  """The PS's bookkeeping, without tensors: which waves each VW pushed, which are applied, the global clock.

  Args:
    num_virtual_workers: N >= 1.

  The caller adds each wave update returned by :meth:`push` to the global weights in the returned order, which is
  deterministic (wave by wave, VW 0..N-1 within a wave), so the global weights at clock g are always
  ``W0 + sum_{c<g} sum_v u[v, c]`` with the same floating-point order.
  """

  num_virtual_workers: int
  pushed_waves: list[int] = dataclasses.field(default_factory=list)  # per VW: waves pushed (= its local clock)
  global_clock: int = 0
  applied: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (wave, vw) in application order

  def __post_init__(self):
    if self.num_virtual_workers < 1:
      raise ValueError(f"num_virtual_workers must be >= 1, got {self.num_virtual_workers}")
    if not self.pushed_waves:
      self.pushed_waves = [0] * self.num_virtual_workers

  def push(self, vw_id: int, wave_id: int) -> list[tuple[int, int]]:
    """Records VW ``vw_id``'s update of ``wave_id``; returns the (wave, vw) updates that now become applicable.

    Raises:
      ValueError: unknown VW, or a wave pushed twice or out of order (each wave is pushed exactly once, in order).
    """
    if not 0 <= vw_id < self.num_virtual_workers:
      raise ValueError(f"push from unknown VW {vw_id} (have {self.num_virtual_workers})")
    if wave_id != self.pushed_waves[vw_id]:
      raise ValueError(f"VW {vw_id} pushed wave {wave_id}, expected wave {self.pushed_waves[vw_id]}")
    self.pushed_waves[vw_id] += 1
    ready = []
    while min(self.pushed_waves) > self.global_clock:
      wave = self.global_clock
      ready.extend((wave, v) for v in range(self.num_virtual_workers))
      self.global_clock += 1
    self.applied.extend(ready)
    return ready

  def can_serve_pull(self, required_clock: int) -> bool:
    """True when the global weights include waves ``0..required_clock-1``."""
    return self.global_clock >= required_clock


@dataclasses.dataclass
class VWSyncState:
  """One VW's side of WSP, without tensors: its clocks and the pull it is waiting for (HetPipe §5).

  The runtime (:mod:`hetpipe_jax.pipeline`) and the event engine drive the same object:

  * :meth:`injection_gate` before injecting a minibatch: may it start, and which pull to request if not;
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
