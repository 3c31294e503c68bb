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
  The search itself: :mod:`hetpipe_jax.planning.auto_allocation`.

Planning layer: standard library and numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from hetpipe_jax.costs.cluster import ClusterSpec, Gpu
from hetpipe_jax.costs.cost_model import StageCosts
from hetpipe_jax.planning import auto_allocation
from hetpipe_jax.planning import inflight
from hetpipe_jax.planning.system_plan import AllocationError, SystemPlan, plan_system

POLICIES = ("NP", "ED", "HD", "auto")


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


def _exact_sums(values) -> bool:
  """Whether every float sum of any subset of ``values``, in any order, is exact: all are whole numbers and their
  absolute total is at most 2**53 (every partial sum is then a representable integer)."""
  return all(float(v).is_integer() for v in values) and sum(abs(float(v)) for v in values) <= 2.0**53


def _pairings(rest: list[str], node_class: dict[str, tuple] | None = None):
  """Every pairing of ``rest`` (first node with the 2nd, 3rd, ... node, then recursively), in that order.

  ``node_class``: given, a partner whose class equals that of an earlier partner of the same node at the same
  level is skipped: swapping the two nodes maps that partner's pairings onto the earlier one's (all enumerated
  before) with the same class pairs, hence (see :func:`hd_node_pairs`) the same score.
  """
  if not rest:
    yield []
    return
  seen = set()
  for i in range(1, len(rest)):
    if node_class is not None:
      if node_class[rest[i]] in seen:
        continue
      seen.add(node_class[rest[i]])
    for tail in _pairings(rest[1:i] + rest[i + 1:], node_class):
      yield [(rest[0], rest[i])] + tail


def hd_node_pairs(cluster: ClusterSpec, exhaustive: bool = False) -> list[tuple[str, str]]:
  """The pairing of nodes whose pairs are most alike in aggregate peak FP32 FLOP/s and memory (see module doc).

  Of equal scores the first pairing in :func:`_pairings`' order wins. A pairing's score depends on its pairs' sums
  of node FLOP/s and memory; when those sums are exact in any order (:func:`_exact_sums`; the shipped clusters:
  whole FLOP/s and bytes), it depends only on the multiset of pairs of node classes ``(FLOP/s, memory)``, so the
  pairings :func:`_pairings` skips with ``node_class`` each have an equal-score pairing earlier in the order and the
  first minimum is unchanged (tests/test_allocator.py checks it against ``exhaustive``); 16 nodes of 4 classes:
  2,027,025 pairings -> a few hundred. Otherwise, or with ``exhaustive=True``, every pairing is scored.
  """
  nodes = [n.name for n in cluster.nodes]
  if len(nodes) % 2:
    raise AllocationError(f"HD pairs nodes: the cluster has an odd number of nodes ({len(nodes)})")
  flops = {n.name: sum(cluster.gpu_types[t].peak_fp32_flops_per_s for t in n.gpu_types) for n in cluster.nodes}
  mem = {n.name: sum(cluster.gpu_types[t].memory_bytes for t in n.gpu_types) for n in cluster.nodes}

  def score(pairs):
    return max(_spread([flops[a] + flops[b] for a, b in pairs]), _spread([mem[a] + mem[b] for a, b in pairs]))

  exact = _exact_sums(flops.values()) and _exact_sums(mem.values())
  node_class = None if exhaustive or not exact else {n: (flops[n], mem[n]) for n in nodes}
  return min(_pairings(nodes, node_class), key=score)


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
  search = auto_allocation.AutoSearch(cluster, costs, num_vws, max_vw_gpus, max_num_inflight)
  plan = search.run()
  return dataclasses.replace(plan, search={"max_vw_gpus": max_vw_gpus, "max_vw_gpus_source": source,
                                           **search.stats})


def default_max_vw_gpus(num_gpus: int, num_vws: int) -> int:
  """The largest virtual worker ``auto`` considers by default: one GPU more than the equal share,
  ``ceil(N / num_vws) + 1`` (see the module docstring)."""
  return -(-num_gpus // num_vws) + 1
