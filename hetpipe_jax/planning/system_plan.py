"""A system plan: the virtual workers' GPUs, each VW's partition and Max_m, and the one system Nm (HetPipe §4, §5).

:func:`plan_system` plans a given allocation (which GPUs form each VW); the allocation policies that choose one
(NP / ED / HD and the ``auto`` search) are :mod:`hetpipe_jax.planning.allocator` and
:mod:`hetpipe_jax.planning.auto_allocation`. VWs of one :func:`shape_key` share one planner (equal partitions up to
renaming their nodes). Planning layer: standard library and numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from hetpipe_jax.costs.cluster import Gpu
from hetpipe_jax.costs.cost_model import StageCosts
from hetpipe_jax.planning import inflight
from hetpipe_jax.planning.partitioner import Partition


@dataclasses.dataclass(frozen=True)
class VirtualWorkerPlan:
  """One virtual worker at the system Nm.

  Attributes:
    vw_id: index.
    partition: its optimal partition at the system Nm (GPUs in stage order).
    max_num_inflight: Max_m, the largest Nm that fits its memory.
    saturating_num_inflight: smallest Nm at which its predicted throughput stops growing.
  """

  vw_id: int
  partition: Partition
  max_num_inflight: int
  saturating_num_inflight: int


@dataclasses.dataclass(frozen=True)
class SystemPlan:
  """Allocation + partitions + Nm for the whole cluster.

  Attributes:
    policy: "NP", "ED", "HD" or "auto".
    num_inflight: the system Nm (same in every VW, <= every VW's Max_m).
    virtual_workers: per-VW plans.
    predicted_total_minibatches_per_s: ``num_vws * min_v thr_v`` (WSP: the slowest VW paces the rest).
    search: ``auto`` only: the searched space as it ran (``max_vw_gpus`` and whether it is the default rule or the
      user's) and the search's counters.
  """

  policy: str
  num_inflight: int
  virtual_workers: tuple[VirtualWorkerPlan, ...]
  predicted_total_minibatches_per_s: float
  search: dict | None = None


class AllocationError(ValueError):
  """The policy cannot be applied, or the model fits no allocation."""


def node_contents(gpus: Sequence[Gpu]) -> dict[str, tuple[str, ...]]:
  out: dict[str, list[str]] = {}
  for g in gpus:
    out.setdefault(g.node, []).append(g.gpu_type)
  return {n: tuple(sorted(t)) for n, t in out.items()}


def shape_key(gpus: Sequence[Gpu]) -> tuple[tuple[str, ...], ...]:
  """A virtual worker's isomorphism class: the sorted multisets of GPU types it has on each of its nodes.

  The cost model sees a GPU's type and whether two GPUs share a node (intra- or inter-node link), never node names,
  so two virtual workers with equal keys (one maps onto the other by renaming nodes) have equal optimal partitions
  up to that renaming: equal stage times and memory, hence equal throughput at every Nm and equal Max_m.
  """
  return tuple(sorted(node_contents(gpus).values()))


def _map_gpus(part_gpus: Sequence[Gpu], src: Sequence[Gpu], dst: Sequence[Gpu]) -> tuple[Gpu, ...]:
  """``part_gpus`` (an order of ``src``'s GPUs) carried onto ``dst``, a virtual worker with the same
  :func:`shape_key`: nodes are matched in key order, GPUs of one type on one node in id order."""
  order = lambda contents: sorted(contents, key=lambda n: (contents[n], n))
  src_nodes, dst_nodes = node_contents(src), node_contents(dst)
  node_map = dict(zip(order(src_nodes), order(dst_nodes)))
  pool: dict[tuple[str, str], list[Gpu]] = {}
  for g in sorted(dst, key=lambda g: g.gpu_id):
    pool.setdefault(g.gpu_class, []).append(g)
  return tuple(pool[(g.gpu_type, node_map[g.node])].pop(0) for g in part_gpus)


def vw_planner(costs: StageCosts, gpus: Sequence[Gpu], planners: dict, max_num_inflight: int) -> inflight.VwPlanner:
  """The cached planner of ``gpus``' :func:`shape_key` (built from ``gpus`` on first use)."""
  key = shape_key(gpus)
  if key not in planners:
    planners[key] = inflight.VwPlanner(costs, gpus, max_num_inflight)
  return planners[key]


def plan_system(costs: StageCosts, vws: Sequence[Sequence[Gpu]], policy: str,
                max_num_inflight: int = inflight.DEFAULT_MAX_NUM_INFLIGHT,
                planners: dict | None = None, num_inflight: int = 0) -> SystemPlan:
  """Plans the given allocation: each VW's Max_m, the system Nm, and each VW's partition at it.

  Args:
    costs: per-range costs.
    vws: GPUs of each virtual worker.
    policy: recorded in the plan.
    max_num_inflight: cap on the Nm search.
    planners: optional cache keyed by :func:`shape_key` (shared across candidate allocations).
    num_inflight: 0: the system Nm maximising the predicted throughput (``inflight.choose_system_num_inflight``);
      k > 0: Nm = k exactly (e.g. an Nm chosen by running the engine,
      ``planning/compare.choose_num_inflight_by_engine``).

  Raises:
    AllocationError: some virtual worker fits no partition even at Nm = 1, or at the given ``num_inflight``; the
      message carries its best attempt or the VWs' Max_m.
  """
  planners = {} if planners is None else planners
  vw_planners = []
  for v, gpus in enumerate(vws):
    planner = vw_planner(costs, gpus, planners, max_num_inflight)
    if planner.max_num_inflight() == 0:
      own = inflight.VwPlanner(costs, gpus, max_num_inflight)  # the error names this VW's own GPUs
      raise AllocationError(f"virtual worker {v} ({', '.join(g.gpu_id for g in gpus)}) fits no partition even "
                            f"with num_inflight=1: {own.infeasibility(1)}")
    vw_planners.append(planner)
  if num_inflight > 0:
    nm, total = inflight.choose_system_num_inflight(vw_planners, num_inflight, num_inflight)
    if nm != num_inflight:
      raise AllocationError(f"num_inflight={num_inflight} does not fit every virtual worker's memory (Max_m per VW: "
                            f"{[p.max_num_inflight() for p in vw_planners]}); choose num_inflight <= the smallest")
  else:
    nm, total = inflight.choose_system_num_inflight(vw_planners)
  out = []
  for v, (gpus, planner) in enumerate(zip(vws, vw_planners)):
    part = planner.partition(nm)
    mine = _map_gpus(part.gpus, planner.gpus, gpus)
    out.append(VirtualWorkerPlan(v, dataclasses.replace(part, gpus=mine), planner.max_num_inflight(),
                                 planner.saturating_num_inflight()))
  return SystemPlan(policy, nm, tuple(out), total)
