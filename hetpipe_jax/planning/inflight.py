"""Minibatches in flight per virtual worker: Max_m, the saturating Nm, and the system Nm (HetPipe §4).

For one virtual worker, ``Max_m`` is the largest Nm for which some partition fits every GPU's memory (memory
grows with Nm, so feasibility is monotone and a doubling + bisection search finds it). The system's Nm is at most
the minimum ``Max_m`` over virtual workers (every VW uses the same Nm) and is chosen to maximise the predicted
total throughput, which WSP holds to the slowest virtual worker (HetPipe §5): ``num_vws * min_v thr_v(Nm)``.

Planning layer: standard library and numpy only.
"""

from __future__ import annotations

from typing import Sequence

from hetpipe_jax.planning.cluster import Gpu
from hetpipe_jax.planning.cost_model import StageCosts
from hetpipe_jax.planning.partitioner import InfeasiblePartitionError, Partition, PartitionProblem, partition_dp

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

  Returns:
    ``(num_inflight, predicted total minibatches/s)``; ``(0, 0.0)`` when some virtual worker fits no Nm.
  """
  top = min(p.max_num_inflight() for p in planners)
  best_nm, best = 0, 0.0
  for nm in range(1, top + 1):
    total = len(planners) * min(p.throughput_per_s(nm) for p in planners)
    if total > best * (1 + 1e-9):
      best_nm, best = nm, total
    if all(p.is_bottleneck_bound(nm) for p in planners):
      break
  return best_nm, best
