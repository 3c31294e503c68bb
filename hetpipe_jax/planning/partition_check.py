"""Reference partitioners for small instances: brute force and a MILP (scipy.optimize.milp / HiGHS).

Both solve exactly the problem of ``partitioner.partition_dp`` (min over GPU orderings and contiguous cuts of the
maximum stage time, every stage within its GPU's memory) and exist to cross-check it (HetPipe §7 used CPLEX).

Planning layer: standard library, numpy and scipy only.
"""

from __future__ import annotations

import itertools

import numpy as np
from scipy import optimize, sparse

from hetpipe_jax.planning.partitioner import Partition, PartitionProblem, evaluate, link_between


def partition_brute_force(problem: PartitionProblem) -> Partition | None:
  """Enumerates every distinct ordering of GPU classes and every cut; returns an optimum or None if none fits.

  Exponential: for tests on small instances only.
  """
  n_layers = problem.costs.num_layers
  k = len(problem.gpus)
  best: Partition | None = None
  seen = set()
  for perm in itertools.permutations(problem.gpus):
    key = tuple(g.gpu_class for g in perm)
    if key in seen:
      continue
    seen.add(key)
    for inner in itertools.combinations(range(1, n_layers), k - 1):
      cuts = (0,) + inner + (n_layers,)
      p = evaluate(problem, perm, list(zip(cuts[:-1], cuts[1:])))
      if p.fits and (best is None or p.max_stage_time_ms < best.max_stage_time_ms - 1e-12):
        best = p
  return best


def partition_milp(problem: PartitionProblem) -> tuple[float, Partition | None]:
  """Solves the partitioning problem as a MILP with HiGHS; returns (optimal max stage time ms, partition).

  Variables: ``z[s, i, j, g]`` = 1 when stage s runs layers ``[i, j)`` on GPU g (only memory-feasible triples
  are created); ``u[s, b, g, h]`` in [0, 1] >= (stage s ends at b on g) + (stage s+1 starts at b on h) - 1,
  which charges the receive times at cut b over the link between g and h; ``t`` the makespan. Each stage has one
  (range, GPU); each GPU one stage; stage 0 starts at 0, the last ends at L, consecutive stages meet; for every
  stage ``compute + receives <= t``. Minimise t. ``(inf, None)`` when infeasible.
  """
  c = problem.costs
  n_layers = c.num_layers
  gpus = list(problem.gpus)
  k = len(gpus)
  ranges = [(i, j) for i in range(n_layers) for j in range(i + 1, n_layers + 1)]
  z_index: dict[tuple[int, int, int, int], int] = {}
  for s in range(k):
    mem = c.memory_matrix_bytes(s == k - 1, k, problem.num_inflight,
                                problem.held_per_stage[s] if problem.held_per_stage is not None else None)
    for (i, j) in ranges:
      if (s == 0) != (i == 0) or (s == k - 1) != (j == n_layers):
        continue
      for g, gpu in enumerate(gpus):
        if mem[i, j] <= c.capacity_bytes[gpu.gpu_type]:
          z_index[(s, i, j, g)] = len(z_index)
  u_index: dict[tuple[int, int, int, int], int] = {}
  for s in range(k - 1):
    for b in range(1, n_layers):
      for g in range(k):
        for h in range(k):
          if g != h:
            u_index[(s, b, g, h)] = len(z_index) + len(u_index)
  t_var = len(z_index) + len(u_index)
  n_vars = t_var + 1
  rows, cols, vals, lo, hi = [], [], [], [], []

  def add(coeffs: dict[int, float], lb: float, ub: float) -> None:
    r = len(lo)
    for col, v in coeffs.items():
      rows.append(r)
      cols.append(col)
      vals.append(v)
    lo.append(lb)
    hi.append(ub)

  for s in range(k):
    add({v: 1.0 for (s2, _, _, _), v in z_index.items() if s2 == s}, 1, 1)
  for g in range(k):
    add({v: 1.0 for (_, _, _, g2), v in z_index.items() if g2 == g}, 1, 1)
  for s in range(k - 1):
    for b in range(1, n_layers):
      coeffs = {v: 1.0 for (s2, _, j, _), v in z_index.items() if s2 == s and j == b}
      for (s2, i, _, _), v in z_index.items():
        if s2 == s + 1 and i == b:
          coeffs[v] = coeffs.get(v, 0.0) - 1.0
      add(coeffs, 0, 0)
  for (s, b, g, h), v in u_index.items():
    coeffs = {v: 1.0}
    for (s2, _, j, g2), zv in z_index.items():
      if s2 == s and j == b and g2 == g:
        coeffs[zv] = -1.0
    for (s2, i, _, h2), zv in z_index.items():
      if s2 == s + 1 and i == b and h2 == h:
        coeffs[zv] = -1.0
    add(coeffs, -1, np.inf)
  for s in range(k):
    coeffs: dict[int, float] = {t_var: -1.0}
    for (s2, i, j, g), v in z_index.items():
      if s2 == s:
        coeffs[v] = c.compute_ms(gpus[g].gpu_type, i, j)
    for (s2, b, g, h), v in u_index.items():
      if s2 == s - 1:  # stage s receives activations at cut b on GPU h from g.
        coeffs[v] = coeffs.get(v, 0.0) + float(c.recv_ms[link_between(gpus[g], gpus[h])][b])
      if s2 == s:  # stage s receives gradients at cut b on GPU g from h.
        coeffs[v] = coeffs.get(v, 0.0) + float(c.recv_ms[link_between(gpus[g], gpus[h])][b])
    add(coeffs, -np.inf, 0)
  a = sparse.csr_matrix((vals, (rows, cols)), shape=(len(lo), n_vars))
  objective = np.zeros(n_vars)
  objective[t_var] = 1.0
  integrality = np.zeros(n_vars)
  integrality[:len(z_index)] = 1
  bounds = optimize.Bounds(np.zeros(n_vars), np.concatenate([np.ones(n_vars - 1), [np.inf]]))
  res = optimize.milp(objective, constraints=optimize.LinearConstraint(a, lo, hi), integrality=integrality,
                      bounds=bounds, options={"mip_rel_gap": 1e-9})
  if res.status != 0 or res.x is None:
    return float("inf"), None
  chosen = sorted((s, i, j, g) for (s, i, j, g), v in z_index.items() if res.x[v] > 0.5)
  partition = evaluate(problem, [gpus[g] for (_, _, _, g) in chosen], [(i, j) for (_, i, j, _) in chosen])
  return float(res.x[t_var]), partition
