"""Resource allocation: which GPUs form each virtual worker (HetPipe §8.1 NP / ED / HD, and a searched "auto").

* NP (node partition): one node per virtual worker (homogeneous VWs, intra-node links only).
* ED (equal distribution): every node's GPUs are split evenly over the VWs (identical heterogeneous VWs).
* HD (hybrid distribution): nodes are paired so that the pairs' aggregate peak FLOP/s and memory are as similar
  as possible (the pairing minimising the largest relative spread of either), and each pair's GPUs are split
  evenly over its share of the VWs. On ``hetpipe_paper`` this gives the paper's VVQQ, VVQQ, RRGG, RRGG.
* auto: every way of splitting the cluster's GPU classes ``(type, node)`` into ``num_vws`` equal-size VWs is
  planned; the one with the best predicted total throughput wins. WSP holds every VW to the slowest one over
  time (HetPipe §5), so a split is scored by ``num_vws * min_v thr_v(Nm)`` at its best system Nm.

Planning layer: standard library and numpy only.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from hetpipe_jax.planning import inflight
from hetpipe_jax.planning.cluster import ClusterSpec, Gpu
from hetpipe_jax.planning.cost_model import StageCosts
from hetpipe_jax.planning.partitioner import Partition

POLICIES = ("NP", "ED", "HD", "auto")


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
  """

  policy: str
  num_inflight: int
  virtual_workers: tuple[VirtualWorkerPlan, ...]
  predicted_total_minibatches_per_s: float


class AllocationError(ValueError):
  """The policy cannot be applied, or the model fits no allocation."""


def _split_even(gpus: Sequence[Gpu], parts: int, what: str) -> list[list[Gpu]]:
  if len(gpus) % parts:
    raise AllocationError(f"{what} has {len(gpus)} GPUs, not divisible into {parts} virtual workers")
  k = len(gpus) // parts
  return [list(gpus[i * k:(i + 1) * k]) for i in range(parts)]


def _node_gpus(cluster: ClusterSpec) -> dict[str, list[Gpu]]:
  out: dict[str, list[Gpu]] = {n.name: [] for n in cluster.nodes}
  for g in cluster.gpus():
    out[g.node].append(g)
  return out


def allocate_np(cluster: ClusterSpec, num_vws: int) -> list[list[Gpu]]:
  """Node partition: VW v = all GPUs of node v. Raises AllocationError unless ``num_vws`` = number of nodes."""
  if num_vws != len(cluster.nodes):
    raise AllocationError(f"NP assigns one node per virtual worker: num_vws must be {len(cluster.nodes)}, "
                          f"got {num_vws}")
  return list(_node_gpus(cluster).values())


def allocate_ed(cluster: ClusterSpec, num_vws: int) -> list[list[Gpu]]:
  """Equal distribution: VW v gets the v-th equal share of every node's GPUs."""
  vws: list[list[Gpu]] = [[] for _ in range(num_vws)]
  for node, gpus in _node_gpus(cluster).items():
    for v, share in enumerate(_split_even(gpus, num_vws, f"ED: node {node!r}")):
      vws[v] += share
  return vws


def _spread(values: Sequence[float]) -> float:
  mean = sum(values) / len(values)
  return (max(values) - min(values)) / mean if mean else 0.0


def hd_node_pairs(cluster: ClusterSpec) -> list[tuple[str, str]]:
  """The pairing of nodes whose pairs are most alike in aggregate peak FP32 FLOP/s and memory (see module doc)."""
  nodes = [n.name for n in cluster.nodes]
  if len(nodes) % 2:
    raise AllocationError(f"HD pairs nodes: the cluster has an odd number of nodes ({len(nodes)})")
  flops = {n.name: sum(cluster.gpu_types[t].peak_fp32_flops_per_s for t in n.gpu_types) for n in cluster.nodes}
  mem = {n.name: sum(cluster.gpu_types[t].memory_bytes for t in n.gpu_types) for n in cluster.nodes}

  def pairings(rest: list[str]):
    if not rest:
      yield []
      return
    for i in range(1, len(rest)):
      for tail in pairings(rest[1:i] + rest[i + 1:]):
        yield [(rest[0], rest[i])] + tail

  def score(pairs):
    return max(_spread([flops[a] + flops[b] for a, b in pairs]), _spread([mem[a] + mem[b] for a, b in pairs]))

  return min(pairings(nodes), key=score)


def allocate_hd(cluster: ClusterSpec, num_vws: int) -> list[list[Gpu]]:
  """Hybrid distribution: each HD node pair is split evenly over ``num_vws / num_pairs`` virtual workers."""
  pairs = hd_node_pairs(cluster)
  if num_vws % len(pairs):
    raise AllocationError(f"HD: num_vws={num_vws} is not a multiple of the {len(pairs)} node pairs")
  per_pair = num_vws // len(pairs)
  by_node = _node_gpus(cluster)
  vws = []
  for a, b in pairs:
    shares_a = _split_even(by_node[a], per_pair, f"HD: node {a!r}")
    shares_b = _split_even(by_node[b], per_pair, f"HD: node {b!r}")
    vws += [sa + sb for sa, sb in zip(shares_a, shares_b)]
  return vws


def _class_splits(counts: tuple[int, ...], num_vws: int, size: int):
  """Unordered splits of a class-count vector into ``num_vws`` multisets of ``size`` (non-increasing order)."""
  shapes = [m for m in itertools.product(*(range(c + 1) for c in counts)) if sum(m) == size]
  shapes.sort(reverse=True)

  def rec(remaining, start, left):
    if left == 0:
      if not any(remaining):
        yield []
      return
    for idx in range(start, len(shapes)):
      m = shapes[idx]
      if all(x <= r for x, r in zip(m, remaining)):
        for tail in rec(tuple(r - x for r, x in zip(remaining, m)), idx, left - 1):
          yield [m] + tail

  return rec(counts, 0, num_vws)


def plan_system(costs: StageCosts, vws: Sequence[Sequence[Gpu]], policy: str,
                max_num_inflight: int = inflight.DEFAULT_MAX_NUM_INFLIGHT,
                planners: dict | None = None) -> SystemPlan:
  """Plans the given allocation: each VW's Max_m, the system Nm, and each VW's partition at it.

  Args:
    costs: per-range costs.
    vws: GPUs of each virtual worker.
    policy: recorded in the plan.
    max_num_inflight: cap on the Nm search.
    planners: optional cache keyed by a VW's sorted GPU classes (shared across candidate allocations).

  Raises:
    AllocationError: some virtual worker fits no partition even at Nm = 1; the message carries its best attempt.
  """
  planners = {} if planners is None else planners
  vw_planners = []
  for v, gpus in enumerate(vws):
    key = tuple(sorted(g.gpu_class for g in gpus))
    if key not in planners:
      planners[key] = inflight.VwPlanner(costs, gpus, max_num_inflight)
    planner = planners[key]
    if planner.max_num_inflight() == 0:
      raise AllocationError(f"virtual worker {v} ({', '.join(g.gpu_id for g in gpus)}) fits no partition even "
                            f"with num_inflight=1: {planner.infeasibility(1)}")
    vw_planners.append(planner)
  nm, total = inflight.choose_system_num_inflight(vw_planners)
  out = []
  for v, (gpus, planner) in enumerate(zip(vws, vw_planners)):
    part = planner.partition(nm)
    # The cache is keyed by class; map the cached GPU ids onto this VW's own GPUs of the same class.
    pool: dict[tuple[str, str], list[Gpu]] = {}
    for g in sorted(gpus, key=lambda g: g.gpu_id):
      pool.setdefault(g.gpu_class, []).append(g)
    mine = tuple(pool[g.gpu_class].pop(0) for g in part.gpus)
    out.append(VirtualWorkerPlan(v, dataclasses.replace(part, gpus=mine), planner.max_num_inflight(),
                                 planner.saturating_num_inflight()))
  return SystemPlan(policy, nm, tuple(out), total)


def allocate(cluster: ClusterSpec, costs: StageCosts, policy: str, num_vws: int,
             max_num_inflight: int = inflight.DEFAULT_MAX_NUM_INFLIGHT) -> SystemPlan:
  """Allocates GPUs to ``num_vws`` virtual workers by ``policy`` and plans every VW.

  Raises:
    AllocationError: unknown policy, a policy that does not apply to this cluster/num_vws, or a model that fits
      no allocation.
  """
  if policy not in POLICIES:
    raise AllocationError(f"unknown policy {policy!r}: must be one of {list(POLICIES)}")
  total_gpus = len(cluster.gpus())
  if num_vws < 1 or num_vws > total_gpus:
    raise AllocationError(f"num_vws must be in [1, {total_gpus}], got {num_vws}")
  if policy != "auto":
    vws = {"NP": allocate_np, "ED": allocate_ed, "HD": allocate_hd}[policy](cluster, num_vws)
    return plan_system(costs, vws, policy, max_num_inflight)
  if total_gpus % num_vws:
    raise AllocationError(f"auto: {total_gpus} GPUs do not split into {num_vws} equal virtual workers")
  gpus = cluster.gpus()
  classes = sorted({g.gpu_class for g in gpus})
  by_class = {c: [g for g in gpus if g.gpu_class == c] for c in classes}
  counts = tuple(len(by_class[c]) for c in classes)
  planners: dict = {}
  best: SystemPlan | None = None
  errors = []
  for split in _class_splits(counts, num_vws, total_gpus // num_vws):
    pools = {c: list(by_class[c]) for c in classes}
    vws = [[pools[c].pop(0) for c, n in zip(classes, m) for _ in range(n)] for m in split]
    try:
      plan = plan_system(costs, vws, "auto", max_num_inflight, planners)
    except AllocationError as e:
      errors.append(str(e))
      continue
    if best is None or plan.predicted_total_minibatches_per_s > best.predicted_total_minibatches_per_s * (1 + 1e-9):
      best = plan
  if best is None:
    raise AllocationError(f"the model fits no allocation of {total_gpus} GPUs into {num_vws} virtual workers; "
                          f"e.g. {errors[0] if errors else 'no candidate'}")
  return best
