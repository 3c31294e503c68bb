"""Partitioner: the DP's optimum equals brute force and the MILP on random small instances (HetPipe §4, §7)."""

import itertools

import numpy as np
import pytest

from hetpipe_jax.planning import cluster as cluster_lib
from hetpipe_jax.planning import cost_model
from hetpipe_jax.planning import partition_check
from hetpipe_jax.planning import partitioner
from hetpipe_jax.planning import profile_format


def random_cluster(rng: np.random.Generator, capacity_bytes: int) -> cluster_lib.ClusterSpec:
  types = []
  for name in ("A", "B", "C"):
    types.append({"name": name, "peak_fp32_flops_per_s": float(rng.uniform(1e12, 8e12)),
                  "peak_fp16_flops_per_s": 1e13, "memory_bytes": int(capacity_bytes * rng.uniform(0.6, 1.4)),
                  "memory_bandwidth_bytes_per_s": float(rng.uniform(1e11, 5e11))})
  return cluster_lib.cluster_from_dict({
      "name": "random", "gpu_types": types,
      "nodes": [{"name": "n0", "gpus": ["A", "A", "B"]}, {"name": "n1", "gpus": ["B", "C", "C"]}],
      "intra_node_link": {"name": "pcie", "bandwidth_bytes_per_s": float(rng.uniform(5e9, 2e10))},
      "inter_node_link": {"name": "net", "bandwidth_bytes_per_s": float(rng.uniform(5e8, 3e9)),
                          "latency_s": 1e-4}})


def random_profile(rng: np.random.Generator, num_layers: int) -> profile_format.ModelProfile:
  layers = []
  for i in range(num_layers):
    flops = float(rng.uniform(1e9, 2e10))
    layers.append(profile_format.LayerProfile(
        name=f"{i}:L", fwd_time_ms=None, bwd_time_ms=None, fwd_flops=flops, bwd_flops=2 * flops,
        fwd_bytes_accessed=float(rng.uniform(1e7, 1e8)), bwd_bytes_accessed=float(rng.uniform(2e7, 2e8)),
        param_bytes=int(rng.integers(1e6, 5e7)), optimizer_state_bytes=int(rng.integers(1e6, 5e7)),
        output_activation_bytes=int(rng.integers(1e6, 3e7)), stash_bytes=int(rng.integers(1e6, 6e7)),
        workspace_bytes=int(rng.integers(0, 1e7))))
  return profile_format.ModelProfile("random", 8, "none", False, 4_000_000, "momentum", tuple(layers))


def random_problem(seed: int) -> partitioner.PartitionProblem:
  rng = np.random.default_rng(seed)
  num_layers = int(rng.integers(3, 8))
  capacity = int(rng.uniform(1.5e8, 6e8))
  cl = random_cluster(rng, capacity)
  costs = cost_model.build_stage_costs(random_profile(rng, num_layers), cl)
  gpus = cl.gpus()
  k = int(rng.integers(1, min(num_layers, 4) + 1))
  chosen = tuple(gpus[i] for i in sorted(rng.choice(len(gpus), size=k, replace=False)))
  return partitioner.PartitionProblem(costs, chosen, int(rng.integers(1, 4)))


@pytest.mark.parametrize("seed", range(30))
def test_dp_equals_brute_force_and_milp(seed):
  problem = random_problem(seed)
  brute = partition_check.partition_brute_force(problem)
  milp_value, milp_partition = partition_check.partition_milp(problem)
  try:
    dp = partitioner.partition_dp(problem)
  except partitioner.InfeasiblePartitionError:
    dp = None
  if brute is None:
    assert dp is None and milp_partition is None and milp_value == float("inf")
    return
  assert dp is not None and milp_partition is not None
  np.testing.assert_allclose(dp.max_stage_time_ms, brute.max_stage_time_ms, rtol=1e-9)
  np.testing.assert_allclose(milp_value, brute.max_stage_time_ms, rtol=1e-6)
  np.testing.assert_allclose(milp_partition.max_stage_time_ms, brute.max_stage_time_ms, rtol=1e-6)
  assert dp.fits and milp_partition.fits
  assert sum(j - i for i, j in dp.ranges) == problem.costs.num_layers


def test_random_instances_include_infeasible_and_multi_stage_cases():
  kinds = set()
  for seed in range(30):
    problem = random_problem(seed)
    brute = partition_check.partition_brute_force(problem)
    kinds.add("infeasible" if brute is None else f"stages>1:{len(problem.gpus) > 1}")
  assert kinds == {"infeasible", "stages>1:True", "stages>1:False"}


def _all_fitting_partitions(problem):
  n, k = problem.costs.num_layers, len(problem.gpus)
  for perm in itertools.permutations(problem.gpus):
    for inner in itertools.combinations(range(1, n), k - 1):
      cuts = (0,) + inner + (n,)
      p = partitioner.evaluate(problem, perm, list(zip(cuts[:-1], cuts[1:])))
      if p.fits:
        yield p


@pytest.mark.parametrize("seed", range(10))
def test_dp_minimises_total_time_among_min_max_optima(seed):
  problem = random_problem(seed)
  candidates = list(_all_fitting_partitions(problem))
  if not candidates:
    return
  best_max = min(p.max_stage_time_ms for p in candidates)
  best_sum = min(sum(p.stage_time_ms) for p in candidates if p.max_stage_time_ms <= best_max * (1 + 1e-9))
  dp = partitioner.partition_dp(problem)
  np.testing.assert_allclose(sum(dp.stage_time_ms), best_sum, rtol=1e-9)


def test_infeasible_reports_best_attempt_and_excess():
  problem = random_problem(0)
  tiny = problem.costs.__class__(**{**problem.costs.__dict__,
                                    "capacity_bytes": {k: 1000 for k in problem.costs.capacity_bytes}})
  problem = partitioner.PartitionProblem(tiny, problem.gpus, 2)
  with pytest.raises(partitioner.InfeasiblePartitionError, match=r"exceeds by .* GiB") as info:
    partitioner.partition_dp(problem)
  attempt = info.value.best_attempt
  assert attempt is not None and not attempt.fits
  assert attempt.gpus[0].gpu_id in str(info.value)
  assert "num_inflight=2" in str(info.value)


def test_fewer_layers_than_gpus_is_an_error():
  rng = np.random.default_rng(0)
  cl = random_cluster(rng, 10**9)
  costs = cost_model.build_stage_costs(random_profile(rng, 2), cl)
  with pytest.raises(ValueError, match="fewer than the 3 GPUs"):
    partitioner.partition_dp(partitioner.PartitionProblem(costs, tuple(cl.gpus()[:3]), 1))


def test_evaluate_rejects_ranges_that_do_not_tile():
  problem = random_problem(5)
  k = len(problem.gpus)
  with pytest.raises(ValueError, match="covering"):
    partitioner.evaluate(problem, problem.gpus, [(0, 1)] * k if k > 1 else [(0, 1)] if
                         problem.costs.num_layers > 1 else [(0, 2)])


def test_identical_gpus_in_one_node_give_balanced_cuts():
  rng = np.random.default_rng(1)
  cl = random_cluster(rng, 10**12)
  prof = random_profile(rng, 8)
  flat = [profile_format.LayerProfile(**{**l.__dict__, "fwd_flops": 1e10, "bwd_flops": 2e10,
                                         "fwd_bytes_accessed": 1.0, "bwd_bytes_accessed": 1.0,
                                         "output_activation_bytes": 1}) for l in prof.layers]
  costs = cost_model.build_stage_costs(profile_format.ModelProfile(**{**prof.__dict__, "layers": tuple(flat)}),
                                       cl)
  two_a = tuple(g for g in cl.gpus() if g.gpu_type == "A")
  p = partitioner.partition_dp(partitioner.PartitionProblem(costs, two_a, 1))
  assert p.ranges == ((0, 4), (4, 8))


def test_dp_equals_brute_force_on_resnet152_with_three_gpu_types():
  cl = cluster_lib.load_cluster("hetpipe_paper")
  prof = profile_format.load_profile(profile_format.default_profile_path("resnet152_imagenet", 32, "cpu", False))
  costs = cost_model.build_stage_costs(prof, cl)
  gpus = cl.gpus()
  problem = partitioner.PartitionProblem(costs, (gpus[0], gpus[8], gpus[12]), 2)  # V, G, Q: 6 orders x C(52, 2)
  brute = partition_check.partition_brute_force(problem)
  np.testing.assert_allclose(partitioner.partition_dp(problem).max_stage_time_ms, brute.max_stage_time_ms,
                             rtol=1e-9)
