"""The network rule (one NIC per node, shared by its VWs' inter-node traffic) in the engine and the all-reduce cost.

Oracles are closed forms worked out by hand from the rule (hetpipe_jax/rules/network.py): k equal transfers through
one NIC side finish at d, 2d, ..., kd; full duplex; intra-node legs never wait; a NIC that carried n legs of d
seconds was busy n * d, and a traffic-bound pipeline runs at the NIC's pace.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.costs import allreduce_cost
from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.planning import plan_format
from hetpipe_jax.costs import profile_format
from hetpipe_jax.rules.network import Leg, NicState
from hetpipe_jax.planning import planner
from hetpipe_jax.planning import compare
from hetpipe_jax.sim import engine
from hetpipe_jax.costs import task_times
from hetpipe_jax.planning import plan_times

REL = 1e-9


# ------------------------------------------------------------------------------------------------ the rule itself
def test_nic_serialises_legs_leaving_one_node_and_is_full_duplex():
  nic = NicState()
  assert nic.leg_end(0.0, Leg("A", "P", 2.0)) == 2.0
  assert nic.leg_end(0.0, Leg("A", "P", 2.0)) == 4.0  # A's send side is busy until 2
  assert nic.leg_end(0.0, Leg("C", "P", 2.0)) == 6.0  # P's receive side is busy until 4
  assert nic.leg_end(0.0, Leg("P", "A", 1.0)) == 1.0  # the other direction is free (full duplex)
  assert nic.leg_end(0.0, Leg("A", "A", 5.0)) == 5.0  # inside a node: no NIC
  assert nic.leg_end(0.0, Leg(None, "A", 5.0)) == 5.0  # unknown node: no NIC
  assert nic.leg_end(10.0, Leg("A", "P", 2.0)) == 12.0  # an idle NIC does not delay
  assert nic.busy_s == {"A": [6.0, 1.0], "P": [1.0, 8.0], "C": [2.0, 0.0]}
  assert nic.transfer_end(20.0, [Leg("A", "B", 1.0), Leg("A", "A", 0.5), Leg("B", "C", 2.0)]) == 23.5


# ------------------------------------------------------------------------------------------------ PS traffic
def _ps_vw(node: str, push_ms: float) -> task_times.VWTaskTimes:
  t = task_times.uniform_task_times([10.0], push_ms=push_ms, pull_ms=push_ms)
  return dataclasses.replace(t, stage_nodes=(node,), push_legs=(Leg(node, "P", push_ms / 1e3),),
                             pull_legs=(Leg("P", node, push_ms / 1e3),))


class _Pushes:
  def __init__(self):
    self.arrivals = {}

  def on_push(self, vw_id, wave_id, t):
    self.arrivals[(vw_id, wave_id)] = t


@pytest.mark.parametrize("shared", [True, False])
def test_two_vws_on_one_node_pushing_to_a_ps_on_another_node(shared):
  push_ms = 30.0
  pushes = {}
  for n in (1, 2):
    hooks = _Pushes()
    engine.run([_ps_vw("A", push_ms)] * n, engine.EngineConfig(num_waves=1, num_inflight=1, shared_nic=shared),
               hooks=hooks)
    pushes[n] = sorted(hooks.arrivals.values())
  # Each wave ends at 10 ms (one 10 ms minibatch); one push takes 30 ms on an idle link.
  assert pushes[1] == pytest.approx([0.040], rel=REL)
  if shared:  # the second push waits for the first at A's NIC: the pair takes twice as long as one
    assert pushes[2] == pytest.approx([0.040, 0.070], rel=REL)
  else:
    assert pushes[2] == pytest.approx([0.040, 0.040], rel=REL)


def test_ps_on_the_vws_own_node_is_not_slowed():
  # Two VWs pushing to a PS shard on their own node: intra-node legs, no NIC, no waiting.
  t = task_times.uniform_task_times([10.0], push_ms=30.0, pull_ms=30.0)
  local = dataclasses.replace(t, stage_nodes=("A",), push_legs=(Leg("A", "A", 0.03),), pull_legs=(Leg("A", "A", 0.03),))
  hooks = _Pushes()
  report = engine.run([local, local], engine.EngineConfig(num_waves=1, num_inflight=1), hooks=hooks)
  assert sorted(hooks.arrivals.values()) == pytest.approx([0.040, 0.040], rel=REL)
  assert report.nic_busy_s == {}


def test_a_push_takes_each_nic_when_its_data_gets_there():
  # VW 0 (one stage on A, 10 ms) pushes at 10 ms as two legs: A -> B (10 ms), then C -> D (10 ms). VW 1 (stage 0 on
  # C, forward 15 ms; stage 1 on D) sends its activation C -> D (10 ms) at 15 ms. The push's second leg is ready at
  # 20 ms, behind that activation (C's send side busy until 25): it runs 25-35. VW 1 is not delayed: its minibatch
  # ends at 45 + 20 + 20 = 85 ms, as alone (a leg booked at 10 ms for 20-30 would have held the activation to 40).
  push = dataclasses.replace(task_times.uniform_task_times([10.0], push_ms=20.0, pull_ms=0.0), stage_nodes=("A",),
                             push_legs=(Leg("A", "B", 0.010), Leg("C", "D", 0.010)), pull_legs=())
  pipe = dataclasses.replace(task_times.uniform_task_times([45.0, 20.0], send_ms=10.0), stage_nodes=("C", "D"))
  hooks = _Pushes()
  report = engine.run([push, pipe], engine.EngineConfig(num_waves=1, num_inflight=1), hooks=hooks)
  assert hooks.arrivals[(0, 0)] == pytest.approx(0.035, rel=REL)
  assert [r.complete_time_s for r in report.minibatch_records if r.vw_id == 1] == pytest.approx([0.085], rel=REL)


class _PullsSent:
  def __init__(self):
    self.sent = []

  def on_pull_sent(self, vw_id, vector_clock, t):
    self.sent.append((vw_id, tuple(vector_clock), t))


def test_a_pull_request_sent_behind_a_push_reaches_the_ps_after_it():
  # One VW (10 ms minibatches, Nm = 1, D = 2: the PS can answer any pull at once) pulls at every wave end. Wave 0's
  # push leaves at 10 ms and crosses A -> P in 20 ms; the pull request sent behind it on the same ordered channel
  # reaches the PS at 30 ms, so its reply already holds wave 0 (vector clock (1,)).
  vw = _ps_vw("A", 20.0)
  hooks = _PullsSent()
  engine.run([vw], engine.EngineConfig(num_waves=2, num_inflight=1, staleness_bound=2, pull_every_wave=True),
             hooks=hooks)
  assert hooks.sent[0][:2] == (0, (1,))
  assert hooks.sent[0][2] == pytest.approx(0.030, rel=REL)


# ------------------------------------------------------------------------------------------------ pipeline sends
def _two_stage(nodes, send_ms=5.0):
  # Stage 0: forward 10/3 ms, backward 20/3 ms; stage 1: forward+backward 20 ms; every send 5 ms.
  return dataclasses.replace(task_times.uniform_task_times([10.0, 20.0], send_ms=send_ms), stage_nodes=nodes)


@pytest.mark.parametrize("shared", [True, False])
def test_activations_of_two_vws_across_the_same_nodes_share_the_nics(shared):
  cross = _two_stage(("A", "B"))
  report = engine.run([cross, cross], engine.EngineConfig(num_waves=1, num_inflight=1, shared_nic=shared))
  done = sorted(r.complete_time_s for r in report.minibatch_records)
  alone = 10.0 + 20.0 + 2 * 5.0  # compute of one minibatch + its activation and its gradient send
  if shared:
    # VW 1's activation waits 5 ms behind VW 0's at A; its gradient leaves B after VW 0's (free by then): + 5 ms.
    assert done == pytest.approx([alone / 1e3, (alone + 5.0) / 1e3], rel=REL)
    assert report.nic_busy_s == {"A": pytest.approx((0.010, 0.010)), "B": pytest.approx((0.010, 0.010))}
  else:
    assert done == pytest.approx([alone / 1e3] * 2, rel=REL)
    assert report.nic_busy_s == {}


def test_sends_between_gpus_of_one_node_are_unaffected():
  same = _two_stage(("A", "A"))
  for shared in (True, False):
    report = engine.run([same, same], engine.EngineConfig(num_waves=3, num_inflight=2, shared_nic=shared))
    reference = engine.run([task_times.uniform_task_times([10.0, 20.0], send_ms=5.0)] * 2,
                           engine.EngineConfig(num_waves=3, num_inflight=2, shared_nic=shared))
    assert [r.complete_time_s for r in report.minibatch_records] == [
        r.complete_time_s for r in reference.minibatch_records]
    assert report.nic_busy_s == {}


def test_a_traffic_bound_pipeline_runs_at_the_nics_pace():
  # Four VWs, each stage 0 on node A and stage 1 on B; each minibatch sends one 10 ms activation A -> B and one 10 ms
  # gradient B -> A; compute is 1.5 ms per minibatch. A's send side carries 4 x 10 ms per round of one minibatch per
  # VW, so the whole cluster cannot beat 1 minibatch / 10 ms (upper bound) and, with enough in flight, reaches it.
  vw = _two_stage(("A", "B"), send_ms=10.0)
  vw = dataclasses.replace(vw, forward_s=(0.0005,), backward_s=(0.0005,), forward_backward_s=0.0005)
  waves, nm = 30, 4
  shared = engine.run([vw] * 4, engine.EngineConfig(num_waves=waves, num_inflight=nm))
  assert shared.total_minibatches_per_s <= 100.0 * (1 + 1e-9)
  assert shared.total_minibatches_per_s >= 0.97 * 100.0
  # The NIC was busy for exactly what it carried: 4 VWs x 120 minibatches x 10 ms each way.
  total = 4 * waves * nm * 0.010
  assert shared.nic_busy_s["A"] == pytest.approx((total, total), rel=REL)
  assert shared.nic_busy_s["B"] == pytest.approx((total, total), rel=REL)
  assert shared.makespan_s >= total  # a lower bound the run must respect (and nearly reaches)
  assert shared.makespan_s <= 1.05 * total
  alone = engine.run([vw] * 4, engine.EngineConfig(num_waves=waves, num_inflight=nm, shared_nic=False))
  assert alone.total_minibatches_per_s > 3.5 * shared.total_minibatches_per_s  # per link: each VW at its own pace


# ------------------------------------------------------------------------------------------------ all-reduce
@pytest.fixture(scope="module")
def paper():
  cluster = cluster_lib.load_cluster("hetpipe_paper")
  prof = profile_format.load_profile(profile_format.default_profile_path("vgg19_imagenet", 32, "cpu", False))
  return cluster, prof


def _ring(cluster, nbytes, n, link):
  return allreduce_cost.ring_allreduce_s(nbytes, n, link.bandwidth_bytes_per_s * link.efficiency, link.latency_s)


def test_rings_crossing_one_nic_are_served_one_after_another(paper):
  cluster, prof = paper
  layers = prof.num_layers
  half = layers // 2
  bytes0 = sum(l.param_bytes for l in prof.layers[:half])
  bytes1 = sum(l.param_bytes for l in prof.layers[half:])
  inter, intra = cluster.inter_node_link, cluster.intra_node_link
  # NP-like: two VWs, one per node (V, R), two stages each: each stage group is a ring over V and R.
  np_vws = [([cluster.gpu("V/0"), cluster.gpu("V/1")], [(0, half), (half, layers)]),
            ([cluster.gpu("R/0"), cluster.gpu("R/1")], [(0, half), (half, layers)])]
  t0, t1 = _ring(cluster, bytes0, 2, inter), _ring(cluster, bytes1, 2, inter)
  assert allreduce_cost.allreduce_time_s(np_vws, prof, cluster, shared_nic=False) == pytest.approx(max(t0, t1))
  assert allreduce_cost.allreduce_time_s(np_vws, prof, cluster, shared_nic=True) == pytest.approx(t0 + t1)
  assert allreduce_cost.allreduce_time_s(np_vws, prof, cluster) == pytest.approx(t0 + t1)  # on by default
  # ED-like: each VW has one GPU of each node, so each stage group is inside a node: PCIe, no NIC.
  ed_vws = [([cluster.gpu("V/0"), cluster.gpu("R/0")], [(0, half), (half, layers)]),
            ([cluster.gpu("V/1"), cluster.gpu("R/1")], [(0, half), (half, layers)])]
  want = max(_ring(cluster, bytes0, 2, intra), _ring(cluster, bytes1, 2, intra))
  for shared in (True, False):
    assert allreduce_cost.allreduce_time_s(ed_vws, prof, cluster, shared_nic=shared) == pytest.approx(want)
  # Horovod: one ring over every GPU: each NIC carries it once, as its GPUs do.
  hv = [([cluster.gpu(g)], [(0, layers)]) for g in ("V/0", "V/1", "R/0", "Q/0")]
  ring = _ring(cluster, bytes0 + bytes1, 4, inter)
  for shared in (True, False):
    assert allreduce_cost.allreduce_time_s(hv, prof, cluster, shared_nic=shared) == pytest.approx(ring)


def test_engine_all_reduce_uses_the_shared_nic_time_only_when_the_rule_is_on():
  base = task_times.uniform_task_times([10.0, 10.0])
  t = dataclasses.replace(base, allreduce_s=0.05, allreduce_shared_nic_s=0.2)
  for shared, ar in ((True, 0.2), (False, 0.05)):
    report = engine.run([t, t], engine.EngineConfig(num_waves=3, num_inflight=1, method="gpipe", shared_nic=shared))
    # Per step: 10/3 ms forward + 10 ms last stage + 20/3 ms backward, then the all-reduce; 3 steps, the last one's
    # all-reduce is after the last completion.
    assert report.makespan_s == pytest.approx(3 * 0.020 + 2 * ar, rel=1e-9)


# ------------------------------------------------------------------------------------------------ from a plan
@pytest.mark.parametrize("name", ["hetpipe_paper_cnn_b64_ed", "local_cpu_2node_mlp_tiny_ed_default"])
def test_plan_task_times_name_nodes_and_ps_legs(name):
  plan = plan_format.load_plan(str(REPO_ROOT / f"experiments/plans/{name}.json"))
  cluster = cluster_lib.load_cluster(plan.cluster)
  profile = plan_times.profile_for_plan(plan)
  times = plan_times.task_times_from_plan(plan, profile, cluster)
  for vw, t in zip(plan.virtual_workers, times):
    assert t.stage_nodes == tuple(cluster.gpu(g).node for g in vw.gpus)
    assert sum(leg.seconds for leg in t.push_legs) == pytest.approx(t.push_s, rel=1e-12)
    assert [(l.dst, l.src, l.seconds) for l in t.pull_legs] == [tuple(l) for l in t.push_legs]
    remote, local = plan_times.ps_transfer_bytes(plan, profile, cluster, vw.vw_id)
    inter_legs = [l for l in t.push_legs if l.inter_node]
    # Each inter-node leg is its bytes over the inter-node link: their bytes add up to the VW's remote bytes.
    bw = cluster.inter_node_link.bandwidth_bytes_per_s * cluster.inter_node_link.efficiency
    assert sum((l.seconds - cluster.inter_node_link.latency_s) * bw for l in inter_legs) == pytest.approx(remote)
    bw_intra = cluster.intra_node_link.bandwidth_bytes_per_s * cluster.intra_node_link.efficiency
    assert sum((l.seconds - cluster.intra_node_link.latency_s) * bw_intra
               for l in t.push_legs if not l.inter_node) == pytest.approx(local)
    assert remote + local > 0 and (remote > 0) == bool(inter_legs)
    if name.endswith("_default"):  # round-robin shards: some layers' shard is on another node
      assert remote > 0
  with pytest.raises(ValueError, match="push_legs"):
    dataclasses.replace(times[0], push_s=0.0)
  with pytest.raises(ValueError, match="stage_nodes"):
    dataclasses.replace(times[0], stage_nodes=("V",))


def test_simulate_cli_records_the_nic_setting(tmp_path):
  # The paper's ED plan: every VW spans the four nodes, so its activations cross NICs that the four VWs share.
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
  reports = {}
  for flag in ("--shared_nic", "--noshared_nic"):
    out = subprocess.run(
        [sys.executable, "-m", "hetpipe_jax.simulate", "--plan=experiments/plans/hetpipe_paper_cnn_b64_ed.json",
         "--num_waves=10", "--staleness_bound=0", flag, f"--output={tmp_path}/{flag[2:]}.json"], cwd=REPO_ROOT,
        env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"shared_nic={flag == '--shared_nic'}" in out.stdout
    report = json.loads((tmp_path / f"{flag[2:]}.json").read_text())
    assert report["config"]["shared_nic"] is (flag == "--shared_nic")
    reports[flag == "--shared_nic"] = report
  shared, own = reports[True], reports[False]
  assert set(shared["nic_busy_s"]) == {"V", "R", "G", "Q"} and own["nic_busy_s"] == {}
  assert shared["makespan_s"] > own["makespan_s"]
  assert min(max(b) for b in shared["nic_busy_s"].values()) > 0


def test_compare_runs_the_rule_it_is_given(paper):
  # VGG-19 ED with round-robin PS shards on the paper's cluster: every VW spans the four nodes and pushes ~0.5 GB a
  # wave across them, so sharing the NICs must cost throughput; a cluster of one node has no NIC to share.
  cluster, prof = paper
  plan = planner.make_plan(cluster, prof, planner.PlannerConfig(policy="ED", num_vws=4))
  rows = {shared: compare.run_plan(plan, prof, cluster, compare.CompareConfig(num_waves=10, shared_nic=shared), "ED",
                                   "default") for shared in (True, False)}
  assert 0 < rows[True].images_per_s < rows[False].images_per_s
  local = cluster_lib.load_cluster("local_cpu")
  lprof = profile_format.load_profile(profile_format.default_profile_path("cnn", 64, "cpu", True))
  lplan = planner.make_plan(local, lprof, planner.PlannerConfig(policy="ED", num_vws=2))
  lrows = [compare.run_plan(lplan, lprof, local, compare.CompareConfig(num_waves=10, shared_nic=shared), "ED",
                            "default") for shared in (True, False)]
  assert lrows[0].images_per_s == lrows[1].images_per_s > 0
