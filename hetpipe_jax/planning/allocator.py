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

import numpy as np

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


def _node_contents(gpus: Sequence[Gpu]) -> dict[str, tuple[str, ...]]:
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
  return tuple(sorted(_node_contents(gpus).values()))


def _map_gpus(part_gpus: Sequence[Gpu], src: Sequence[Gpu], dst: Sequence[Gpu]) -> tuple[Gpu, ...]:
  """``part_gpus`` (an order of ``src``'s GPUs) carried onto ``dst``, a virtual worker with the same
  :func:`shape_key`: nodes are matched in key order, GPUs of one type on one node in id order."""
  order = lambda contents: sorted(contents, key=lambda n: (contents[n], n))
  src_nodes, dst_nodes = _node_contents(src), _node_contents(dst)
  node_map = dict(zip(order(src_nodes), order(dst_nodes)))
  pool: dict[tuple[str, str], list[Gpu]] = {}
  for g in sorted(dst, key=lambda g: g.gpu_id):
    pool.setdefault(g.gpu_class, []).append(g)
  return tuple(pool[(g.gpu_type, node_map[g.node])].pop(0) for g in part_gpus)


def _vw_planner(costs: StageCosts, gpus: Sequence[Gpu], planners: dict, max_num_inflight: int) -> inflight.VwPlanner:
  """The cached planner of ``gpus``' :func:`shape_key` (built from ``gpus`` on first use)."""
  key = shape_key(gpus)
  if key not in planners:
    planners[key] = inflight.VwPlanner(costs, gpus, max_num_inflight)
  return planners[key]


def plan_system(costs: StageCosts, vws: Sequence[Sequence[Gpu]], policy: str,
                max_num_inflight: int = inflight.DEFAULT_MAX_NUM_INFLIGHT,
                planners: dict | None = None) -> SystemPlan:
  """Plans the given allocation: each VW's Max_m, the system Nm, and each VW's partition at it.

  Args:
    costs: per-range costs.
    vws: GPUs of each virtual worker.
    policy: recorded in the plan.
    max_num_inflight: cap on the Nm search.
    planners: optional cache keyed by :func:`shape_key` (shared across candidate allocations).

  Raises:
    AllocationError: some virtual worker fits no partition even at Nm = 1; the message carries its best attempt.
  """
  planners = {} if planners is None else planners
  vw_planners = []
  for v, gpus in enumerate(vws):
    planner = _vw_planner(costs, gpus, planners, max_num_inflight)
    if planner.max_num_inflight() == 0:
      own = inflight.VwPlanner(costs, gpus, max_num_inflight)  # the error names this VW's own GPUs
      raise AllocationError(f"virtual worker {v} ({', '.join(g.gpu_id for g in gpus)}) fits no partition even "
                            f"with num_inflight=1: {own.infeasibility(1)}")
    vw_planners.append(planner)
  nm, total = inflight.choose_system_num_inflight(vw_planners)
  out = []
  for v, (gpus, planner) in enumerate(zip(vws, vw_planners)):
    part = planner.partition(nm)
    mine = _map_gpus(part.gpus, planner.gpus, gpus)
    out.append(VirtualWorkerPlan(v, dataclasses.replace(part, gpus=mine), planner.max_num_inflight(),
                                 planner.saturating_num_inflight()))
  return SystemPlan(policy, nm, tuple(out), total)


def allocate(cluster: ClusterSpec, costs: StageCosts, policy: str, num_vws: int,
             max_num_inflight: int = inflight.DEFAULT_MAX_NUM_INFLIGHT, max_vw_gpus: int | None = None) -> SystemPlan:
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
  if max_vw_gpus is None:
    max_vw_gpus = default_max_vw_gpus(total_gpus, num_vws)
  return _AutoSearch(cluster, costs, num_vws, max_vw_gpus, max_num_inflight).run()


def default_max_vw_gpus(num_gpus: int, num_vws: int) -> int:
  """The largest virtual worker ``auto`` considers by default: twice the equal share, ``2 * ceil(N / num_vws)``."""
  return 2 * -(-num_gpus // num_vws)


def _link_groups(cluster: ClusterSpec) -> dict[str, str]:
  """GPU type -> a label shared by types that share a node, closed transitively (``inflight`` bound's groups)."""
  group = {t: t for n in cluster.nodes for t in n.gpu_types}

  def root(t):
    while group[t] != t:
      t = group[t]
    return t

  for n in cluster.nodes:
    for t in n.gpu_types[1:]:
      group[root(t)] = root(n.gpu_types[0])
  return {t: root(t) for t in group}


class _AutoSearch:
  """Branch and bound over splits of the cluster into virtual workers (``auto``; see the module docstring)."""

  def __init__(self, cluster: ClusterSpec, costs: StageCosts, num_vws: int, max_vw_gpus: int, max_num_inflight: int):
    self.costs, self.num_vws, self.cap = costs, num_vws, max_num_inflight
    self.max_size = min(max_vw_gpus, costs.num_layers)  # every GPU needs a non-empty stage
    gpus = cluster.gpus()
    node_index = {n.name: i for i, n in enumerate(cluster.nodes)}
    self.classes = sorted({g.gpu_class for g in gpus}, key=lambda c: (node_index[c[1]], c[0]))
    self.by_class = [[g for g in gpus if g.gpu_class == c] for c in self.classes]
    self.types = sorted({t for t, _ in self.classes})
    self.class_type = [self.types.index(t) for t, _ in self.classes]
    contents = _node_contents(gpus)
    # Nodes in order: (content, class indices). Nodes with equal content and equal remaining GPUs are interchangeable.
    self.nodes = [(contents[n.name], [i for i, c in enumerate(self.classes) if c[1] == n.name])
                  for n in cluster.nodes if n.name in contents]
    self.node_of = {i: k for k, (_, cls) in enumerate(self.nodes) for i in cls}
    u = inflight.additive_throughput_bounds_per_s(costs)
    self.u = [u[t] for t in self.types]
    self.link_group = _link_groups(cluster)
    self.type_bounds: dict[tuple[int, ...], float] = {}
    self.type_lb: dict = {}
    self.type_ub: dict = {}
    self.planners: dict = {}
    self.best_single: dict[tuple, float] = {}
    self.best_total, self.best_split = 0.0, None
    self.stats = {"leaves": 0, "nodes": 0}

  def beats(self, per_vw: float) -> bool:
    """Whether a split whose slowest VW predicts ``per_vw`` minibatches/s would replace the incumbent."""
    return per_vw > 0 and self.num_vws * per_vw > self.best_total * (1 + 1e-9)

  def type_bound(self, n: tuple[int, ...]) -> float:
    if n not in self.type_bounds:
      kinds = [t for t, x in zip(self.types, n) for _ in range(x)]
      self.type_bounds[n] = inflight.throughput_upper_bound_per_s(self.costs, kinds, self.link_group)
    return self.type_bounds[n]

  def gpus_of(self, take: Sequence[int]) -> list[Gpu]:
    return [g for c, x in enumerate(take) for g in self.by_class[c][:x]]

  def exact(self, take: tuple[int, ...]) -> tuple[float, inflight.VwPlanner]:
    """The VW's best predicted throughput over Nm, and its planner."""
    gpus = self.gpus_of(take)
    planner = _vw_planner(self.costs, gpus, self.planners, self.cap)
    key = shape_key(gpus)
    if key not in self.best_single:
      self.best_single[key] = inflight.choose_system_num_inflight([planner])[1]
    return self.best_single[key], planner

  def additive(self, n: Sequence[int]) -> float:
    return sum(x * u for x, u in zip(n, self.u))

  def type_counts(self, per_class: Sequence[int]) -> tuple[int, ...]:
    have = [0] * len(self.types)
    for c, x in enumerate(per_class):
      have[self.class_type[c]] += x
    return tuple(have)

  def type_vectors(self, have: tuple[int, ...], k: int, first_type: int) -> list[tuple[int, ...]]:
    """Type-count vectors of the next of ``k`` VWs out of ``have`` (containing ``first_type``; sizes that leave
    every later VW 1..max_size GPUs), those nearest an equal share of the additive bound first."""
    total = sum(have)
    lo = max(1, total - (k - 1) * self.max_size)
    hi = min(self.max_size, total - (k - 1))
    out = []

    def rec(t, n, size):
      if t == len(have):
        if lo <= size:
          out.append(tuple(n))
        return
      for x in range(1 if t == first_type else 0, min(have[t], hi - size) + 1):
        n.append(x)
        rec(t + 1, n, size + x)
        n.pop()

    rec(0, [], 0)
    share = self.additive(have) / k
    return sorted(out, key=lambda n: abs(self.additive(n) - share))

  def type_feasible(self, have: tuple[int, ...], k: int) -> bool:
    """Whether type counts ``have`` may split into ``k`` VWs whose type bounds all beat the incumbent: the relaxed
    problem, decided exactly and memoised with the incumbent it was decided at (a failure stays a failure as the
    incumbent grows)."""
    size = sum(have)
    if not k <= size <= k * self.max_size:
      return False
    if k == 1:
      return self.beats(min(self.additive(have), self.type_bound(have)))
    key = (have, k)
    if self.beats(self.type_lb.get(key, 0.0)):
      return True
    if key in self.type_ub and not self.beats(self.type_ub[key]):
      return False
    cap = self.additive(have)
    if self.beats(cap / k):
      for n in self.type_vectors(have, k, next(t for t, x in enumerate(have) if x)):
        cap_n = self.additive(n)
        if not self.beats(min(cap_n, (cap - cap_n) / (k - 1))) or not self.beats(self.type_bound(n)):
          continue
        rest = tuple(h - x for h, x in zip(have, n))
        if self.type_feasible(rest, k - 1):
          witness = self.type_bound(rest) if k == 2 else self.type_lb[(rest, k - 1)]
          self.type_lb[key] = min(self.type_bound(n), witness)
          return True
    self.type_ub[key] = self.best_total * (1 + 1e-9) / self.num_vws
    return False

  def layouts(self, rem: list[int], n: tuple[int, ...], first_class: int):
    """Canonical placements of type counts ``n`` on nodes: per class counts, ``first_class`` included, and among
    interchangeable nodes (equal content, equal remaining) take vectors non-increasing (lexicographic)."""
    need = list(n)
    take = [0] * len(rem)
    active = [k for k, (_, cls) in enumerate(self.nodes) if any(rem[c] for c in cls)]
    # later[t][i]: GPUs of type t remaining on active nodes i.. (to stop early when need cannot be met).
    later = [[0] * (len(active) + 1) for _ in self.types]
    for i in range(len(active) - 1, -1, -1):
      for t in range(len(self.types)):
        later[t][i] = later[t][i + 1]
      for c in self.nodes[active[i]][1]:
        later[self.class_type[c]][i] += rem[c]
    last: dict = {}

    def rec(i):
      if not any(need):
        yield tuple(take)
        return
      if i == len(active) or any(need[t] > later[t][i] for t in range(len(need))):
        return
      content, cls = self.nodes[active[i]]
      group = (content, tuple(rem[c] for c in cls))
      prev = last.get(group)
      for vec in itertools.product(*(range(min(rem[c], need[self.class_type[c]]) + 1) for c in cls)):
        if prev is not None and vec > prev:
          continue
        if first_class in cls and vec[cls.index(first_class)] == 0:
          continue
        for c, v in zip(cls, vec):
          take[c] = v
          need[self.class_type[c]] -= v
        last[group] = vec
        yield from rec(i + 1)
        for c, v in zip(cls, vec):
          take[c] = 0
          need[self.class_type[c]] += v
        if prev is None:
          del last[group]
        else:
          last[group] = prev

    yield from rec(0)

  def search(self, rem: list[int], k: int, chosen: list, slowest: float):
    self.stats["nodes"] += 1
    have = self.type_counts(rem)
    if not self.beats(slowest) or not self.type_feasible(have, k):
      return
    if k == 1:
      self.leaf(rem, chosen, slowest)
      return
    first_class = next(c for c, x in enumerate(rem) if x)
    for n in self.type_vectors(have, k, self.class_type[first_class]):
      rest = tuple(h - x for h, x in zip(have, n))
      if not self.beats(min(slowest, self.type_bound(n))) or not self.type_feasible(rest, k - 1):
        continue
      options = []
      for take in self.layouts(rem, n, first_class):
        e, planner = self.exact(take)
        if self.beats(min(slowest, e)):
          options.append((e, take, planner))
      options.sort(key=lambda o: -o[0])
      for e, take, planner in options:
        if not self.beats(min(slowest, e)):
          continue
        for c, x in enumerate(take):
          rem[c] -= x
        self.search(rem, k - 1, chosen + [(take, planner)], min(slowest, e))
        for c, x in enumerate(take):
          rem[c] += x

  def leaf(self, rem: list[int], chosen: list, slowest: float):
    take = tuple(rem)
    e, planner = self.exact(take)
    if not self.beats(min(slowest, e)):
      return
    self.stats["leaves"] += 1
    _, total = inflight.choose_system_num_inflight([p for _, p in chosen] + [planner])
    if total > self.best_total * (1 + 1e-9):
      self.best_total, self.best_split = total, [t for t, _ in chosen] + [take]

  def run(self) -> SystemPlan:
    self.search(list(len(g) for g in self.by_class), self.num_vws, [], np.inf)
    if self.best_split is None:
      raise AllocationError(f"the model fits no allocation of {sum(len(g) for g in self.by_class)} GPUs into "
                            f"{self.num_vws} virtual workers of at most {self.max_size} GPUs each")
    vws = [self.gpus_of(take) for take in self.best_split]
    return plan_system(self.costs, vws, "auto", self.cap, self.planners)
