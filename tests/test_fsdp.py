"""fsdp (ZeRO-3 / FSDP): closed-form costs, memory, the heterogeneous split, the engine, compare (issue 26).

Oracles written apart from the code: hand arithmetic on a hand-built profile and cluster, brute force over every
split of the examples and a grid over the shards.
"""

import itertools

import numpy as np
import pytest

from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import fsdp_cost
from hetpipe_jax.costs import profile_format
from hetpipe_jax.costs import task_times as task_times_lib
from hetpipe_jax.planning import compare
from hetpipe_jax.rules import methods
from hetpipe_jax.sim import engine

GB = 1e9


def _profile(params=(1e6, 2e6, 8e6), batch=4, remat_inputs=1_000):
  """Layer i: forward (i+1) GFLOP, backward 2(i+1) GFLOP, no memory traffic (1 ms / GFLOP at 1 TFLOP/s)."""
  layers = tuple(profile_format.LayerProfile(
      name=f"{i}:L", fwd_time_ms=None, bwd_time_ms=None, fwd_flops=1e9 * (i + 1), bwd_flops=2e9 * (i + 1),
      fwd_bytes_accessed=0.0, bwd_bytes_accessed=0.0, param_bytes=int(p), optimizer_state_bytes=int(2 * p),
      output_activation_bytes=remat_inputs, stash_bytes=40_000, workspace_bytes=7_000 * (i + 1))
      for i, p in enumerate(params))
  return profile_format.ModelProfile("hand", batch, "cpu", False, 5_000, "adam", layers)


def _cluster(nodes, types):
  """``nodes``: per node its GPU type names; ``types``: name -> (peak FLOP/s, memory bytes)."""
  return cluster_lib.cluster_from_dict({
      "name": "hand",
      "gpu_types": [{"name": n, "peak_fp32_flops_per_s": f, "peak_fp16_flops_per_s": f, "memory_bytes": int(m),
                     "memory_bandwidth_bytes_per_s": 1e15, "roofline_efficiency": 1.0} for n, (f, m) in types.items()],
      "nodes": [{"name": f"n{i}", "gpus": list(g)} for i, g in enumerate(nodes)],
      "intra_node_link": {"name": "pcie", "bandwidth_bytes_per_s": 1e10, "latency_s": 1e-6},
      "inter_node_link": {"name": "ib", "bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5}})


def test_method_in_the_rules_table():
  m = methods.get_method("fsdp")
  assert m.sharded and m.single_stage and m.sync == "allreduce" and m.is_flush
  assert "fsdp" in methods.METHODS and "fsdp" not in methods.HARNESS_METHODS


def test_zero3_communication_time_and_step_closed_form():
  """4 GPUs on 2 nodes, even shards: each GPU sends 3 x P x (N-1)/N bytes per step (all-gather forward, all-gather
  backward, reduce-scatter); each collective of layer l is a ring over the inter-node link, (N-1)/N P_l / B + (N-1) l;
  step (overlap) = sum max(F, AG) + sum max(B, 2 AG); no-overlap bound = sum (F + B) + 3 sum AG."""
  cl = _cluster([("A", "A"), ("A", "A")], {"A": (1e12, 1e12)})
  plan = fsdp_cost.plan_fsdp(cl, _profile(), "even")
  assert plan.bytes_sent_per_gpu == pytest.approx(3 * 11e6 * 3 / 4)
  ag = [0.75 * 1e6 / GB + 3e-5, 0.75 * 2e6 / GB + 3e-5, 0.75 * 8e6 / GB + 3e-5]  # 0.78, 1.53, 6.03 ms
  assert plan.allgather_s == pytest.approx(ag)
  f, b = [1e-3, 2e-3, 3e-3], [2e-3, 4e-3, 6e-3]
  assert plan.layer_forward_s == pytest.approx(f) and plan.layer_backward_s == pytest.approx(b)
  assert plan.step_s == pytest.approx(1e-3 + 2e-3 + 6.03e-3 + 2e-3 + 4e-3 + 12.06e-3)  # 27.09 ms: layer 2 comm-bound
  assert plan.step_no_overlap_s == pytest.approx(18e-3 + 3 * (0.78e-3 + 1.53e-3 + 6.03e-3))  # 43.02 ms
  assert plan.examples_per_s == pytest.approx(16 / 27.09e-3)
  # Bytes crossing nodes: a ring over 2 nodes crosses each node's boundary once per direction, 1.5 all-reduces.
  assert plan.cross_node_bytes == pytest.approx(1.5 * 2 * 2 * 3 / 4 * 11e6)


def test_memory_per_gpu_by_hand():
  """Even shards: 1/N of (params + gradients + optimizer state) + 3 x the largest layer + the batch's activations
  (max(stash, input) + the cost model's workspace beyond the stash); with remat: the layers' inputs + the largest
  layer stash + its workspace. Layer k's transient: XLA temp 7,000 (k+1) + the gradient it receives (its output,
  1,000) and the one it produces (its input: 5,000 for layer 0, 1,000 after)."""
  cl = _cluster([("A", "A"), ("A", "A")], {"A": (1e12, 1e12)})
  plan = fsdp_cost.plan_fsdp(cl, _profile(), "even")
  shard = (2 * 11e6 + 22e6) / 4  # 11e6
  transient = [7_000 + 5_000 + 1_000, 14_000 + 1_000 + 1_000, 21_000 + 1_000 + 1_000]
  workspace = max(transient[0] - 80_000, transient[1] - 40_000, transient[2])  # later layers' stash freed first
  assert plan.memory_bytes == pytest.approx([shard + 3 * 8e6 + 120_000 + workspace] * 4)
  remat = fsdp_cost.plan_fsdp(cl, _profile(), "even", remat=True)
  one_layer = max(40_000 + t for t in transient)
  assert remat.memory_bytes == pytest.approx([shard + 3 * 8e6 + (5_000 + 2 * 1_000) + one_layer] * 4)
  # remat recomputes each forward in the backward: B_l -> F_l + B_l.
  assert remat.layer_backward_s == pytest.approx([3e-3, 6e-3, 9e-3])
  # A GPU too small for its shard: does not fit, with the GPU and the bytes named.
  small = _cluster([("A", "A"), ("A", "A")], {"A": (1e12, 30e6)})
  with pytest.raises(fsdp_cost.FsdpInfeasibleError, match=r"does not fit: n0/0 \(A\) needs"):
    fsdp_cost.plan_fsdp(small, _profile(), "even")


def test_engine_step_equals_the_closed_form_on_a_homogeneous_cluster():
  cl = _cluster([("A", "A"), ("A", "A")], {"A": (1e12, 1e12)})
  plan = fsdp_cost.plan_fsdp(cl, _profile(), "even")
  times = task_times_lib.fsdp_task_times(plan)
  for shared in (True, False):
    report = engine.run(times, engine.EngineConfig(num_waves=6, num_inflight=1, records=False, method="fsdp",
                                                   shared_nic=shared))
    # The last step's compute ends 5 steps and 18 ms of compute in (hand values; one ring: NICs change nothing).
    assert report.makespan_s == pytest.approx(5 * 27.09e-3 + 18e-3)
    assert report.total_minibatches_per_s / 4 == pytest.approx(1 / 27.09e-3)


def test_compare_row_rate_is_the_closed_form_with_different_gpus():
  """The engine's fsdp row (lock-step replicas of different speeds) reads the closed form's rate, not the steady-state
  window's (which cuts the fast replicas' completions and reads low over few steps)."""
  cl = _cluster([("fast", "mid"), ("slow",)], {"fast": (3e12, 1e12), "mid": (2e12, 1e12), "slow": (1e12, 1e12)})
  plan = fsdp_cost.plan_fsdp(cl, _profile(), "even")  # 4 examples each: the GPUs' computes differ 3x
  row = compare.fsdp_row(plan, compare.CompareConfig(num_waves=16))
  assert row.images_per_s == pytest.approx(12 / plan.step_s)


def _hetero_case(params=(1e6, 2e6, 8e6)):
  # fast: 3 TFLOP/s but little memory (5 examples' activations beside the gathered layers); mid: 2 TFLOP/s; slow:
  # 1 TFLOP/s with plenty of memory.
  act = 143_000 / 4  # one example's activations (stash 120,000 + workspace 23,000 over batch 4)
  types = {"fast": (3e12, 3 * max(params) + 5 * act + 1), "mid": (2e12, 60e6), "slow": (1e12, 80e6)}
  return _cluster([("fast", "mid"), ("slow",)], types), act


def test_split_examples_against_brute_force():
  tau = [1.5e-3, 2.25e-3, 4.5e-3]
  for total, caps in ((12, [5, 10**9, 10**9]), (12, [10**9] * 3), (7, [1, 2, 10]), (9, [0, 4, 9])):
    got = fsdp_cost.split_examples(tau, total, caps)
    best = min(max(b * t for b, t in zip(split, tau))
               for split in itertools.product(range(total + 1), repeat=3) if sum(split) == total
               and all(b <= c for b, c in zip(split, caps)))
    assert sum(got) == total and all(b <= c for b, c in zip(got, caps))
    assert max(b * t for b, t in zip(got, tau)) == pytest.approx(best)
  assert fsdp_cost.split_examples(tau, 12, [10**9] * 3) == [6, 4, 2]  # faster GPUs get more examples
  with pytest.raises(fsdp_cost.FsdpInfeasibleError, match="holds the activations of 3 examples"):
    fsdp_cost.split_examples(tau, 4, [1, 1, 1])


def test_hetero_examples_by_speed_within_memory():
  """Cheap collectives (small layers): the plan gives each GPU examples by speed within its memory (the fast GPU's
  5), the brute-force optimum of the slowest GPU's compute."""
  params = (1e5, 2e5, 8e5)
  cl, _ = _hetero_case(params)
  plan = fsdp_cost.plan_fsdp(cl, _profile(params), "hetero")
  tau = [t * 18e-3 / 4 for t in (1 / 3, 1 / 2, 1.0)]  # seconds per example: 18 ms per batch of 4 at 1 TFLOP/s
  best = min(max(b * t for b, t in zip(split, tau))
             for split in itertools.product(range(13), repeat=3) if sum(split) == 12 and split[0] <= 5)
  assert sum(plan.examples) == 12 and plan.examples[0] == 5
  assert max(plan.compute_s) == pytest.approx(best)
  assert plan.examples[0] >= plan.examples[2] and plan.examples[1] >= plan.examples[2]
  # Without the memory cap the split follows speed alone: 6 / 4 / 2.
  roomy = _cluster([("fast", "mid"), ("slow",)], {"fast": (3e12, 1e12), "mid": (2e12, 1e12), "slow": (1e12, 1e12)})
  assert fsdp_cost.plan_fsdp(roomy, _profile(params), "hetero").examples == (6, 4, 2)


def test_hetero_keeps_the_faster_of_its_two_memory_caps():
  """Collective-bound layer (8 MB at 1 GB/s, padded to 3 x the largest shard): the fast GPU's 5 examples (memory left
  after the gathered layers) save compute that the collectives hide, and leave it a slightly smaller shard than
  reserving an even shard's memory (no examples for it) does; the plan keeps the shorter step of the two."""
  cl, act = _hetero_case()
  plan = fsdp_cost.plan_fsdp(cl, _profile(), "hetero")
  assert plan.examples == (0, 8, 4)
  state, gathered = 44e6, 24e6
  caps = [int((c - gathered) // act) for c in plan.capacity_bytes]
  examples = fsdp_cost.split_examples([1.5e-3, 2.25e-3, 4.5e-3], 12, caps)
  shards = fsdp_cost.memory_shards(state, [gathered + b * act for b in examples], plan.capacity_bytes)
  other = fsdp_cost._plan(cl, _profile(), "hetero", False, plan.gpus,
                          fsdp_cost.per_example_layer_ms(_profile(), cl, fsdp_cost.cost_model.CostModelConfig()),
                          plan.capacity_bytes, examples, shards)
  assert examples[0] == 5 and max(shards) > 0.49 and plan.step_s < other.step_s


def test_hetero_shards_by_memory_against_a_grid():
  """Shards minimise the largest shard subject to every GPU holding its own (padded collectives); a grid over the
  simplex finds no feasible sharding with a smaller largest shard, and the plan's is feasible."""
  state, fixed, cap = 44e6, [24e6 + 30_000, 24e6 + 90_000, 24e6 + 60_000], [30e6, 60e6, 80e6]
  f = fsdp_cost.memory_shards(state, fixed, cap)
  assert sum(f) == pytest.approx(1.0)
  assert all(x * state + c <= m * (1 + 1e-9) for x, c, m in zip(f, fixed, cap))
  step = 0.0025
  grid = [(a * step, b * step, 1 - (a + b) * step) for a in range(401) for b in range(401 - a)]
  feasible = [g for g in grid if all(x * state + c <= m for x, c, m in zip(g, fixed, cap))]
  best = min(max(g) for g in feasible)
  assert max(f) <= best + 1e-9 and max(f) >= best - step  # optimal, and the grid's best is within one step
  assert f[0] < f[1] == pytest.approx(f[2])  # the small GPU holds what fits, the others split the rest evenly
  # When every GPU holds an even share, the shards are even (no padding).
  assert fsdp_cost.memory_shards(state, fixed, [1e9] * 3) == pytest.approx([1 / 3] * 3)
  with pytest.raises(fsdp_cost.FsdpInfeasibleError, match="holds"):
    fsdp_cost.memory_shards(state, fixed, [25e6, 25e6, 25e6])


def test_uneven_shards_pad_the_collectives():
  params = (1e5, 2e5, 8e5)
  cl, _ = _hetero_case(params)
  plan = fsdp_cost.plan_fsdp(cl, _profile(params), "hetero")
  assert max(plan.shards) > 0.49  # the fast GPU holds (almost) no shard: the others about half each
  n, fmax = 3, max(plan.shards)
  assert plan.bytes_sent_per_gpu == pytest.approx(3 * (n - 1) / n * n * fmax * 11e5)
  assert plan.allgather_s[2] == pytest.approx((n - 1) / n * n * fmax * 8e5 / GB + (n - 1) * 1e-5)


def test_compare_lists_both_fsdp_variants():
  cluster = cluster_lib.load_cluster("hetpipe_paper")
  prof = profile_format.load_profile(profile_format.default_profile_path("gpt2_medium", 2, "cpu", False))
  table, every = compare.compare(cluster, prof, compare.CompareConfig(num_vws=4, num_waves=8))
  fsdp = [r for r in table if r.method == "fsdp"]
  assert [r.allocation for r in fsdp] == ["even shards (ZeRO-3) + remat", "shards by memory, batch by speed + remat"]
  assert all(r.images_per_s > 0 and r.gpus_used == 16 and r.memory_fits for r in fsdp)
  no_remat = [r for r in every if r.method == "fsdp" and "remat" not in r.allocation]
  assert len(no_remat) == 2 and all(not r.memory_fits and "does not fit" in r.notes[0] for r in no_remat)
  # The heterogeneous variant gives the fast GPUs more examples and runs faster than even shards here.
  assert fsdp[1].images_per_s > fsdp[0].images_per_s
  assert np.isfinite([r.images_per_s for r in table]).all()


def test_fsdp_validate_quick_end_to_end(tmp_path):
  """The one-host runtime (jax.sharding over 2 CPU devices) against the plain optax replay, and its timing report."""
  import json
  import subprocess
  import sys
  from hetpipe_jax.paths import REPO_ROOT
  out = tmp_path / "fsdp.json"
  env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "experiments/fsdp_validate.py", "--quick", f"--output={out}"], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  d = json.loads(out.read_text())
  num = d["numerics"]
  assert num["ok"] and num["max_abs_diff"] <= 1e-5 and num["weights_moved"] > 1e-3
  assert num["state_fraction_per_device"] == pytest.approx(0.5)  # every mlp_tiny leaf is split over the 2 devices
  assert num["collectives_in_hlo"]["all-gather"] > 0  # XLA gathers the sharded parameters
  t = d["timing"]
  assert t["measured_step_s"] > 0 and t["engine_step_s"] == pytest.approx(t["closed_form_step_s"])
  assert t["no_overlap_step_s"] >= t["closed_form_step_s"] >= t["compute_s"] > 0
  assert d["num_devices"] == 2 and d["global_batch"] == 16
  # The timing check states whether its assumption (a core per device, threads not waiting for one) held here.
  assert t["check"] in ("pass", "fail", "not valid on this host") and t["check_why"]
  waits = (t["core_wait_profile"], t["core_wait_steps"])
  if t["check"] == "not valid on this host":
    assert (d["host_cpus"] < 2 or any(not w["available"] or w["wait_fraction"] > t["max_core_wait"] for w in waits))
  else:
    assert all(w["available"] and w["wait_fraction"] <= t["max_core_wait"] for w in waits)
    assert (t["check"] == "pass") == t["within_10_percent"] == (abs(t["measured_over_engine"] - 1) <= 0.10)
  assert all(w["run_s"] > 0 for w in waits if w["available"])


def test_fsdp_compare_quick_rows_beside_hetpipe(tmp_path):
  """experiments/paper/fsdp_compare.py (REPRODUCTION.md's fsdp section), quick mode: HetPipe's best allocation
  first, then every other method and both fsdp variants, each with its bottleneck; predictions, not calibration."""
  import json
  from experiments.paper import fsdp_compare
  d = json.loads(open(fsdp_compare.run(str(tmp_path), True), encoding="utf-8").read())
  rows = d["rows"]
  assert [r["method"] for r in rows] == ["hetpipe", "pipedream", "gpipe", "1f1b_flush", "horovod", "fsdp", "fsdp"]
  het = [r for r in rows if r["method"] == "hetpipe"][0]
  assert het["rate"] > 0 and all(r["bottleneck"] for r in rows)
  assert all(r["rate"] > 0 and r["gpus"] == 16 for r in rows if r["method"] == "fsdp")
  assert d["claims"] and not any(c["calibrated"] for c in d["claims"])
  assert "| fsdp | shards by memory, batch by speed" in d["markdown"] and d["quick"]
