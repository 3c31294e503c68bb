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
