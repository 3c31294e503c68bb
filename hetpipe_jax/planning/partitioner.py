"""Exact model partitioner for one virtual worker (HetPipe §4 "Model Partitioning", §7).

Finds contiguous layer ranges, one per GPU, and the GPUs' order, minimising the maximum stage time
(``cost_model.StageCosts.stage_time_ms``) with every stage fitting its GPU's memory for ``Nm`` in-flight
minibatches. Among min-max optima it returns one with the least total stage time (shorter round trip, so the
pipeline saturates at a smaller Nm).

The dynamic program covers every distinct ordering of the GPUs without listing permutations. GPUs of one class
``(gpu_type, node)`` are interchangeable, so a state is ``(i, m, c, l)``: the current stage starts at layer ``i``
and runs on class ``c``; ``m`` is the multiset of classes used so far including ``c``; ``l`` is the link over
which the current stage receives its input (none / intra-node / inter-node). The value is the best objective of
stages from ``i`` to the end; a transition picks the current stage's end ``j`` and the next stage's class, which
fixes the link the current stage receives gradients over, so each stage's time is exact. Vectorised over ``i``
and ``j`` with numpy: ``O(#multisets * #classes^2 * 2 * L^2)``.

Planning layer: standard library and numpy only.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs.cluster import Gpu
from hetpipe_jax.costs.cost_model import INTER, INTRA, StageCosts
from hetpipe_jax.rules import methods
from hetpipe_jax.sim import inflight_memory

GIB = float(2**30)


@dataclasses.dataclass(frozen=True)
class PartitionProblem:
  """One virtual worker's partitioning problem.

  Attributes:
    costs: per-range costs of the model on the cluster.
    gpus: the virtual worker's GPUs (any order; the partitioner picks the stage order).
    num_inflight: Nm, minibatches in flight (sets the memory each stage needs).
    held_per_stage: per stage position, the minibatches the stage is counted to hold (``[S]``); None: the cost
      model's rule (``costs.config.inflight_memory``: the method's closed form, or with ``"schedule"`` each
      partition's own schedule peaks, :mod:`hetpipe_jax.sim.inflight_memory`).
  """

  costs: StageCosts
  gpus: tuple[Gpu, ...]
  num_inflight: int
  held_per_stage: tuple[int, ...] | None = None

  @property
  def schedule_memory(self) -> bool:
    """Whether the held counts come from the schedule rules at each partition's times (and are not given)."""
    return self.held_per_stage is None and self.costs.config.inflight_memory == "schedule"


@dataclasses.dataclass(frozen=True)
class Partition:
  """A partition of the model over a virtual worker's GPUs, with its predicted costs.

  Attributes:
    gpus: GPUs in stage order.
    ranges: half-open layer ranges ``(start, end)`` per stage.
    stage_time_ms: predicted time per minibatch of each stage (compute + receives), ms.
    stage_memory_bytes: predicted memory of each stage, bytes.
    capacity_bytes: usable memory of each stage's GPU, bytes.
    num_inflight: the Nm the memory was computed for.
    held_per_stage: the minibatches each stage was counted to hold in ``stage_memory_bytes``.
  """

  gpus: tuple[Gpu, ...]
  ranges: tuple[tuple[int, int], ...]
  stage_time_ms: tuple[float, ...]
  stage_memory_bytes: tuple[float, ...]
  capacity_bytes: tuple[int, ...]
  num_inflight: int
  held_per_stage: tuple[int, ...] = ()

  @property
  def max_stage_time_ms(self) -> float:
    return max(self.stage_time_ms)

  @property
  def fits(self) -> bool:
    return all(m <= c for m, c in zip(self.stage_memory_bytes, self.capacity_bytes))

  @property
  def throughput_per_s(self) -> float:
    """Predicted minibatches/s (``cost_model.vw_throughput_per_s``)."""
    return cost_model.vw_throughput_per_s(list(self.stage_time_ms), self.num_inflight)


class InfeasiblePartitionError(ValueError):
  """No partition exists: none fits in memory (``best_attempt``: the partition with the least relative memory
  overflow), or the model has fewer layers than the VW has GPUs (``best_attempt`` None)."""

  def __init__(self, message: str, best_attempt: Partition | None):
    super().__init__(message)
    self.best_attempt = best_attempt


def link_between(a: Gpu, b: Gpu) -> str:
  return INTRA if a.node == b.node else INTER


def evaluate(problem: PartitionProblem, gpus: Sequence[Gpu], ranges: Sequence[tuple[int, int]]) -> Partition:
  """Costs of a given partition (the single definition every solver is checked against).

  Args:
    problem: the problem.
    gpus: GPUs in stage order (a permutation of ``problem.gpus``).
    ranges: contiguous non-empty half-open layer ranges covering ``0..L``.

  Raises:
    ValueError: ranges that do not tile the layers, or GPUs that are not the problem's.
  """
  c = problem.costs
  s_count = len(gpus)
  if sorted(g.gpu_id for g in gpus) != sorted(g.gpu_id for g in problem.gpus):
    raise ValueError("gpus must be a permutation of the virtual worker's GPUs")
  if len(ranges) != s_count or ranges[0][0] != 0 or ranges[-1][1] != c.num_layers or any(
      a[1] != b[0] for a, b in zip(ranges, ranges[1:])) or any(i >= j for i, j in ranges):
    raise ValueError(f"ranges {list(ranges)} are not {s_count} non-empty contiguous ranges covering "
                     f"0..{c.num_layers}")
  held = _held(problem)
  if problem.schedule_memory:
    held = inflight_memory.schedule_held_per_stage(c, gpus, ranges, problem.num_inflight)
  times, mems, caps = [], [], []
  for s, (g, (i, j)) in enumerate(zip(gpus, ranges)):
    prev = link_between(gpus[s - 1], g) if s > 0 else None
    nxt = link_between(g, gpus[s + 1]) if s < s_count - 1 else None
    times.append(c.stage_time_ms(g.gpu_type, i, j, prev, nxt))
    mems.append(c.stage_memory_bytes(i, j, s == s_count - 1, s_count, problem.num_inflight, held[s]))
    caps.append(c.capacity_bytes[g.gpu_type])
  return Partition(tuple(gpus), tuple((int(i), int(j)) for i, j in ranges), tuple(times), tuple(mems),
                   tuple(caps), problem.num_inflight, tuple(int(h) for h in held))


def _held(problem: PartitionProblem) -> tuple[int, ...]:
  """Per stage position, the held count the memory rule uses for ``problem`` (the closed form unless given; the
  schedule mode's search starts from a given one)."""
  s_count = len(problem.gpus)
  if problem.held_per_stage is not None:
    if len(problem.held_per_stage) != s_count:
      raise ValueError(f"held_per_stage has {len(problem.held_per_stage)} entries for {s_count} stages")
    return tuple(problem.held_per_stage)
  method = methods.get_method(problem.costs.config.method)
  return tuple(methods.max_held_per_stage(method, s_count, problem.num_inflight))


def _classes(gpus: Sequence[Gpu]) -> tuple[list[tuple[str, str]], list[int], dict[tuple[str, str], list[Gpu]]]:
  by_class: dict[tuple[str, str], list[Gpu]] = {}
  for g in sorted(gpus, key=lambda g: g.gpu_id):
    by_class.setdefault(g.gpu_class, []).append(g)
  classes = sorted(by_class)
  return classes, [len(by_class[c]) for c in classes], by_class


def _dp(classes: list[tuple[str, str]], counts: list[int], mid: list[np.ndarray], last: list[np.ndarray],
        recv: dict[str | None, np.ndarray], combine: str,
        limit: float = np.inf) -> tuple[float, list[int], list[int]]:
  """Core DP. ``mid[k][c]``/``last[c]``: ``[L+1, L+1]`` cost of a non-last stage at position k / the last stage
  ``[i, j)`` on class c (inf = not allowed); ``recv[link]``: ``[L+1]`` cost added for receiving at cut b.
  ``combine``: "max" or "sum"; a stage whose full cost exceeds ``limit`` is not allowed.
  Returns (objective, class index per stage, cut positions ``[0, ..., L]``)."""
  cap = lambda x: x if limit == np.inf else np.where(x <= limit, x, np.inf)
  n_layers = last[0].shape[0] - 1
  total = sum(counts)
  nodes = [c[1] for c in classes]
  link = lambda a, b: INTRA if nodes[a] == nodes[b] else INTER
  op = np.maximum if combine == "max" else np.add
  table: dict[tuple[tuple[int, ...], int, str | None], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
  multisets = sorted(itertools.product(*(range(n + 1) for n in counts)), key=sum, reverse=True)
  for m in multisets:
    k = sum(m)
    if k == 0:
      continue
    nexts = [c2 for c2 in range(len(classes)) if m[c2] < counts[c2]]
    grown = [tuple(x + (y == c2) for y, x in enumerate(m)) for c2 in nexts]
    for c in range(len(classes)):
      if m[c] == 0:
        continue
      before = list(m)
      before[c] -= 1
      if k == 1:
        links = [None]
      else:
        links = sorted({link(p, c) for p in range(len(classes)) if before[p] > 0})
      for pl in links:
        a = recv[pl]
        if k == total:
          val = cap(last[c][:, n_layers] + a)
          table[(m, c, pl)] = (val, np.full(n_layers + 1, n_layers), np.full(n_layers + 1, -1))
          continue
        # Every next class at once: candidates [next class, i, j], first minimum in (class, j) order.
        nls = [link(c, c2) for c2 in nexts]
        fnext = np.stack([table[(m2, c2, nl)][0] for m2, c2, nl in zip(grown, nexts, nls)])
        rnext = np.stack([recv[nl] for nl in nls])
        cand = op(cap(mid[k - 1][c][None] + a[None, :, None] + rnext[:, None, :]), fnext[:, None, :])
        flat = cand.transpose(1, 0, 2).reshape(n_layers + 1, -1)
        idx = flat.argmin(axis=1)
        best = flat[np.arange(n_layers + 1), idx]
        found = np.isfinite(best)
        jbest = np.where(found, idx % (n_layers + 1), 0)
        cbest = np.where(found, np.asarray(nexts)[idx // (n_layers + 1)], -1)
        table[(m, c, pl)] = (best, jbest, cbest)
  best_val, best_c = np.inf, -1
  for c in range(len(classes)):
    m = tuple(1 if x == c else 0 for x in range(len(classes)))
    v = table[(m, c, None)][0][0]
    if v < best_val:
      best_val, best_c = float(v), c
  if not np.isfinite(best_val):
    return best_val, [], []
  order, cuts = [best_c], [0]
  m, c, pl, i = tuple(1 if x == best_c else 0 for x in range(len(classes))), best_c, None, 0
  while True:
    _, jarr, carr = table[(m, c, pl)]
    j, c2 = int(jarr[i]), int(carr[i])
    cuts.append(j)
    if c2 < 0:
      break
    nl = link(c, c2)
    m = tuple(x + (1 if y == c2 else 0) for y, x in enumerate(m))
    order.append(c2)
    c, pl, i = c2, nl, j
  return best_val, order, cuts


def _to_partition(problem: PartitionProblem, classes, by_class, order: list[int], cuts: list[int]) -> Partition:
  pools = {c: list(g) for c, g in by_class.items()}
  gpus = [pools[classes[c]].pop(0) for c in order]
  return evaluate(problem, gpus, list(zip(cuts[:-1], cuts[1:])))


def _cost_tables(problem: PartitionProblem, classes, held: Sequence[int]):
  """``mid[k][c]``, ``last[c]`` (compute ms, inf where memory does not fit) and the same as memory/capacity ratios,
  for stage position k holding ``held[k]`` (positions with equal counts share one table)."""
  c = problem.costs
  s_count = len(problem.gpus)
  mem_last = c.memory_matrix_bytes(True, s_count, problem.num_inflight, held[-1])
  comps = [c.compute_matrix_ms(gtype) for gtype, _ in classes]
  caps = [c.capacity_bytes[gtype] for gtype, _ in classes]
  last = [np.where(mem_last <= cap, comp, np.inf) for comp, cap in zip(comps, caps)]
  last_ratio = [np.where(np.isfinite(comp), mem_last / cap, np.inf) for comp, cap in zip(comps, caps)]
  by_count = {}
  for h in set(held[:-1]) if s_count > 1 else ():
    mem_mid = c.memory_matrix_bytes(False, s_count, problem.num_inflight, h)
    by_count[h] = ([np.where(mem_mid <= cap, comp, np.inf) for comp, cap in zip(comps, caps)],
                   [np.where(np.isfinite(comp), mem_mid / cap, np.inf) for comp, cap in zip(comps, caps)])
  mid = [by_count[h][0] for h in held[:-1]]
  mid_ratio = [by_count[h][1] for h in held[:-1]]
  return mid, last, mid_ratio, last_ratio


def _check_stageable(problem: PartitionProblem) -> None:
  """Every GPU of a VW needs a non-empty stage of contiguous layers (HetPipe §4).

  Raises:
    ValueError: no GPUs.
    InfeasiblePartitionError: fewer layers than GPUs (no partition exists; the planner's callers report it as
      "no plan" with the fix).
  """
  if not problem.gpus:
    raise ValueError("a virtual worker needs at least one GPU")
  n_layers = problem.costs.num_layers
  if n_layers < len(problem.gpus):
    raise InfeasiblePartitionError(
        f"the model has {n_layers} layers, fewer than the {len(problem.gpus)} GPUs of the virtual worker (every GPU "
        "needs a non-empty stage): give each virtual worker at most that many GPUs (more virtual workers, or "
        "another allocation policy)", None)


def partition_dp(problem: PartitionProblem) -> Partition:
  """Optimal partition of one virtual worker (exact; see the module docstring).

  Args:
    problem: costs, the virtual worker's GPUs and Nm.

  With ``inflight_memory="schedule"`` (and no ``held_per_stage``) each stage is counted to hold its own schedule
  peak (:func:`hetpipe_jax.sim.inflight_memory.self_consistent_partition`: exact for the held counts it ends
  with, a search over those counts; its largest stage time is at most the conservative optimum's).

  Returns:
    The :class:`Partition` minimising the maximum stage time (ties: least total time).

  Raises:
    ValueError: no GPUs.
    InfeasiblePartitionError: fewer layers than GPUs (``best_attempt`` None), or no ordering and cut fits every
      GPU's memory; the message names the best attempt's stages, their GPUs and by how much each exceeds its memory.
  """
  _check_stageable(problem)
  n_layers = problem.costs.num_layers
  if problem.schedule_memory:
    return _schedule_partition(problem)
  classes, counts, by_class = _classes(problem.gpus)
  mid, last, mid_ratio, last_ratio = _cost_tables(problem, classes, _held(problem))
  recv = {None: np.zeros(n_layers + 1), **problem.costs.recv_ms}
  best, order, cuts = _dp(classes, counts, mid, last, recv, "max")
  if not np.isfinite(best):
    zero = {k: np.zeros(n_layers + 1) for k in recv}
    _, order, cuts = _dp(classes, counts, mid_ratio, last_ratio, zero, "max")
    attempt = _to_partition(problem, classes, by_class, order, cuts)
    raise InfeasiblePartitionError(infeasibility_message(attempt), attempt)
  # Second pass: least total time among partitions whose every stage is within the optimum.
  limit = best * (1 + 1e-9) + 1e-12
  total, order2, cuts2 = _dp(classes, counts, mid, last, recv, "sum", limit)
  if np.isfinite(total):
    cand = _to_partition(problem, classes, by_class, order2, cuts2)
    if cand.max_stage_time_ms <= limit:
      return cand
  return _to_partition(problem, classes, by_class, order, cuts)


def _schedule_partition(problem: PartitionProblem) -> Partition:
  """:func:`partition_dp` under ``inflight_memory="schedule"``: the self-consistent search, the result evaluated at
  its own schedule peaks (so its recorded memory and held counts are the schedule's)."""
  errors = []

  def solve(held):
    try:
      return partition_dp(dataclasses.replace(problem, held_per_stage=held))
    except InfeasiblePartitionError as e:
      errors.append(e)
      return None

  held_of = lambda p: inflight_memory.schedule_held_per_stage(problem.costs, p.gpus, p.ranges, problem.num_inflight)
  part = inflight_memory.self_consistent_partition(solve, held_of, len(problem.gpus), problem.num_inflight)
  if part is None:
    raise InfeasiblePartitionError(f"{errors[-1]} (inflight_memory='schedule': every stage counted to hold at least "
                                   "its own schedule peak)", errors[-1].best_attempt)
  out = evaluate(problem, part.gpus, part.ranges)
  assert out.fits, (out, part)
  return out


def min_max_stage_time_ms(problem: PartitionProblem) -> float:
  """The optimum of :func:`partition_dp`'s first pass alone: the least possible maximum stage time (ms) over every
  GPU order and cut that fits memory; ``inf`` when none fits. Cheaper than :func:`partition_dp` (no tie-break pass,
  no partition built); used for bounds. Under ``inflight_memory="schedule"`` every stage is counted to hold one
  minibatch (the least any schedule peak can be), so the value stays a lower bound.

  Raises:
    ValueError: no GPUs.
    InfeasiblePartitionError: fewer layers than GPUs.
  """
  _check_stageable(problem)
  n_layers = problem.costs.num_layers
  classes, counts, _ = _classes(problem.gpus)
  # Schedule mode: every stage holds at least 1, so the least held counts bound every partition's memory from below.
  held = (1,) * len(problem.gpus) if problem.schedule_memory else _held(problem)
  mid, last, _, _ = _cost_tables(problem, classes, held)
  recv = {None: np.zeros(n_layers + 1), **problem.costs.recv_ms}
  return float(_dp(classes, counts, mid, last, recv, "max")[0])


def infeasibility_message(attempt: Partition) -> str:
  """Names every stage of ``attempt`` that exceeds its GPU's memory, with the excess in GiB."""
  parts = []
  for s, (g, (i, j), mem, cap) in enumerate(zip(attempt.gpus, attempt.ranges, attempt.stage_memory_bytes,
                                                 attempt.capacity_bytes)):
    if mem > cap:
      parts.append(f"stage {s} on GPU {g.gpu_id} ({g.gpu_type}) layers [{i}, {j}) needs {mem / GIB:.2f} GiB > "
                   f"{cap / GIB:.2f} GiB usable (exceeds by {(mem - cap) / GIB:.2f} GiB)")
  gpus = ", ".join(g.gpu_id for g in attempt.gpus)
  return (f"no partition over GPUs [{gpus}] fits in memory with num_inflight={attempt.num_inflight}; best attempt: "
          + "; ".join(parts))
