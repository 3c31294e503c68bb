"""Resource allocation: which GPUs form each virtual worker (HetPipe §8.1 NP / ED / HD, and a searched "auto").

* NP (node partition): one node per virtual worker (homogeneous VWs, intra-node links only).
* ED (equal distribution): every node's GPUs are split evenly over the VWs (identical heterogeneous VWs).
* HD (hybrid distribution): nodes are paired so that the pairs' aggregate peak FLOP/s and memory are as similar
  as possible (the pairing minimising the largest relative spread of either), and each pair's GPUs are split
  evenly over its share of the VWs. On ``hetpipe_paper`` this gives the paper's VVQQ, VVQQ, RRGG, RRGG.
* auto: the search space is every allocation of all the cluster's GPUs into ``num_vws`` non-empty virtual workers
  of at most ``max_vw_gpus`` GPUs each, of any (also unequal) sizes; allocations that differ only by renaming
  nodes of equal content, or GPUs of one class ``(type, node)``, are one (the cost model sees types and whether
  two GPUs share a node, never names). Each is planned as :func:`plan_system` plans it and scored by its total
  ``num_vws * min_v thr_v(Nm)`` at its best system Nm (WSP holds every VW to the slowest, HetPipe §5); the best
  total over the whole space is returned (exact; tests/test_allocator.py checks it against every set partition
  on small clusters). Default ``max_vw_gpus``: one GPU more than the equal share, ``ceil(N / num_vws) + 1``
  (:func:`default_max_vw_gpus`; a user value is used as given, recorded in the plan's ``allocation_search``).
  Method: branch and bound per system-Nm level (Nm fixed at 1 .. max VW size - 1, then any Nm from the max VW size
  on; a split's total is its best over levels), one VW at a time (the one holding the first remaining class, so VW
  order is not enumerated), type-count vectors then canonical node layouts; pruned by per-VW upper bounds at the
  level (``inflight``'s additive, Little's-law and relaxed-partition bounds at the level's Nm, proofs there), by a
  packing relaxation (the remaining GPUs must hold, per type, as many disjoint type vectors whose bound beats the bar
  as VWs remain) and by a memo of states (level, remaining GPUs up to node renaming) proven dead at a bar. The bar
  starts near the largest packing bound and descends 2 % per round until a split reaches it, then the incumbent found
  is the bar; the descent only orders the work.

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
TARGET_STEP = 0.02  # auto: each round of the descent lowers the target total by 2 % ...
MAX_TARGET_ROUNDS = 20  # ... for at most 20 rounds (to 0.67 x the packing bound); then the plain search
START_STEP = 0.1  # auto: the start target is found by lowering the additive bound 10 % at a time


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
                planners: dict | None = None, num_inflight: int = 0) -> SystemPlan:
  """Plans the given allocation: each VW's Max_m, the system Nm, and each VW's partition at it.

  Args:
    costs: per-range costs.
    vws: GPUs of each virtual worker.
    policy: recorded in the plan.
    max_num_inflight: cap on the Nm search.
    planners: optional cache keyed by :func:`shape_key` (shared across candidate allocations).
    num_inflight: 0: the system Nm maximising the predicted throughput (``inflight.choose_system_num_inflight``);
      k > 0: Nm = k exactly (e.g. an Nm chosen by running the engine, ``sim/compare.choose_num_inflight_by_engine``).

  Raises:
    AllocationError: some virtual worker fits no partition even at Nm = 1, or at the given ``num_inflight``; the
      message carries its best attempt or the VWs' Max_m.
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


def allocate(cluster: ClusterSpec, costs: StageCosts, policy: str, num_vws: int,
             max_num_inflight: int = inflight.DEFAULT_MAX_NUM_INFLIGHT, max_vw_gpus: int | None = None,
             num_inflight: int = 0) -> SystemPlan:
  """Allocates GPUs to ``num_vws`` virtual workers by ``policy`` and plans every VW.

  Args:
    max_vw_gpus: ``auto`` only: the largest VW searched (None: :func:`default_max_vw_gpus`); recorded in the
      result's ``search``. Must be None for other policies.
    num_inflight: NP / ED / HD: 0 chooses the system Nm, k > 0 fixes it (:func:`plan_system`); must be 0 for
      ``auto`` (its search chooses Nm per level).

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
    if max_vw_gpus is not None:
      raise AllocationError(f"max_vw_gpus={max_vw_gpus} applies to policy 'auto' only, not {policy!r}")
    vws = {"NP": allocate_np, "ED": allocate_ed, "HD": allocate_hd}[policy](cluster, num_vws)
    return plan_system(costs, vws, policy, max_num_inflight, num_inflight=num_inflight)
  if num_inflight:
    raise AllocationError(f"num_inflight={num_inflight} cannot be fixed with policy 'auto'; use NP, ED or HD, or 0")
  source = "user"
  if max_vw_gpus is None:
    max_vw_gpus, source = default_max_vw_gpus(total_gpus, num_vws), "default: ceil(num_gpus / num_vws) + 1"
  elif max_vw_gpus < 1:
    raise AllocationError(f"max_vw_gpus must be >= 1, got {max_vw_gpus}")
  search = _AutoSearch(cluster, costs, num_vws, max_vw_gpus, max_num_inflight)
  plan = search.run()
  return dataclasses.replace(plan, search={"max_vw_gpus": max_vw_gpus, "max_vw_gpus_source": source,
                                           **search.stats})


def default_max_vw_gpus(num_gpus: int, num_vws: int) -> int:
  """The largest virtual worker ``auto`` considers by default: one GPU more than the equal share,
  ``ceil(N / num_vws) + 1`` (see the module docstring)."""
  return -(-num_gpus // num_vws) + 1


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
    u = inflight.additive_throughput_bounds_per_s(costs)
    self.u = [u[t] for t in self.types]
    self.link_group = _link_groups(cluster)
    self.total_types = self.type_counts([len(g) for g in self.by_class])
    # Every type-count vector a virtual worker may have (within the cluster's counts; at most max_size GPUs, and at
    # least what the other num_vws - 1 VWs of at most max_size GPUs each leave).
    min_size = max(1, sum(self.total_types) - (num_vws - 1) * self.max_size)
    self.vectors = [n for n in itertools.product(*(range(min(h, self.max_size) + 1) for h in self.total_types))
                    if min_size <= sum(n) <= self.max_size]
    # Nm levels (see :meth:`run`): one level per system Nm below the largest VW size, then one for every Nm from it on.
    self.tail_nm = max(1, min(self.max_size, self.cap))
    self.levels: list[tuple[int, int | None]] = [(m, m) for m in range(1, self.tail_nm)] + [(self.tail_nm, None)]
    self.level = self.levels[-1]
    self.type_bounds: dict[tuple, float] = {}
    self.relaxed: dict[tuple[int, ...], dict[int, float]] = {}  # type counts -> Nm -> relaxed-partition bound
    self.planners: dict = {}
    self.best_single: dict[tuple, float] = {}
    self.exact_of_take: dict[tuple, tuple[float, inflight.VwPlanner]] = {}
    self.best_total, self.best_split, self.target = 0.0, None, 0.0
    self.packing: dict[tuple, tuple[float, list[np.ndarray]]] = {}  # level -> (bar built at, grids)
    self.dead: dict[tuple, float] = {}  # (level, k, remaining up to renaming) -> bar at which no split of it beats it
    self.stats = {"leaves": 0, "nodes": 0, "exact_vws": 0, "type_bounds": 0, "packing_builds": 0, "dead_hits": 0,
                  "rounds": 0, "level_searches": 0}

  @property
  def bar(self) -> float:
    """The total a split must beat: the incumbent, or a higher target while :meth:`run` descends."""
    return max(self.best_total, self.target)

  def beats(self, per_vw: float) -> bool:
    """Whether a split whose slowest VW predicts ``per_vw`` minibatches/s would beat :attr:`bar`."""
    return per_vw > 0 and self.num_vws * per_vw > self.bar * (1 + 1e-9)

  def type_bound(self, n: tuple[int, ...]) -> float:
    """Upper bound on the best throughput over the current level's Nm of any VW with type counts ``n``: the smallest
    of the ``inflight`` bounds (additive; Little's law at the level's largest Nm; relaxed partition at its smallest
    Nm). The relaxed partition is only computed when the others, and the relaxed partition at a smaller Nm already
    computed (it is non-increasing in Nm: memory only grows), beat the bar."""
    key = (self.level, n)
    if key not in self.type_bounds:
      lo, hi = self.level
      kinds = [t for t, x in zip(self.types, n) for _ in range(x)]
      cheap = self.additive(n)
      if hi is not None and cheap > 0:
        cheap = min(cheap, inflight.little_bound_per_s(self.costs, kinds, hi))
      cheap = min([cheap] + [b for m, b in self.relaxed.get(n, {}).items() if m <= lo])
      if not self.beats(cheap):
        return cheap  # not cached: the relaxed bound may be needed once the bar is lower
      self.stats["type_bounds"] += 1
      relaxed = inflight.throughput_upper_bound_per_s(self.costs, kinds, self.link_group, lo)
      self.relaxed.setdefault(n, {})[lo] = relaxed
      self.type_bounds[key] = min(cheap, relaxed)
    return self.type_bounds[key]

  def gpus_of(self, take: Sequence[int]) -> list[Gpu]:
    return [g for c, x in enumerate(take) for g in self.by_class[c][:x]]

  def exact(self, take: tuple[int, ...]) -> tuple[float, inflight.VwPlanner]:
    """The VW's best predicted throughput over the current level's Nm, and its planner."""
    if (self.level, take) not in self.exact_of_take:
      gpus = self.gpus_of(take)
      planner = _vw_planner(self.costs, gpus, self.planners, self.cap)
      key = (self.level, shape_key(gpus))
      if key not in self.best_single:
        self.stats["exact_vws"] += 1
        self.best_single[key] = inflight.choose_system_num_inflight([planner], *self.level)[1]
      self.exact_of_take[(self.level, take)] = self.best_single[key], planner
    return self.exact_of_take[(self.level, take)]

  def additive(self, n: Sequence[int]) -> float:
    return sum(x * u for x, u in zip(n, self.u))

  def type_counts(self, per_class: Sequence[int]) -> tuple[int, ...]:
    have = [0] * len(self.types)
    for c, x in enumerate(per_class):
      have[self.class_type[c]] += x
    return tuple(have)

  def build_packing(self) -> None:
    """Packing relaxation at the current incumbent: ``packing[j][h]`` says whether type counts ``h`` contain ``j``
    disjoint type-count vectors whose :meth:`type_bound` beats the incumbent.

    Every VW of a split that beats the incumbent has a type vector whose bound beats it (the bound is an upper
    bound), and the VWs are disjoint, so a split of ``h`` into ``j`` VWs that beats the incumbent needs
    ``packing[j][h]``. Built as upward closures (a superset of a packable vector is packable) of the shifts of
    ``packing[j - 1]`` by the minimal good vectors; rebuilt when the incumbent improves.
    """
    self.stats["packing_builds"] += 1
    good = [n for n in self.vectors if self.beats(self.type_bound(n))]
    good_set = set(good)
    minimal = [n for n in good if not any(
        tuple(x - (i == t) for i, x in enumerate(n)) in good_set for t in range(len(n)) if n[t])]
    # Minimal among good vectors for the partial order; checking one-smaller neighbours is not enough when the
    # good set is not down-closed, so fall back to the full test for the remaining ones.
    minimal = [n for n in minimal if not any(m != n and all(a <= b for a, b in zip(m, n)) for m in good)]
    grids = self.pack_grids(minimal)
    self.packing[self.level] = self.bar, grids

  def pack_grids(self, minimal: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """``grids[j][h]``: whether type counts ``h`` contain ``j`` disjoint vectors each above one of ``minimal``."""
    shape = tuple(h + 1 for h in self.total_types)
    grids = [np.ones(shape, dtype=bool)]
    for _ in range(self.num_vws):
      prev, nxt = grids[-1], np.zeros(shape, dtype=bool)
      for m in minimal:
        src = tuple(slice(0, h + 1 - x) for h, x in zip(self.total_types, m))
        dst = tuple(slice(x, h + 1) for h, x in zip(self.total_types, m))
        nxt[dst] |= prev[src]
      for axis in range(len(shape)):
        nxt = np.logical_or.accumulate(nxt, axis=axis)
      grids.append(nxt)
      if not nxt.any():
        grids += [nxt] * (self.num_vws - len(grids) + 1)
        break
    return grids

  def packable(self, have: tuple[int, ...], k: int) -> bool:
    built = self.packing.get(self.level)
    if built is None or built[0] != self.bar:
      self.build_packing()
    return bool(self.packing[self.level][1][k][have])

  def type_vectors(self, have: tuple[int, ...], k: int, first_type: int) -> list[tuple[int, ...]]:
    """Type-count vectors of the next of ``k`` VWs out of ``have`` (containing ``first_type``; sizes that leave
    every later VW 1..max_size GPUs) whose bound beats the incumbent, those nearest an equal share of the additive
    bound first."""
    total = sum(have)
    lo = max(1, total - (k - 1) * self.max_size)
    hi = min(self.max_size, total - (k - 1))
    out = [n for n in self.vectors if n[first_type] and lo <= sum(n) <= hi and all(x <= h for x, h in zip(n, have))
           and self.beats(self.type_bound(n))]
    share = self.additive(have) / k
    return sorted(out, key=lambda n: abs(self.additive(n) - share))

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

  def canonical(self, rem: Sequence[int], k: int) -> tuple:
    """``rem`` up to renaming nodes of equal content (the cost model never sees node names), with ``k`` and the
    level."""
    return self.level, k, tuple(sorted((content, tuple(rem[c] for c in cls)) for content, cls in self.nodes))

  def search(self, rem: list[int], k: int, chosen: list, slowest: float) -> bool:
    """Extends ``chosen`` by every split of ``rem`` into ``k`` VWs that may beat the incumbent.

    Returns whether some completion had every VW beat the incumbent (a leaf was reached). When none did, no split
    of ``rem`` into ``k`` VWs has all VWs above ``incumbent / num_vws`` (every prune compares a VW's own value or
    bound, ``slowest`` being above it on entry), whatever ``chosen`` is; the incumbent did not change meanwhile
    (it only changes at a leaf), so the state is remembered as dead at every bar at least the current one.
    """
    self.stats["nodes"] += 1
    have = self.type_counts(rem)
    if not self.beats(slowest) or not self.packable(have, k):
      return False
    if k == 1:
      return self.leaf(rem, chosen, slowest)
    key = self.canonical(rem, k)
    if key in self.dead and self.bar >= self.dead[key]:
      self.stats["dead_hits"] += 1
      return False
    reached = False
    first_class = next(c for c, x in enumerate(rem) if x)
    for n in self.type_vectors(have, k, self.class_type[first_class]):
      rest = tuple(h - x for h, x in zip(have, n))
      if not self.beats(min(slowest, self.type_bound(n))) or not self.packable(rest, k - 1):
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
        reached |= self.search(rem, k - 1, chosen + [(take, planner)], min(slowest, e))
        for c, x in enumerate(take):
          rem[c] += x
    if not reached:
      self.dead[key] = self.bar
    return reached

  def any_level_packable(self, have: tuple[int, ...]) -> bool:
    """Whether ``have`` packs ``num_vws`` VWs above the bar at some level (cheap at a high bar: type bounds are
    only computed for vectors whose cheap bounds beat it)."""
    for self.level in self.levels[::-1]:
      if self.packable(have, self.num_vws):
        return True
    return False

  def search_levels(self, rem: list[int], k: int) -> None:
    """:meth:`search` of the whole cluster at every level."""
    for self.level in self.levels[::-1]:
      self.stats["level_searches"] += 1
      self.search(list(rem), k, [], np.inf)

  def leaf(self, rem: list[int], chosen: list, slowest: float) -> bool:
    take = tuple(rem)
    e, planner = self.exact(take)
    if not self.beats(min(slowest, e)):
      return False
    self.stats["leaves"] += 1
    _, total = inflight.choose_system_num_inflight([p for _, p in chosen] + [planner])
    if total > self.best_total * (1 + 1e-9):
      self.best_total, self.best_split = total, [t for t, _ in chosen] + [take]
    return True

  def run(self) -> SystemPlan:
    """Searches each Nm level (:attr:`levels`: the system Nm fixed at 1, 2, .., ``tail_nm - 1``, then any Nm from
    ``tail_nm`` on), so every VW's value at a level is its throughput over the level's Nm and the bounds can use that
    Nm's memory and round trip; a split's total is the largest over levels, so the best over levels is exact.

    Descends a target total from the largest packing bound over levels (each round: the search of every level with
    the target as the bar; a round in which no split reaches the target proves none exists), then searches every
    level with the incumbent it found as the bar, which makes the result exact (the descent only orders the work)."""
    rem = [len(g) for g in self.by_class]
    have, k = self.type_counts(rem), self.num_vws
    if sum(have) <= k * self.max_size:
      # A coarse start above every level's optimum (down to 1e-6 of the additive bound; below, the plain search).
      start = self.target = self.num_vws * max(self.additive(n) for n in self.vectors)
      while self.target > start * 1e-6 and not self.any_level_packable(have):
        self.target *= 1 - START_STEP
      self.target /= 1 - START_STEP
      while self.target > 0 and self.best_split is None and self.stats["rounds"] < MAX_TARGET_ROUNDS:
        self.stats["rounds"] += 1
        self.target *= 1 - TARGET_STEP
        self.search_levels(rem, k)
      self.target = 0.0
      self.search_levels(rem, k)
    if self.best_split is None:
      raise AllocationError(f"the model fits no allocation of {sum(len(g) for g in self.by_class)} GPUs into "
                            f"{self.num_vws} virtual workers of at most {self.max_size} GPUs each")
    vws = [self.gpus_of(take) for take in self.best_split]
    return plan_system(self.costs, vws, "auto", self.cap, self.planners)
