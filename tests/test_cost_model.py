"""Cost model: stage time and memory formulas, roofline estimates, in-flight bound (HetPipe §4, §7)."""

import dataclasses
import json

import numpy as np
import pytest

from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs import profile_format
from hetpipe_jax.costs import task_times
from hetpipe_jax.sim import engine


def tiny_profile(measured=False):
  layers = tuple(profile_format.LayerProfile(
      name=f"{i}:L", fwd_time_ms=1.0 + i if measured else None, bwd_time_ms=2.0 + i if measured else None,
      fwd_flops=1e9 * (i + 1), bwd_flops=2e9 * (i + 1), fwd_bytes_accessed=1e6, bwd_bytes_accessed=2e6,
      param_bytes=1000 * (i + 1), optimizer_state_bytes=2000 * (i + 1), output_activation_bytes=10_000 * (i + 1),
      stash_bytes=50_000, workspace_bytes=7 * (i + 1)) for i in range(4))
  return profile_format.ModelProfile("tiny", 8, "cpu", measured, 5_000, "adam", layers)


def test_roofline_and_measured_times():
  paper = cluster_lib.load_cluster("hetpipe_paper")
  titan_v = paper.gpu_types["TITAN V"]
  t = cost_model.layer_times_ms(tiny_profile(), titan_v, cost_model.CostModelConfig(compute_efficiency=0.5))
  expected0 = 1e3 * (1e9 / (titan_v.peak_fp32_flops_per_s * 0.5) + 2e9 / (titan_v.peak_fp32_flops_per_s * 0.5))
  assert t[0] == pytest.approx(expected0)
  cpu = cluster_lib.load_cluster("local_cpu").gpu_types["cpu"]
  np.testing.assert_allclose(cost_model.layer_times_ms(tiny_profile(True), cpu, cost_model.CostModelConfig()),
                             [3.0, 5.0, 7.0, 9.0])


def test_calibrated_efficiency_reproduces_measured_total():
  # tiny_profile measures 3 + 5 + 7 + 9 = 24 ms. On a device with 2e12 FLOP/s and 1e9 B/s, the roofline at
  # efficiency 1 is, per layer (fwd + bwd, ms): max(0.5 (i+1), 1) + max(1.0 (i+1), 2) = 3, 3, 4.5, 6 (layers 0-1
  # memory-bound, 2-3 compute-bound), 16.5 in all, so e = 16.5 / 24; at e every layer takes 1/e longer and the
  # total is the measured 24 ms.
  cpu = cluster_lib.load_cluster("local_cpu").gpu_types["cpu"]
  dev = dataclasses.replace(cpu, peak_fp32_flops_per_s=2e12, memory_bandwidth_bytes_per_s=1e9)
  prof = tiny_profile(True)
  e = cost_model.calibrate_efficiency(prof, dev)
  assert e == pytest.approx(16.5 / 24.0, rel=1e-12)
  roofline = dataclasses.replace(dev, measured_device_kind=None)
  est = cost_model.layer_times_ms(prof, roofline, cost_model.CostModelConfig(compute_efficiency=e,
                                                                             memory_efficiency=e))
  np.testing.assert_allclose(est, np.array([3.0, 3.0, 4.5, 6.0]) / e, rtol=1e-12)
  assert est.sum() == pytest.approx(24.0, rel=1e-12)
  # The calibration reads the measured device's own peak numbers even though the measured times are what the
  # cost model uses on it: local_cpu's nominal 5e10 FLOP/s give 60 (1+2+3+4) = 600 ms at efficiency 1 (memory
  # terms 0.05 + 0.1 ms lose every max), so e = 600 / 24 = 25: the measurements beat the nominal peak, an
  # efficiency CostModelConfig rejects (it must be in (0, 1]).
  assert cost_model.calibrate_efficiency(prof, cpu) == pytest.approx(25.0, rel=1e-12)
  with pytest.raises(ValueError, match="compute_efficiency must be in"):
    cost_model.CostModelConfig(compute_efficiency=25.0)
  with pytest.raises(ValueError, match="no measured times"):
    cost_model.calibrate_efficiency(tiny_profile(False), cpu)


def test_stage_time_adds_receives_over_the_right_links():
  paper = cluster_lib.load_cluster("hetpipe_paper")
  costs = cost_model.build_stage_costs(tiny_profile(), paper)
  compute = costs.compute_ms("TITAN V", 1, 3)
  intra = paper.intra_node_link.transfer_time_s(10_000) * 1e3  # cut 1: output of layer 0
  inter = paper.inter_node_link.transfer_time_s(30_000) * 1e3  # cut 3: output of layer 2
  assert costs.stage_time_ms("TITAN V", 1, 3, cost_model.INTRA, cost_model.INTER) == pytest.approx(
      compute + intra + inter)
  assert costs.stage_time_ms("TITAN V", 0, 4, None, None) == pytest.approx(costs.compute_ms("TITAN V", 0, 4))


def test_stage_memory_formula():
  costs = cost_model.build_stage_costs(tiny_profile(), cluster_lib.load_cluster("hetpipe_paper"))
  nm = 3
  # Non-last stage [0, 2): holds Nm; params (3000) x (1 + Nm versions + accumulator) + optimizer (6000)
  # + Nm x (max(stash 100000, input 5000) + gradient at cut 2 (20000)) + workspace: layer k's transient is its XLA
  # temp (7 (k + 1)) + the gradients at its input and output (layer 0: 5000 + 10000, layer 1: 10000 + 20000); layer
  # 1 runs with the whole stash live (30014 more), layer 0's backward after layer 1's stash (50000) is freed
  # (15007 - 50000 < 0), so 30014.
  assert costs.stage_memory_bytes(0, 2, False, 2, nm) == (
      3000 * (1 + nm + 1) + 6000 + nm * (100_000 + 20_000) + 30_014)
  # Last stage [2, 4): holds 1, no extra versions, Nm - 1 queued inputs at cut 2 (20000); workspace: layer 3's
  # 28 + 30000 + 40000 (layer 2's 21 + 20000 + 30000 comes after layer 3's 50000 of stash is freed).
  assert costs.stage_memory_bytes(2, 4, True, 2, nm) == 7000 * 2 + 14000 + 100_000 + (nm - 1) * 20_000 + 70_028


def test_max_inflight_bound_values_and_errors():
  assert cost_model.max_inflight_per_stage(4, 6) == [6, 6, 6, 1]
  assert cost_model.max_inflight_per_stage(1, 5) == [1]
  with pytest.raises(ValueError, match="num_inflight"):
    cost_model.max_inflight_per_stage(3, 0)
  with pytest.raises(ValueError, match="num_stages"):
    cost_model.max_inflight_per_stage(0, 2)


def simulate_peak_held(stage_ms, num_inflight, num_minibatches=40):
  """Runs HetPipe §4's rules (``schedule.PipelineRules`` through the event engine) with every task of stage s
  (forward, backward or the last stage's forward+backward) taking ``stage_ms[s]``; returns per-stage peak held."""
  per_task_s = [t * 1e-3 for t in stage_ms]
  no_send = (0.0,) * (len(stage_ms) - 1)
  times = task_times.VWTaskTimes(forward_s=tuple(per_task_s[:-1]), backward_s=tuple(per_task_s[:-1]),
                                 forward_backward_s=per_task_s[-1], send_activation_s=no_send,
                                 send_gradient_s=no_send, push_s=0.0, pull_s=0.0)
  config = engine.EngineConfig(num_waves=-(-num_minibatches // num_inflight), num_inflight=num_inflight,
                               staleness_bound=0, records=False)
  return engine.run([times], config).vws[0].peak_inflight_per_stage


@pytest.mark.parametrize("seed", range(20))
def test_simulated_peaks_never_exceed_the_bound(seed):
  rng = np.random.default_rng(seed)
  s_count = int(rng.integers(1, 6))
  nm = int(rng.integers(1, 8))
  stage_ms = list(rng.uniform(0.1, 10.0, size=s_count))
  peak = simulate_peak_held(stage_ms, nm)
  bound = cost_model.max_inflight_per_stage(s_count, nm)
  assert all(p <= b for p, b in zip(peak, bound)), (stage_ms, nm, peak, bound)


def test_bound_is_reached_and_min_nm_s_minus_s_is_not_safe():
  # Fast stages before a slow stage 2: it runs all Nm forwards before its first backward, and so do 0 and 1.
  assert simulate_peak_held([0.1, 0.1, 10.0, 0.1], num_inflight=6) == cost_model.max_inflight_per_stage(4, 6)
  # Even equal stage times exceed the tempting closed form min(Nm, S - s) (which allows 3 on stage 1).
  assert simulate_peak_held([1.0, 1.0, 1.0, 1.0], num_inflight=6)[1] == 6 > min(6, 4 - 1)


def test_throughput_closed_form_and_saturation():
  assert cost_model.vw_throughput_per_s([100.0, 100.0, 100.0, 100.0], 1) == pytest.approx(2.5)
  assert cost_model.vw_throughput_per_s([100.0, 100.0, 100.0, 100.0], 4) == pytest.approx(10.0)
  assert cost_model.vw_throughput_per_s([100.0, 100.0, 100.0, 100.0], 9) == pytest.approx(10.0)
  assert cost_model.saturating_num_inflight([100.0, 50.0, 50.0]) == 2


def test_per_type_roofline_efficiency_replaces_the_config_efficiencies():
  # tiny_profile layer 3 on a 2e12 FLOP/s, 1e9 B/s device: compute 4e9 / 2e12 = 2 ms fwd, 8e9 / 2e12 = 4 ms bwd;
  # memory 1e6 / 1e9 = 1 ms, 2e6 / 1e9 = 2 ms. At the type's own efficiency 0.25 both terms grow 4x: max(8, 4) +
  # max(16, 8) = 24 ms, whatever the config says; a type without one keeps the config's (0.5: 12 ms).
  cpu = cluster_lib.load_cluster("local_cpu").gpu_types["cpu"]
  dev = dataclasses.replace(cpu, peak_fp32_flops_per_s=2e12, memory_bandwidth_bytes_per_s=1e9,
                            measured_device_kind=None)
  config = cost_model.CostModelConfig(compute_efficiency=0.5, memory_efficiency=0.5)
  assert cost_model.layer_times_ms(tiny_profile(), dev, config)[3] == pytest.approx(12.0, rel=1e-12)
  own = dataclasses.replace(dev, roofline_efficiency=0.25)
  assert cost_model.layer_times_ms(tiny_profile(), own, config)[3] == pytest.approx(24.0, rel=1e-12)
  # Memory-bound layer 0 (fwd 1e9 FLOPs: 0.5 ms < 1 ms of memory): the memory term uses the type's efficiency too.
  assert cost_model.layer_times_ms(tiny_profile(), own, config)[0] == pytest.approx((1.0 + 2.0) / 0.25, rel=1e-12)


def test_cluster_rejects_a_roofline_efficiency_outside_0_1():
  d = json.loads(open(cluster_lib.CLUSTER_DIR + "/hetpipe_paper.json").read())
  d["gpu_types"][0]["roofline_efficiency"] = 0.3
  assert cluster_lib.cluster_from_dict(d).gpu_types["TITAN V"].roofline_efficiency == 0.3
  d["gpu_types"][0]["roofline_efficiency"] = 1.5
  with pytest.raises(ValueError, match="TITAN V.*roofline_efficiency must be in"):
    cluster_lib.cluster_from_dict(d)
