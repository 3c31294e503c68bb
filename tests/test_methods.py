"""Methods in one harness: stage orders, all-reduce rules, engine closed forms, per-method memory, plans, compare."""

import dataclasses
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from hetpipe_jax import models
from hetpipe_jax.costs import allreduce_cost
from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs import profile_format
from hetpipe_jax.costs import task_times
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.planning import compare
from hetpipe_jax.planning import method_planner
from hetpipe_jax.planning import plan_format
from hetpipe_jax.planning import plan_times
from hetpipe_jax.planning import planner
from hetpipe_jax.rules import allreduce
from hetpipe_jax.rules import methods
from hetpipe_jax.rules import schedule
from hetpipe_jax.sim import engine

REL = 1e-9


def order_text(method, s_count, n, total):
  o = methods.stage_order(methods.get_method(method), s_count, n, total)
  return [" ".join(map(str, o.stage_tasks(s))) for s in range(s_count)]


# ----------------------------------------------------------------------------------------- rules
def test_method_table():
  assert methods.METHODS == ("hetpipe", "pipedream", "gpipe", "1f1b_flush", "horovod", "fsdp")
  assert methods.HARNESS_METHODS == ("hetpipe", "pipedream", "gpipe", "1f1b_flush", "horovod")
  assert [methods.get_method(m).sync for m in methods.METHODS] == ["wsp", "wsp", "allreduce", "allreduce",
                                                                   "allreduce", "allreduce"]
  assert methods.stage_order(methods.get_method("hetpipe"), 3, 2, 10) is None
  with pytest.raises(ValueError, match="unknown method 'zb'"):
    methods.get_method("zb")


def test_gpipe_order_all_forwards_then_all_backwards_per_step():
  assert order_text("gpipe", 3, 2, 4) == ["0F0 0F1 0B0 0B1 0F2 0F3 0B2 0B3", "1F0 1F1 1B0 1B1 1F2 1F3 1B2 1B3",
                                         "2FB0 2FB1 2FB2 2FB3"]


def test_1f1b_flush_order_warmup_steady_cooldown():
  # Stage s: S - s - 1 warm-up forwards, then one forward one backward, then the remaining backwards (Megatron).
  assert order_text("1f1b_flush", 4, 6, 6) == [
      "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5",
      "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5",
      "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5",
      "3FB0 3FB1 3FB2 3FB3 3FB4 3FB5"]
  # M < S: every forward of the step first (the order is GPipe's).
  assert order_text("1f1b_flush", 4, 2, 2)[0] == "0F0 0F1 0B0 0B1"


def test_pipedream_order_one_window_over_the_run():
  # NOAM = S = 3: stage s keeps 3 - s minibatches in flight, no flush.
  assert order_text("pipedream", 3, 3, 6) == ["0F0 0F1 0F2 0B0 0F3 0B1 0F4 0B2 0F5 0B3 0B4 0B5",
                                             "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1F4 1B3 1F5 1B4 1B5",
                                             "2FB0 2FB1 2FB2 2FB3 2FB4 2FB5"]


@pytest.mark.parametrize("method", ["gpipe", "1f1b_flush", "pipedream"])
def test_every_stage_order_lists_each_task_once_and_respects_rules_1_2(method):
  for s_count, n, total in ((1, 1, 3), (2, 3, 6), (4, 4, 12), (5, 2, 8), (3, 8, 16)):
    o = methods.stage_order(methods.get_method(method), s_count, n, total)
    for s in range(s_count):
      tasks = o.stage_tasks(s)
      kinds = ["FB"] if s == s_count - 1 else ["F", "B"]
      for k in kinds:
        ids = [t.minibatch_id for t in tasks if t.kind.value == k]
        assert ids == list(range(total)), (method, s_count, n, s, k)
      for i, t in enumerate(tasks):  # a backward only after its own forward
        if t.kind is schedule.TaskKind.BACKWARD:
          assert schedule.Task(s, schedule.TaskKind.FORWARD, t.minibatch_id) in tasks[:i]


def test_pipeline_rules_with_a_static_order_start_only_the_next_task():
  o = methods.stage_order(methods.get_method("gpipe"), 2, 2, 2)
  rules = schedule.PipelineRules(2, 1, o)  # one in flight: 0F1 is injected only after minibatch 0 completes
  rules.inject()
  f0 = rules.pop_ready(0)
  assert str(f0) == "0F0" and rules.pop_ready(1) is None  # nothing arrived yet
  rules.complete(f0)
  fb0 = rules.pop_ready(1)
  rules.complete(fb0)
  assert not rules.has_ready(0) and rules.pop_ready(0) is None  # 0B0 is ready, but GPipe's order wants 0F1 first
  with pytest.raises(RuntimeError):
    rules.inject()  # (Nm = 1: 0B0 never runs, a deadlock the engine reports as a stall)
  rules2 = schedule.PipelineRules(2, 2, o)
  rules2.inject()
  rules2.inject()
  tasks = {0: [], 1: []}
  for _ in range(6):
    for s in (0, 1):
      t = rules2.pop_ready(s)
      if t is not None:
        tasks[s].append(str(t))
        rules2.complete(t)
  assert tasks == {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1FB0", "1FB1"]}


def test_allreduce_sync_state_caps_injections_at_the_flush():
  sync = allreduce.AllReduceSyncState(3)
  assert sync.max_injected == 3 and sync.injection_gate() == (True, None)
  assert sync.on_minibatch_complete(0) == (None, None)
  assert sync.on_minibatch_complete(2) == (0, None)
  with pytest.raises(AssertionError):
    sync.on_reduced(1)
  sync.on_reduced(0)
  assert (sync.applied_steps, sync.max_injected, sync.weights_global_clock) == (1, 6, 1)
  state = allreduce.AllReduceState(2)
  assert state.enter(1, 0) is False and state.enter(0, 0) is True
  with pytest.raises(ValueError, match="expected step 1"):
    state.enter(0, 2)


def test_reduce_segments_cut_at_every_vws_stage_boundaries():
  assert allreduce.reduce_segments([[(0, 3), (3, 7)], [(0, 3), (3, 7)]]) == [(0, 3), (3, 7)]
  assert allreduce.reduce_segments([[(0, 2), (2, 7)], [(0, 4), (4, 7)]]) == [(0, 2), (2, 4), (4, 7)]
  assert allreduce.segment_stages([(0, 4), (4, 7)], [(0, 2), (2, 4), (4, 7)]) == [0, 0, 1]
  with pytest.raises(ValueError, match="different layers"):
    allreduce.reduce_segments([[(0, 3)], [(0, 4)]])


# ----------------------------------------------------------------------------------------- engine closed forms
def run(times, **kw):
  kw.setdefault("num_waves", 6)
  return engine.run(times, engine.EngineConfig(**kw))


@pytest.mark.parametrize("s_count,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 16)])
@pytest.mark.parametrize("method", ["gpipe", "1f1b_flush"])
def test_flush_bubble_on_equal_stages(method, s_count, m):
  """GPipe / 1F1B-flush on equal stages: a step takes (M + S - 1) t, every GPU idles (S-1)/(M+S-1) of it."""
  t = 0.03
  times = task_times.uniform_task_times([1e3 * t] * s_count, fwd_fraction=0.5)
  r = run([times], num_inflight=m, method=method)
  w = 6
  assert r.makespan_s == pytest.approx(w * (m + s_count - 1) * t, rel=REL)
  for g in r.gpus:
    assert 1 - g.utilization == pytest.approx((s_count - 1) / (m + s_count - 1), rel=1e-6)
  assert r.total_minibatches_per_s == pytest.approx(m / ((m + s_count - 1) * t), rel=1e-6)


def test_1f1b_flush_steady_state_holds_s_minus_s_microbatches():
  s_count, m, t = 4, 8, 0.03
  times = task_times.uniform_task_times([1e3 * t] * s_count, fwd_fraction=0.5)
  held = {}
  for method in ("gpipe", "1f1b_flush"):
    r = run([times], num_inflight=m, method=method, records=True)
    # Held on stage s at execution: forward of p ended, backward of p not ended.
    peaks = []
    for s in range(s_count - 1):
      ev = sorted([(e.end_s, 1 if "F" in e.task else -1) for e in r.task_events if e.stage_id == s],
                  key=lambda x: (x[0], x[1]))
      level = peak = 0
      for _, d in ev:
        level += d
        peak = max(peak, level)
      peaks.append(peak)
    held[method] = peaks
  assert held["gpipe"] == [m] * (s_count - 1)
  assert held["1f1b_flush"] == [min(s_count - s, m) for s in range(s_count - 1)]
  assert methods.max_held_per_stage(methods.get_method("1f1b_flush"), s_count, m) == [4, 3, 2, 1]


def test_allreduce_step_time_from_the_ring_formula():
  n, s_count, m, t = 3, 2, 4, 0.02
  cluster = cluster_lib.load_cluster("hetpipe_paper")
  link = cluster.inter_node_link
  nbytes = 400e6
  t_ar = allreduce_cost.ring_allreduce_s(nbytes, n, link.bandwidth_bytes_per_s * link.efficiency, link.latency_s)
  assert t_ar == pytest.approx(2 * (n - 1) / n * nbytes / (7e9 * 0.7) + 2 * (n - 1) * 1e-4)
  times = dataclasses.replace(task_times.uniform_task_times([1e3 * t] * s_count, fwd_fraction=0.5), allreduce_s=t_ar)
  w = 6
  r = run([times] * n, num_waves=w, num_inflight=m, method="gpipe")
  step = (m + s_count - 1) * t
  assert r.makespan_s == pytest.approx(w * step + (w - 1) * t_ar, rel=REL)
  assert r.total_minibatches_per_s == pytest.approx(n * m / (step + t_ar), rel=1e-6)
  assert r.final_global_clock == w
  for v in r.vws:  # every VW waits exactly the all-reduce after each step but the last
    assert v.wait_s == pytest.approx(w * t_ar, rel=1e-6)


@pytest.mark.parametrize("method", ["gpipe", "1f1b_flush", "horovod"])
def test_a_slow_replica_holds_bsp_to_its_speed(method):
  s_count = 1 if method == "horovod" else 2
  m, t_ar = 4, 0.01
  fast = dataclasses.replace(task_times.uniform_task_times([20.0] * s_count, fwd_fraction=0.5), allreduce_s=t_ar)
  slow = dataclasses.replace(task_times.uniform_task_times([50.0] * s_count, fwd_fraction=0.5), allreduce_s=t_ar)
  r = run([fast, slow, fast], num_inflight=m, method=method)
  step_slow = (m + s_count - 1) * 0.05
  w = 6
  assert r.makespan_s == pytest.approx(w * step_slow + (w - 1) * t_ar, rel=REL)
  assert r.total_minibatches_per_s_plain == pytest.approx(3 * m * w / r.makespan_s, rel=REL)
  assert r.vws[0].wait_s == pytest.approx(w * (step_slow - (m + s_count - 1) * 0.02) + w * t_ar, rel=1e-6)
  assert r.vws[1].wait_s == pytest.approx(w * t_ar, rel=1e-6)


def test_pipedream_steady_state_is_its_slowest_stage():
  times = task_times.uniform_task_times([20.0, 30.0, 25.0], fwd_fraction=0.5)
  r = run([times], num_waves=30, num_inflight=3, method="pipedream", records=True)
  c = [x.complete_time_s for x in r.minibatch_records]
  assert 30 / (c[60] - c[30]) == pytest.approx(1 / 0.03, rel=1e-9)
  assert max(r.vws[0].peak_inflight_per_stage[:2]) <= 4  # dispatched: K_s + 1 (the next forward queued)


def test_hetpipe_results_do_not_depend_on_the_method_field():
  times = task_times.uniform_task_times([20.0, 30.0], fwd_fraction=0.5)
  a = run([times, times], num_inflight=3, staleness_bound=1)
  b = run([times, times], num_inflight=3, staleness_bound=1, method="hetpipe")
  assert a.makespan_s == b.makespan_s and a.total_minibatches_per_s == b.total_minibatches_per_s


def test_engine_refuses_wrong_sync_states():
  times = task_times.uniform_task_times([20.0, 30.0])
  with pytest.raises(ValueError, match="AllReduceSyncState"):
    engine.Engine([times], engine.EngineConfig(num_waves=2, num_inflight=2, method="gpipe"),
                  sync_states=[allreduce.AllReduceSyncState(3)])
  with pytest.raises(ValueError, match="unknown method"):
    engine.EngineConfig(num_waves=2, num_inflight=2, method="zb")


# ----------------------------------------------------------------------------------------- planner
@pytest.fixture(scope="module")
def paper():
  cluster = cluster_lib.load_cluster("hetpipe_paper")
  prof = profile_format.load_profile(profile_format.default_profile_path("resnet152_imagenet", 32, "cpu", False))
  return cluster, prof


def test_memory_model_per_method(paper):
  cluster, prof = paper
  l = prof.num_layers
  micro = profile_format.micro_batch_profile(prof, 8)
  mem = {}
  for method, remat in (("gpipe", False), ("gpipe", True), ("1f1b_flush", False)):
    c = cost_model.build_stage_costs(micro, cluster, cost_model.CostModelConfig(method=method, remat=remat))
    mem[(method, remat)] = c.stage_memory_bytes(0, l // 4, False, 4, 8)
  assert mem[("gpipe", True)] < mem[("1f1b_flush", False)] < mem[("gpipe", False)]
  # GPipe holds all M micro-batches (= one minibatch) of stash; 1F1B-flush min(S, M) = 4 of 8.
  c = cost_model.build_stage_costs(micro, cluster, cost_model.CostModelConfig(method="gpipe"))
  stash = c.stash_prefix[l // 4] - c.stash_prefix[0]
  assert mem[("gpipe", False)] - mem[("1f1b_flush", False)] == pytest.approx(
      4 * (max(stash, c.boundary_bytes[0]) + c.boundary_bytes[l // 4]) - 4 * c.boundary_bytes[0], rel=1e-9)
  # PipeDream keeps one stashed version per held minibatch, as HetPipe does.
  h = cost_model.build_stage_costs(prof, cluster, cost_model.CostModelConfig(method="hetpipe"))
  p = cost_model.build_stage_costs(prof, cluster, cost_model.CostModelConfig(method="pipedream"))
  assert h.stage_memory_bytes(0, 10, False, 4, 4) == p.stage_memory_bytes(0, 10, False, 4, 4)


def test_micro_batch_profile_scales_per_example_quantities(paper):
  _, prof = paper
  micro = profile_format.micro_batch_profile(prof, 4)
  assert micro.batch_size == 8
  a, b = prof.layers[5], micro.layers[5]
  assert b.fwd_flops == a.fwd_flops / 4 and b.stash_bytes == a.stash_bytes // 4
  assert b.param_bytes == a.param_bytes and b.optimizer_state_bytes == a.optimizer_state_bytes
  assert b.fwd_bytes_accessed == pytest.approx(a.param_bytes + (a.fwd_bytes_accessed - a.param_bytes) / 4)
  with pytest.raises(ValueError, match="divide the batch size"):
    profile_format.micro_batch_profile(prof, 5)


def test_horovod_leaves_out_gpus_that_cannot_hold_the_model(paper):
  cluster, prof = paper
  used, notes = method_planner.horovod_gpus(cluster, prof, cost_model.CostModelConfig())
  assert not any(g.gpu_type == "GeForce RTX 2060" for g in used)  # as in the paper (HetPipe §8: 12 of 16 GPUs)
  assert len(used) + len(notes) == 16
  assert all("needs" in n and "GiB" in n for n in notes)


@pytest.mark.parametrize("method", ["gpipe", "1f1b_flush", "pipedream", "horovod"])
def test_plans_record_the_method_and_round_trip(paper, tmp_path, method):
  cluster, prof = paper
  plan = planner.make_plan(cluster, prof, planner.PlannerConfig(policy="ED", num_vws=4, method=method))
  assert plan.method == method and plan.cost_model["method"] == method
  path = str(tmp_path / "plan.json")
  plan_format.write_plan(plan, path)
  back = plan_format.load_plan(path)
  assert back == plan
  times = plan_times.task_times_from_plan(plan, prof, cluster)
  if methods.get_method(method).is_flush:
    assert plan.num_inflight in method_planner.microbatch_candidates(32)
    vws = [([cluster.gpu(g) for g in vw.gpus], vw.partition) for vw in plan.virtual_workers]
    want = allreduce_cost.allreduce_time_s(vws, prof, cluster, shared_nic=False)
    shared = allreduce_cost.allreduce_time_s(vws, prof, cluster, shared_nic=True)
    assert all(t.allreduce_s == want for t in times) and want > 0
    assert all(t.allreduce_time_s(True) == shared >= want for t in times)
    assert all(t.push_s == 0 for t in times)
  else:
    assert plan.num_inflight == 4  # NOAM = S
  assert "method=" + method in planner.format_table(plan)


def test_flush_planner_picks_the_best_m_by_its_closed_form(paper):
  cluster, prof = paper
  vws = planner.allocation(cluster, "ED", 4)
  best = method_planner.plan_flush(cluster, prof, vws, "ED", "gpipe", cost_model.CostModelConfig())
  for m in (1, 2, 4):
    other = method_planner.plan_flush(cluster, prof, vws, "ED", "gpipe", cost_model.CostModelConfig(), m)
    assert other.system.predicted_total_minibatches_per_s <= best.system.predicted_total_minibatches_per_s
    assert other.system.num_inflight == m


def test_old_plans_are_hetpipe_plans():
  plan = plan_format.load_plan(str(REPO_ROOT / "experiments/plans/local_cpu_cnn_b64.json"))
  assert plan.method == "hetpipe" and plan.notes == ()


# ----------------------------------------------------------------------------------------- compare
def test_compare_paper_vgg19_every_method_in_seconds():
  cluster = cluster_lib.load_cluster("hetpipe_paper")
  prof = profile_format.load_profile(profile_format.default_profile_path("vgg19_imagenet", 32, "cpu", False))
  t0 = time.process_time()  # CPU seconds of this process: a loaded machine does not inflate them
  table, every = compare.compare(cluster, prof, compare.CompareConfig(num_vws=4, num_waves=20))
  assert time.process_time() - t0 < 30
  assert [r.method for r in table] == ["hetpipe"] * 8 + ["pipedream", "gpipe", "1f1b_flush", "horovod"] + ["fsdp"] * 2
  assert len(every) == 8 + 3 * 3 + 1 + 2 * 2  # fsdp: two variants, each without and with remat
  for r in table:
    if r.method == "hetpipe" and r.allocation in ("NP", "ED", "HD", "auto"):
      assert r.images_per_s > 0 and r.memory_fits and r.gpus_used == 16
  horovod = table[-3]
  assert horovod.method == "horovod"
  assert horovod.gpus_used == 16 and not horovod.notes  # HetPipe §8.3 ran VGG-19's Horovod on all 16 GPUs
  # ResNet-152 (§8.3: "Horovod uses only 12 GPUs"): the four RTX 2060s are left out, each with its reason.
  prof152 = profile_format.load_profile(profile_format.default_profile_path("resnet152_imagenet", 32, "cpu", False))
  used, notes = method_planner.horovod_gpus(cluster, prof152, cost_model.CostModelConfig())
  assert len(used) == 12 and len(notes) == 4 and all("(GeForce RTX 2060)" in n for n in notes)
  text = compare.format_table(table)
  assert text.count("\n") == len(table) + 1


def test_compare_cli_smoke(tmp_path):
  out = tmp_path / "cmp"
  proc = subprocess.run([sys.executable, "-m", "hetpipe_jax.compare", "--smoke", f"--output={out}"], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "| gpipe |" in proc.stdout and "| horovod |" in proc.stdout
  d = json.loads((tmp_path / "cmp.json").read_text())
  assert d["cluster"] == "local_cpu" and len(d["table"]) == 14
  assert "| fsdp | even shards (ZeRO-3) |" in proc.stdout
  assert "| fsdp | shards by memory, batch by speed |" in proc.stdout
  assert d["shared_nic"] is True and "shared NICs" in proc.stdout  # the network rule, on by default, recorded
  assert (tmp_path / "cmp.png").stat().st_size > 1000
  rates = {r["label"]: r["images_per_s"] for r in d["table"]}
  assert rates["hetpipe ED/default"] > 0 and np.isfinite(list(rates.values())).all()


def test_compare_smoke_refuses_the_settings_it_replaces(tmp_path):
  """``--smoke`` runs its own cluster, model, batch, VWs and waves: given beside it they used to be replaced silently
  (``--smoke --model=vgg19_imagenet`` compared the CNN); now one ``error:`` line names them, exit 2, nothing written."""
  out = tmp_path / "cmp"
  proc = subprocess.run([sys.executable, "-m", "hetpipe_jax.compare", "--smoke", "--model=vgg19_imagenet",
                         "--num_vws=3", f"--output={out}"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and proc.stderr.startswith("error: --smoke sets --cluster"), proc.stderr[-2000:]
  assert "--model, --num_vws would not run: leave them out, or drop --smoke" in proc.stderr
  assert not (tmp_path / "cmp.json").exists()


def test_compare_gpt2_medium_on_the_paper_cluster_reports_sequences():
  """GPT-2 medium (batch 2 x 1,024 tokens) in compare: HetPipe ED fits the paper's cluster, Horovod leaves out every GPU
  that cannot hold the whole model (21 GiB at batch 2: all but the 24 GiB TITAN RTXs), and rates are sequences/s."""
  cluster = cluster_lib.load_cluster("hetpipe_paper")
  prof = profile_format.load_profile(profile_format.default_profile_path("gpt2_medium", 2, "cpu", False))
  table, _ = compare.compare(cluster, prof, compare.CompareConfig(num_vws=4, num_waves=10))
  rows = {r.label: r for r in table}
  assert rows["hetpipe ED/local"].memory_fits and rows["hetpipe ED/local"].images_per_s > 0
  horovod = table[-3]
  assert horovod.method == "horovod" and horovod.gpus_used == 4 and len(horovod.notes) == 12
  assert models.example_unit("gpt2_medium") == "sequences" and models.example_unit("vgg19_imagenet") == "images"
  assert "| sequences/s |" in compare.format_table(table, unit="sequences")
