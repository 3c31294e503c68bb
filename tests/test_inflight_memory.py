"""The schedule-based in-flight memory bound (``sim/inflight_memory``, ``CostModelConfig.inflight_memory``).

Oracles written apart from the code: an event simulation of HetPipe §4's rules written here from the rules' text
(per stage an in-order device fed FIFO as tasks become ready; a stage holds a minibatch from its forward's dispatch
until its backward ends), closed forms for a bottleneck-first and a bottleneck-last pipeline, and brute force over
every partition for the partitioner.
"""

import heapq
import itertools

import numpy as np
import pytest

from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs import profile_format
from hetpipe_jax.costs import task_times
from hetpipe_jax.planning import partition_check
from hetpipe_jax.planning import partitioner
from hetpipe_jax.sim import engine
from hetpipe_jax.sim import inflight_memory
from tests import test_partitioner as tp


def oracle_peaks(times: task_times.VWTaskTimes, num_inflight: int, num_minibatches: int) -> list[int]:
  """Peak held per stage, simulated from the rules' text (no code shared with the engine or PipelineRules)."""
  n_st = times.num_stages
  last = n_st - 1

  def duration(stage, kind):
    if stage == last:
      return times.forward_backward_s + (times.send_gradient_s[-1] if n_st > 1 else 0.0)
    if kind == "F":
      return times.forward_s[stage] + times.send_activation_s[stage]
    return times.backward_s[stage] + (times.send_gradient_s[stage - 1] if stage > 0 else 0.0)

  free = [0.0] * n_st
  held, peak = [0] * n_st, [0] * n_st
  events, seq = [], itertools.count()
  injected = 0

  def ready(t, stage, kind, mb):
    # Dispatched to the stage's in-order device at once (FIFO by readiness); it ends after the tasks before it.
    if kind in ("F", "FB"):
      held[stage] += 1
      peak[stage] = max(peak[stage], held[stage])
      if kind == "FB":
        held[stage] -= 1  # the last stage holds a minibatch only while its one task runs
    end = max(t, free[stage]) + duration(stage, kind)
    free[stage] = end
    heapq.heappush(events, (end, next(seq), stage, kind, mb))

  def inject(t):
    nonlocal injected
    ready(t, 0, "FB" if n_st == 1 else "F", injected)
    injected += 1

  for _ in range(min(num_inflight, num_minibatches)):
    inject(0.0)
  while events:
    t, _, stage, kind, mb = heapq.heappop(events)
    if kind == "F":
      ready(t, stage + 1, "FB" if stage + 1 == last else "F", mb)
      continue
    if kind == "B":
      held[stage] -= 1
    if stage > 0:
      ready(t, stage - 1, "B", mb)
    elif injected < num_minibatches:  # the minibatch completed: one more may enter
      inject(t)
  return peak


def random_times(seed: int) -> tuple[task_times.VWTaskTimes, int]:
  rng = np.random.default_rng(seed)
  s_count = int(rng.integers(1, 6))
  nm = int(rng.integers(1, 9))
  stage_ms = rng.uniform(0.1, 10.0, size=s_count) * np.where(rng.random(s_count) < 0.3, 8.0, 1.0)
  times = task_times.uniform_task_times(list(stage_ms), fwd_fraction=float(rng.uniform(0.2, 0.5)),
                                        send_ms=float(rng.uniform(0.0, 1.0)))
  return times, nm


@pytest.mark.parametrize("seed", range(30))
def test_bound_equals_the_oracle_peak_of_a_much_longer_run(seed):
  times, nm = random_times(seed)
  bound = inflight_memory.held_peaks_for_times(times, nm)
  long = 4 * inflight_memory.num_minibatches_for_bound(times.num_stages, nm)
  # Safe: no stage ever holds more in a 4x longer run; reached: some run at these times attains it.
  assert list(bound) == oracle_peaks(times, nm, long), (seed, bound)
  assert all(1 <= b <= nm for b in bound) and bound[-1] == 1


def test_some_random_bound_is_tighter_than_conservative():
  # The bound is worth having only if it is sometimes below Nm: count the stages where it is.
  tighter = sum(b < nm for seed in range(30) for times, nm in [random_times(seed)]
                for b in inflight_memory.held_peaks_for_times(times, nm)[:-1])
  assert tighter >= 5, tighter


def test_closed_forms_bottleneck_first_and_last():
  # Stage 0 slow, the rest fast: each minibatch runs through stages 1..3 and back before the next arrives, so they
  # hold 1; stage 0 receives the Nm injected minibatches at once and holds all of them.
  fast_after = task_times.uniform_task_times([10.0, 0.1, 0.1, 0.1])
  assert inflight_memory.held_peaks_for_times(fast_after, 6) == (6, 1, 1, 1)
  # Last stage slow: every minibatch has gone through stages 0..2 and queues at the last: all hold Nm.
  slow_last = task_times.uniform_task_times([0.1, 0.1, 0.1, 10.0])
  assert inflight_memory.held_peaks_for_times(slow_last, 6) == (6, 6, 6, 1)
  assert inflight_memory.held_peaks_for_times(slow_last, 6) == tuple(cost_model.max_inflight_per_stage(4, 6))


@pytest.mark.parametrize("seed", range(8))
def test_bound_holds_with_several_vws_and_wsp_waits(seed):
  # Limit (2) of the module doc: WSP waits are not in the single-VW run; check random multi-VW runs with PS
  # transfers and D in {0, 1} stay within it.
  times, nm = random_times(100 + seed)
  rng = np.random.default_rng(seed)
  bound = inflight_memory.held_peaks_for_times(times, nm)
  vws = []
  for _ in range(3):
    scale = float(rng.uniform(0.5, 2.0))
    vws.append(task_times.VWTaskTimes(
        forward_s=times.forward_s, backward_s=times.backward_s, forward_backward_s=times.forward_backward_s,
        send_activation_s=times.send_activation_s, send_gradient_s=times.send_gradient_s,
        push_s=scale * 0.005, pull_s=scale * 0.005))
  for d in (0, 1):
    report = engine.run(vws, engine.EngineConfig(num_waves=30, num_inflight=nm, staleness_bound=d, records=False))
    for vw in report.vws:
      assert all(p <= b for p, b in zip(vw.peak_inflight_per_stage, bound)), (seed, d, vw.peak_inflight_per_stage,
                                                                                bound)


def test_memory_matrix_with_a_held_count_and_errors():
  rng = np.random.default_rng(0)
  profile = tp.random_profile(rng, 5)
  costs = cost_model.build_stage_costs(profile, tp.random_cluster(rng, 10**9))
  nm, h = 5, 2
  params = costs.param_prefix[3] - costs.param_prefix[1]
  opt = costs.optimizer_prefix[3] - costs.optimizer_prefix[1]
  stash = costs.stash_prefix[3] - costs.stash_prefix[1]
  inp, grad = costs.boundary_bytes[1], costs.boundary_bytes[3]
  expected = (params * (1 + nm + 1) + opt + h * (max(stash, inp) + grad) + (nm - h) * inp
              + costs.workspace_max[1, 3])
  assert costs.stage_memory_bytes(1, 3, False, 4, nm, held=h) == pytest.approx(expected)
  # Held Nm is the conservative count.
  assert costs.stage_memory_bytes(1, 3, False, 4, nm, held=nm) == costs.stage_memory_bytes(1, 3, False, 4, nm)
  with pytest.raises(ValueError, match="held=6"):
    costs.stage_memory_bytes(1, 3, False, 4, nm, held=6)
  with pytest.raises(ValueError, match="inflight_memory"):
    cost_model.CostModelConfig(inflight_memory="tight")
  with pytest.raises(ValueError, match="inflight_memory='schedule' is for method 'hetpipe'"):
    cost_model.CostModelConfig(inflight_memory="schedule", method="pipedream")


@pytest.mark.parametrize("seed", range(0, 30, 3))
def test_dp_with_per_position_held_counts_equals_brute_force_and_milp(seed):
  problem = tp.random_problem(seed)
  rng = np.random.default_rng(seed)
  k = len(problem.gpus)
  held = tuple(int(rng.integers(1, problem.num_inflight + 1)) for _ in range(k - 1)) + (1,)
  problem = partitioner.PartitionProblem(problem.costs, problem.gpus, problem.num_inflight, held)
  fitting = [p for p in tp._all_partitions(problem) if p.fits]
  milp_value, _ = partition_check.partition_milp(problem)
  try:
    dp = partitioner.partition_dp(problem)
  except partitioner.InfeasiblePartitionError:
    dp = None
  if not fitting:
    assert dp is None and milp_value == float("inf")
    return
  best = min(p.max_stage_time_ms for p in fitting)
  assert dp is not None and dp.fits and dp.held_per_stage == held
  np.testing.assert_allclose(dp.max_stage_time_ms, best, rtol=1e-9)
  np.testing.assert_allclose(milp_value, best, rtol=1e-6)


def schedule_problem(seed: int) -> tuple[partitioner.PartitionProblem, partitioner.PartitionProblem]:
  base = tp.random_problem(seed)
  nm = base.num_inflight + 2  # larger Nm: more room between the two counts
  conservative = partitioner.PartitionProblem(base.costs, base.gpus, nm)
  costs = cost_model.StageCosts(**{**base.costs.__dict__,
                                   "config": cost_model.CostModelConfig(inflight_memory="schedule")})
  return conservative, partitioner.PartitionProblem(costs, base.gpus, nm)


@pytest.mark.parametrize("seed", range(30))
def test_schedule_partition_fits_at_its_own_peaks_and_is_no_worse(seed):
  conservative, schedule = schedule_problem(seed)
  try:
    cons = partitioner.partition_dp(conservative)
  except partitioner.InfeasiblePartitionError:
    cons = None
  try:
    sched = partitioner.partition_dp(schedule)
  except partitioner.InfeasiblePartitionError:
    sched = None
  # Brute force: every partition evaluated at its own schedule peaks.
  own = [p for p in tp._all_partitions(schedule) if p.fits]
  if sched is None:
    assert cons is None  # never less feasible than the conservative count
    return
  peaks = inflight_memory.schedule_held_per_stage(schedule.costs, sched.gpus, sched.ranges, schedule.num_inflight)
  assert sched.held_per_stage == peaks and sched.fits
  assert sched.max_stage_time_ms >= min(p.max_stage_time_ms for p in own) * (1 - 1e-9)
  if cons is not None:
    assert sched.max_stage_time_ms <= cons.max_stage_time_ms * (1 + 1e-9)
    assert all(c == schedule.num_inflight for c in cons.held_per_stage[:-1])


def slow_first_problem(inflight_memory: str, num_inflight: int = 4) -> partitioner.PartitionProblem:
  """Three equal layers on a slow GPU "A" with ample memory and two 20x faster GPUs "B", "C" whose memory fits a
  one-layer non-last stage holding 1 minibatch (~1.1e8 bytes) but not Nm = 4 (~4e8)."""
  types = [{"name": n, "peak_fp32_flops_per_s": f, "peak_fp16_flops_per_s": f, "memory_bytes": m,
            "memory_bandwidth_bytes_per_s": 1e15} for n, f, m in (("A", 1e11, 10**10), ("B", 2e12, 2 * 10**8),
                                                                    ("C", 2e12, 2 * 10**8))]
  cl = cluster_lib.cluster_from_dict({
      "name": "slow_first", "gpu_types": types, "nodes": [{"name": "n0", "gpus": ["A", "B", "C"]}],
      "intra_node_link": {"name": "pcie", "bandwidth_bytes_per_s": 1e10},
      "inter_node_link": {"name": "net", "bandwidth_bytes_per_s": 1e9}})
  layers = tuple(profile_format.LayerProfile(
      name=f"{i}:L", fwd_time_ms=None, bwd_time_ms=None, fwd_flops=1e10, bwd_flops=2e10, fwd_bytes_accessed=1e6,
      bwd_bytes_accessed=2e6, param_bytes=10**6, optimizer_state_bytes=10**6, output_activation_bytes=10**6,
      stash_bytes=10**8, workspace_bytes=0) for i in range(3))
  profile = profile_format.ModelProfile("slow_first", 8, "none", False, 10**6, "momentum", layers)
  costs = cost_model.build_stage_costs(profile, cl, cost_model.CostModelConfig(inflight_memory=inflight_memory))
  return partitioner.PartitionProblem(costs, tuple(cl.gpus()), num_inflight)


def test_schedule_mode_fits_what_the_conservative_count_cannot():
  # Conservative: stages 0 and 1 hold Nm = 4 (~4e8 bytes), which only A fits: no partition.
  with pytest.raises(partitioner.InfeasiblePartitionError, match="num_inflight=4"):
    partitioner.partition_dp(slow_first_problem("conservative"))
  # Schedule: A first is the bottleneck; each minibatch runs through B and C and back before the next arrives, so
  # they hold 1 (closed form), and the partition fits.
  part = partitioner.partition_dp(slow_first_problem("schedule"))
  assert part.gpus[0].gpu_type == "A" and part.held_per_stage == (4, 1, 1) and part.fits
  # The memory recorded is the one-held formula: below B's capacity, above what holding Nm would need there.
  assert part.stage_memory_bytes[1] <= 2 * 10**8 < slow_first_problem("conservative").costs.stage_memory_bytes(
      1, 2, False, 3, 4)


def test_hand_built_costs_are_rejected_in_schedule_mode():
  conservative, schedule = schedule_problem(0)
  costs = cost_model.StageCosts(**{**schedule.costs.__dict__, "forward_prefix_ms": None})
  with pytest.raises(ValueError, match="forward_prefix_ms is None"):
    partitioner.partition_dp(partitioner.PartitionProblem(costs, schedule.gpus, schedule.num_inflight))
