"""Minibatches in flight per virtual worker: Max_m, the saturating Nm, and the system Nm (HetPipe §4).

For one virtual worker, ``Max_m`` is the largest Nm for which some partition fits every GPU's memory (memory
grows with Nm, so feasibility is monotone and a doubling + bisection search finds it). The system's Nm is at most
the minimum ``Max_m`` over virtual workers (every VW uses the same Nm) and is chosen to maximise the predicted
total throughput, which WSP holds to the slowest virtual worker (HetPipe §5): ``num_vws * min_v thr_v(Nm)``.

Cheap upper bounds on a virtual worker's best throughput over every Nm (or over a range of Nm) let the allocator's
search skip allocations without partitioning them: one additive over GPUs, one per multiset of GPU types (a relaxed
partition at the range's smallest Nm, and Little's law with a round-trip lower bound at its largest; proofs in their
docstrings).

Planning layer: standard library and numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from hetpipe_jax.costs.cluster import Gpu
from hetpipe_jax.costs.cost_model import INTER, INTRA, MS_PER_S, StageCosts
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


def choose_system_num_inflight(planners: Sequence[VwPlanner], min_num_inflight: int = 1,
                                max_num_inflight: int | None = None) -> tuple[int, float]:
  """The system Nm maximising ``len(planners) * min_v thr_v(Nm)`` over ``min_num_inflight..min(max_num_inflight,
  min_v Max_m)`` (smallest on ties; by default ``1..min_v Max_m``, the plan's rule; the allocator's search also
  asks for one Nm or a tail of them, HetPipe §4-5).

  Nm rises from ``min_num_inflight`` and stops at the first Nm some virtual worker cannot fit (memory grows with
  Nm, so that is ``min_v Max_m + 1``; no Max_m search is needed) or once every virtual worker is bottleneck-bound
  (no larger Nm predicts more: the min-max stage time only grows as memory tightens).

  Returns:
    ``(num_inflight, predicted total minibatches/s)``; ``(0, 0.0)`` when some virtual worker fits no Nm of the range.
  """
  top = min(p.cap for p in planners)
  if max_num_inflight is not None:
    top = min(top, max_num_inflight)
  best_nm, best = 0, 0.0
  for nm in range(min_num_inflight, top + 1):
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


def round_trip_lower_bound_ms(costs: StageCosts, gpu_types: Sequence[str]) -> float:
  """A lower bound on the sum of stage times (ms) of every partition of the model over GPUs of these types.

  Proof: a partition over S GPUs has S non-empty stages, so every layer runs on one of the types (at least the
  fastest type's time for that layer) and S - 1 distinct cuts are crossed, each received twice (the activation by
  the next stage, the gradient by the previous one, over the same link), each at least the cheaper of the intra-
  and inter-node receive at that cut: at least twice the sum of the S - 1 smallest such receives.
  """
  kinds = sorted(set(gpu_types))
  compute = np.min([np.diff(costs.compute_prefix_ms[t]) for t in kinds], axis=0).sum()
  cuts = np.sort(np.minimum(costs.recv_ms[INTRA], costs.recv_ms[INTER])[1:costs.num_layers])
  return float(compute + 2 * cuts[:len(gpu_types) - 1].sum())


def little_bound_per_s(costs: StageCosts, gpu_types: Sequence[str], max_num_inflight: int) -> float:
  """An upper bound on ``throughput_per_s(Nm)`` for every ``Nm <= max_num_inflight`` of every virtual worker whose
  GPUs have these types: ``max_num_inflight * 1000 / round_trip_lower_bound_ms`` (Little's law term of
  ``cost_model.vw_throughput_per_s``; minibatches/s)."""
  trip = round_trip_lower_bound_ms(costs, gpu_types)
  return max_num_inflight * MS_PER_S / trip * (1 + 1e-9) if trip > 0 else np.inf


def throughput_upper_bound_per_s(costs: StageCosts, gpu_types: Sequence[str], link_group: Mapping[str, str],
                                 min_num_inflight: int = 1, max_num_inflight: int | None = None) -> float:
  """An upper bound on ``max throughput_per_s(Nm)`` over ``min_num_inflight <= Nm <= max_num_inflight`` (None: no
  upper end) of every virtual worker whose GPUs have these types, on any nodes (0 when none fits memory at
  ``min_num_inflight``, or when there are more GPUs than layers); minibatches/s.

  Relaxation: the GPUs of types in one link group (``link_group[type]``; types sharing a node anywhere in the
  cluster, closed transitively) sit on one pseudo-node and a link between them costs the cheaper of the intra- and
  inter-node link; GPUs of different groups never share a node, so their link is inter-node, as in every real
  placement. Memory is checked at ``min_num_inflight``. Proof: a real virtual worker's partition at any feasible Nm
  of the range, with the same GPU-type order and cuts, fits the relaxed problem at ``min_num_inflight`` (stage
  memory is non-decreasing in Nm and independent of links) with no larger stage times, so the relaxed optimum M
  (``partitioner.min_max_stage_time_ms``) is at most its largest stage time, and its throughput is at most
  ``1000 / M``; with an upper end, also at most :func:`little_bound_per_s`.

  Args:
    costs: per-range costs.
    gpu_types: the virtual worker's GPU types (a multiset).
    link_group: GPU type -> its link group.
    min_num_inflight: the smallest Nm bounded (>= 1).
    max_num_inflight: the largest Nm bounded, None for every Nm from ``min_num_inflight`` on.
  """
  if not gpu_types or len(gpu_types) > costs.num_layers:
    return 0.0
  relaxed = dataclasses.replace(costs, recv_ms={INTRA: np.minimum(costs.recv_ms[INTRA], costs.recv_ms[INTER]),
                                                INTER: costs.recv_ms[INTER]})
  gpus = tuple(Gpu(f"bound/{i}", t, f"group {link_group[t]}") for i, t in enumerate(sorted(gpu_types)))
  best_ms = min_max_stage_time_ms(PartitionProblem(relaxed, gpus, min_num_inflight))
  bound = MS_PER_S / best_ms if np.isfinite(best_ms) else 0.0
  if max_num_inflight is not None:
    bound = min(bound, little_bound_per_s(costs, gpu_types, max_num_inflight))
  return bound
