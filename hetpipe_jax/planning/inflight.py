"""Minibatches in flight per virtual worker: Max_m, the saturating Nm, and the system Nm (HetPipe §4).

For one virtual worker, ``Max_m`` is the largest Nm for which some partition fits every GPU's memory (memory
grows with Nm, so feasibility is monotone and a doubling + bisection search finds it). The system's Nm is at most
the minimum ``Max_m`` over virtual workers (every VW uses the same Nm) and is chosen to maximise the predicted
total throughput, which WSP holds to the slowest virtual worker (HetPipe §5): ``num_vws * min_v thr_v(Nm)``.

Two cheap upper bounds on a virtual worker's best throughput over every Nm let the allocator's search skip
allocations without partitioning them: one additive over GPUs, one per multiset of GPU types (proofs in their
docstrings).

Planning layer: standard library and numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from hetpipe_jax.planning.cluster import Gpu
from hetpipe_jax.planning.cost_model import INTER, INTRA, MS_PER_S, StageCosts
from hetpipe_jax.planning.partitioner import (InfeasiblePartitionError, Partition, PartitionProblem,
                                              min_max_stage_time_ms, partition_dp)

DEFAULT_MAX_NUM_INFLIGHT = 64


class VwPlanner:
  """Optimal partitions of one virtual worker for each Nm, cached.

  Args:
    costs: per-range costs.
    gpus: the virtual worker's GPUs.
    max_num_inflight: the largest Nm considered (search cap).
  """

  def __init__(self, costs: StageCosts, gpus: Sequence[Gpu], max_num_inflight: int = DEFAULT_MAX_NUM_INFLIGHT):
    if max_num_inflight < 1:
      raise ValueError(f"max_num_inflight must be >= 1, got {max_num_inflight}")
    self.costs = costs
    self.gpus = tuple(gpus)
    self.cap = max_num_inflight
    self._cache: dict[int, Partition | None] = {}
    self._errors: dict[int, InfeasiblePartitionError] = {}
    self._max: int | None = None

  def partition(self, num_inflight: int) -> Partition | None:
    """The optimal partition for Nm = ``num_inflight``, or None when none fits."""
    if num_inflight not in self._cache:
      try:
        self._cache[num_inflight] = partition_dp(PartitionProblem(self.costs, self.gpus, num_inflight))
      except InfeasiblePartitionError as e:
        self._cache[num_inflight] = None
        self._errors[num_inflight] = e
    return self._cache[num_inflight]

  def infeasibility(self, num_inflight: int) -> InfeasiblePartitionError | None:
    """The error of an infeasible Nm (with its best attempt), else None."""
    self.partition(num_inflight)
    return self._errors.get(num_inflight)

  def throughput_per_s(self, num_inflight: int) -> float:
    """Predicted minibatches/s at Nm (0 when infeasible)."""
    p = self.partition(num_inflight)
    return 0.0 if p is None else p.throughput_per_s

  def max_num_inflight(self) -> int:
    """Max_m: the largest feasible Nm up to the cap, 0 when even Nm = 1 does not fit."""
    if self._max is None:
      if self.partition(1) is None:
        self._max = 0
      else:
        lo, hi = 1, 2
        while hi <= self.cap and self.partition(hi) is not None:
          lo, hi = hi, hi * 2
        hi = min(hi, self.cap + 1)  # lo feasible, hi infeasible (or past the cap)
        while hi - lo > 1:
          mid = (lo + hi) // 2
          lo, hi = (mid, hi) if self.partition(mid) is not None else (lo, mid)
        self._max = lo
    return self._max

  def saturating_num_inflight(self) -> int:
    """Smallest Nm (<= Max_m) at which the predicted throughput stops growing (0 when infeasible)."""
    top = self.max_num_inflight()
    for nm in range(1, top):
      if self.throughput_per_s(nm + 1) <= self.throughput_per_s(nm) * (1 + 1e-9):
        return nm
    return top

  def is_bottleneck_bound(self, num_inflight: int) -> bool:
    """Whether throughput at Nm equals 1 / max stage time; then no larger Nm predicts more."""
    p = self.partition(num_inflight)
    return p is not None and p.throughput_per_s >= 1e3 / p.max_stage_time_ms * (1 - 1e-12)


def choose_system_num_inflight(planners: Sequence[VwPlanner]) -> tuple[int, float]:
  """The system Nm maximising ``len(planners) * min_v thr_v(Nm)`` over ``1..min_v Max_m`` (smallest on ties).

  Nm rises from 1 and stops at the first Nm some virtual worker cannot fit (memory grows with Nm, so that is
  ``min_v Max_m + 1``; no Max_m search is needed) or once every virtual worker is bottleneck-bound.

  Returns:
    ``(num_inflight, predicted total minibatches/s)``; ``(0, 0.0)`` when some virtual worker fits no Nm.
  """
  best_nm, best = 0, 0.0
  for nm in range(1, min(p.cap for p in planners) + 1):
    if any(p.partition(nm) is None for p in planners):
      break
    total = len(planners) * min(p.throughput_per_s(nm) for p in planners)
    if total > best * (1 + 1e-9):
      best_nm, best = nm, total
    if all(p.is_bottleneck_bound(nm) for p in planners):
      break
  return best_nm, best


def additive_throughput_bounds_per_s(costs: StageCosts) -> dict[str, float]:
  """Per GPU type t, ``u(t)`` such that every virtual worker's predicted throughput at every Nm is at most the sum
  of ``u`` over its GPUs (minibatches/s).

  Proof (fractional relaxation). Take layer weights ``w_l > 0`` (each type's layer times divided by its total, summed
  over types) and ``a_t = min_l time_l(t) / w_l``. A stage on type t running layers A computes for at least
  ``a_t * sum_{l in A} w_l`` ms and its stage time (compute + receives) is at least that. With T the largest stage
  time, ``sum_{l in A_s} w_l <= T / a_{t_s}`` for every stage s; summing over stages, ``W = sum_l w_l <= T * sum_s
  1 / a_{t_s}``, so ``1 / T <= sum_s 1 / (a_{t_s} W)``. Throughput is at most ``1 / T``
  (``cost_model.vw_throughput_per_s``), hence ``u(t) = 1000 / (a_t W)``. Memory only removes partitions. The result
  is inflated by 1e-9 relative so that rounding never makes it smaller than the value it bounds.
  """
  times = {t: np.diff(p) for t, p in costs.compute_prefix_ms.items()}
  weights = sum(x / x.sum() for x in times.values() if x.sum() > 0)
  if np.ndim(weights) == 0 or not np.all(weights > 0):
    return {t: np.inf for t in times}
  total = float(weights.sum())
  out = {}
  for t, x in times.items():
    a = float(np.min(x / weights))
    out[t] = MS_PER_S / (a * total) * (1 + 1e-9) if a > 0 else np.inf
  return out


def throughput_upper_bound_per_s(costs: StageCosts, gpu_types: Sequence[str], link_group: Mapping[str, str]) -> float:
  """An upper bound on ``max_Nm throughput_per_s(Nm)`` of every virtual worker whose GPUs have these types, on any
  nodes (0 when none fits memory even at Nm = 1, or when there are more GPUs than layers).

  Relaxation: the GPUs of types in one link group (``link_group[type]``; types sharing a node anywhere in the
  cluster, closed transitively) sit on one pseudo-node and a link between them costs the cheaper of the intra- and
  inter-node link; GPUs of different groups never share a node, so their link is inter-node, as in every real
  placement. Memory is checked at Nm = 1. Proof: a real virtual worker's partition at any feasible Nm, with the same
  GPU-type order and cuts, fits the relaxed problem at Nm = 1 (stage memory is non-decreasing in Nm and independent
  of links) with no larger stage times, so the relaxed optimum M (``partitioner.min_max_stage_time_ms``) is at most
  its largest stage time, and its throughput is at most ``1000 / M``.

  Args:
    costs: per-range costs.
    gpu_types: the virtual worker's GPU types (a multiset).
    link_group: GPU type -> its link group.
  """
  if not gpu_types or len(gpu_types) > costs.num_layers:
    return 0.0
  relaxed = dataclasses.replace(costs, recv_ms={INTRA: np.minimum(costs.recv_ms[INTRA], costs.recv_ms[INTER]),
                                                INTER: costs.recv_ms[INTER]})
  gpus = tuple(Gpu(f"bound/{i}", t, f"group {link_group[t]}") for i, t in enumerate(sorted(gpu_types)))
  best_ms = min_max_stage_time_ms(PartitionProblem(relaxed, gpus, 1))
  return MS_PER_S / best_ms if np.isfinite(best_ms) else 0.0
