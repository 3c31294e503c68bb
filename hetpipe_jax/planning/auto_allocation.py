"""The ``auto`` allocation's search (HetPipe §8.1's NP / ED / HD generalised: :mod:`hetpipe_jax.planning.allocator`).

The search space is every allocation of all the cluster's GPUs into ``num_vws`` non-empty virtual workers of at most
``max_vw_gpus`` GPUs each, of any (also unequal) sizes (allocator's module docstring).
Method: branch and bound per system-Nm level (Nm fixed at 1 .. max VW size - 1, then any Nm from the max VW size
on; a split's total is its best over levels), one VW at a time (the one holding the first remaining class, so VW
order is not enumerated), type-count vectors then canonical node layouts; pruned by per-VW upper bounds at the
level (``inflight``'s additive, Little's-law and relaxed-partition bounds at the level's Nm, proofs there), by a
packing relaxation (the remaining GPUs must hold, per type, as many disjoint type vectors whose bound beats the bar
as VWs remain; in the search, also the best exact value over the vector's placements on the whole cluster must beat
it: :meth:`AutoSearch.best_placement`. It prunes only states with no split above the bar, so the leaves reached,
hence the incumbents and the result, are those of the search without it; GPT-2 large on hetpipe_paper_x4: millions
of states at Nm = 1, where the type bounds are loose, -> 100) and by a memo of states (level, remaining GPUs up to node renaming) proven dead at a bar. The bar
starts near the largest packing bound and descends 2 % per round until a split reaches it, then the incumbent found
is the bar; the descent only orders the work.

Planning layer: standard library and numpy only.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from hetpipe_jax.costs.cluster import ClusterSpec, Gpu
from hetpipe_jax.costs.cost_model import StageCosts
from hetpipe_jax.planning import inflight
from hetpipe_jax.planning.system_plan import (AllocationError, SystemPlan, node_contents, plan_system, shape_key,
                                               vw_planner)

TARGET_STEP = 0.02  # auto: each round of the descent lowers the target total by 2 % ...
MAX_TARGET_ROUNDS = 20  # ... for at most 20 rounds (to 0.67 x the packing bound); then the plain search
START_STEP = 0.1  # auto: the start target is found by lowering the additive bound 10 % at a time


def link_groups(cluster: ClusterSpec) -> dict[str, str]:
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


class AutoSearch:
  """Branch and bound over splits of the cluster into virtual workers (``auto``; see the module docstring).

  ``placement_bound`` (default True): the search's packing also drops type vectors none of whose placements beats
  the bar (:meth:`best_placement`); False: without it (the search before, kept for the tests that compare both).
  """

  def __init__(self, cluster: ClusterSpec, costs: StageCosts, num_vws: int, max_vw_gpus: int, max_num_inflight: int,
               placement_bound: bool = True):
    self.costs, self.num_vws, self.cap = costs, num_vws, max_num_inflight
    self.max_size = min(max_vw_gpus, costs.num_layers)  # every GPU needs a non-empty stage
    gpus = cluster.gpus()
    node_index = {n.name: i for i, n in enumerate(cluster.nodes)}
    self.classes = sorted({g.gpu_class for g in gpus}, key=lambda c: (node_index[c[1]], c[0]))
    self.by_class = [[g for g in gpus if g.gpu_class == c] for c in self.classes]
    self.types = sorted({t for t, _ in self.classes})
    self.class_type = [self.types.index(t) for t, _ in self.classes]
    contents = node_contents(gpus)
    # Nodes in order: (content, class indices). Nodes with equal content and equal remaining GPUs are interchangeable.
    self.nodes = [(contents[n.name], [i for i, c in enumerate(self.classes) if c[1] == n.name])
                  for n in cluster.nodes if n.name in contents]
    u = inflight.additive_throughput_bounds_per_s(costs)
    self.u = [u[t] for t in self.types]
    self.link_group = link_groups(cluster)
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
    self.packing: dict[tuple, tuple[float, list[np.ndarray]]] = {}  # (level, tight) -> (bar built at, grids)
    # search's packing also drops vectors no placement of which beats the bar (best_placement); run's start target
    # keeps the type bounds alone, so the descent's rounds, hence the incumbents, are those of the plain search
    self.tight, self.placement_bound = False, placement_bound  # placement_bound=False: the search without it
    self.placement_bounds: dict[tuple, float] = {}
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
      planner = vw_planner(self.costs, gpus, self.planners, self.cap)
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
    good = [n for n in self.vectors if self.beats(self.type_bound(n))
            and (not self.tight or self.beats(self.best_placement(n)))]
    good_set = set(good)
    minimal = [n for n in good if not any(
        tuple(x - (i == t) for i, x in enumerate(n)) in good_set for t in range(len(n)) if n[t])]
    # Minimal among good vectors for the partial order; checking one-smaller neighbours is not enough when the
    # good set is not down-closed, so fall back to the full test for the remaining ones.
    minimal = [n for n in minimal if not any(m != n and all(a <= b for a, b in zip(m, n)) for m in good)]
    grids = self.pack_grids(minimal)
    self.packing[(self.level, self.tight)] = self.bar, grids

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
    built = self.packing.get((self.level, self.tight))
    if built is None or built[0] != self.bar:
      self.build_packing()
    return bool(self.packing[(self.level, self.tight)][1][k][have])

  def best_placement(self, n: tuple[int, ...]) -> float:
    """The best exact value at the current level of any VW with type counts ``n``: the largest :meth:`exact` over
    every placement of ``n`` on the whole cluster (:meth:`layouts` of all GPUs, up to renaming nodes of equal
    content, which :meth:`exact` never sees). Every VW of a split is one of these placements, so its value is at
    most this (used by :meth:`search`'s packing, :attr:`tight`)."""
    key = (self.level, n)
    if key not in self.placement_bounds:
      full = [len(g) for g in self.by_class]
      self.placement_bounds[key] = max((self.exact(take)[0] for take in self.layouts(full, n, -1)), default=0.0)
    return self.placement_bounds[key]

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
    self.tight = self.placement_bound
    for self.level in self.levels[::-1]:
      self.stats["level_searches"] += 1
      self.search(list(rem), k, [], np.inf)
    self.tight = False

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
