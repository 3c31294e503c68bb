"""Per-stage memory caps (``PipelineRules(max_held=...)``): a stage holds at most its cap of minibatches, the cap is
reached, a held-back forward lets a ready backward pass, no deadlock on random instances, closed-form throughput,
and the plan -> runtime / engine / virtual time path (HetPipe §4 memory, ``inflight_memory="schedule"``)."""

import json
import random

import pytest

from hetpipe_jax.costs import task_times
from hetpipe_jax.planning import plan_format
from hetpipe_jax.rules import schedule
from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.sim import engine

F, B, FB = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.FORWARD_BACKWARD


def two_stage(f0_ms, b0_ms, fb1_ms):
  return task_times.VWTaskTimes(forward_s=(f0_ms * 1e-3,), backward_s=(b0_ms * 1e-3,), forward_backward_s=fb1_ms * 1e-3,
                                send_activation_s=(0.0,), send_gradient_s=(0.0,), push_s=0.0, pull_s=0.0)


def mid_rate(report, k=20):
  c = sorted(r.complete_time_s for r in report.minibatch_records)
  m = len(c) // 2
  return k / (c[m] - c[m - k])


# ------------------------------------------------------------------------------------------------ the rule itself
def test_a_held_back_forward_lets_the_ready_backward_pass():
  rules = schedule.PipelineRules(2, 3, max_held=(1, 1))
  for _ in range(2):
    rules.inject()
  f0 = rules.pop_ready(0)
  assert f0 == Task(0, F, 0)
  assert not rules.has_ready(0) and rules.pop_ready(0) is None  # F1 waits: stage 0 holds minibatch 0 (cap 1)
  rules.complete(f0)
  fb = rules.pop_ready(1)
  rules.complete(fb)  # B0 is ready on stage 0, behind F1 in FIFO order
  assert rules.has_ready(0)
  assert rules.pop_ready(0) == Task(0, B, 0)  # the backward passes the held-back forward
  assert rules.pop_ready(0) is None  # still held until B0 completes
  rules.complete(Task(0, B, 0))
  assert rules.pop_ready(0) == Task(0, F, 1)
  assert rules.peak_held == [1, 1]


@pytest.mark.parametrize("caps, message", [((1,), "entries for 2 stages"), ((0, 1), ">= 1 on every stage")])
def test_bad_caps_are_refused(caps, message):
  with pytest.raises(ValueError, match=message):
    schedule.PipelineRules(2, 3, max_held=caps)


def test_caps_are_a_fifo_rule_only():
  with pytest.raises(ValueError, match="static stage order"):
    schedule.check_max_held((1, 1), 2, order=object())
  with pytest.raises(ValueError, match="method 'hetpipe'"):
    engine.EngineConfig(num_waves=1, num_inflight=2, method="gpipe", max_held=((1, 1),))


# ------------------------------------------------------------------------------------------------ the engine
def test_cap_is_held_and_reached_with_closed_form_rates():
  # Stage 1 is slow (FB 10 ms), stage 0 fast (F 1, B 1): uncapped, stage 0 holds all Nm = 4. Cap 2 still keeps
  # stage 1 busy (rate 1 / 10 ms); cap 1 serialises F0 -> FB1 -> B0 (rate 1 / 12 ms).
  times = [two_stage(1, 1, 10)]
  run = lambda caps: engine.run(times, engine.EngineConfig(num_waves=40, num_inflight=4, max_held=caps))  # noqa: E731
  free = run(None)
  assert free.vws[0].peak_inflight_per_stage[0] == 4
  for cap, rate in ((2, 100.0), (1, 1000.0 / 12)):
    r = run(((cap, 1),))
    assert r.vws[0].peak_inflight_per_stage[0] == cap  # bounded, and the bound is reached
    assert mid_rate(r) == pytest.approx(rate, rel=1e-9)
  assert mid_rate(free) == pytest.approx(100.0, rel=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_random_instances_complete_within_their_caps(seed):
  # Brute force over random pipelines, Nm, D, caps and jitter: every run completes (no deadlock), no stage holds
  # more than its cap, and caps at or above the uncapped run's peaks change nothing (same makespan).
  rng = random.Random(seed)
  num_vws, s_count, nm = rng.randint(1, 3), rng.randint(2, 5), rng.randint(1, 6)
  times = [task_times.uniform_task_times([rng.uniform(5, 40) for _ in range(s_count)], push_ms=rng.uniform(0, 5),
                                         pull_ms=rng.uniform(0, 5)) for _ in range(num_vws)]
  base = dict(num_waves=rng.randint(3, 12), num_inflight=nm, staleness_bound=rng.randint(0, 3))
  caps = tuple(tuple(rng.randint(1, nm) for _ in range(s_count - 1)) + (1,) for _ in range(num_vws))
  for cv in (0.0, 0.3):
    r = engine.run(times, engine.EngineConfig(**base, max_held=caps, task_time_cv=cv, jitter_seed=seed))
    assert len(r.minibatch_records) == num_vws * base["num_waves"] * nm
    for vw, c in zip(r.vws, caps):
      assert all(p <= h for p, h in zip(vw.peak_inflight_per_stage[:-1], c[:-1]))
    free = engine.run(times, engine.EngineConfig(**base, task_time_cv=cv, jitter_seed=seed))
    peaks = tuple(tuple(max(1, p) for p in vw.peak_inflight_per_stage) for vw in free.vws)
    same = engine.run(times, engine.EngineConfig(**base, max_held=peaks, task_time_cv=cv, jitter_seed=seed))
    assert same.makespan_s == pytest.approx(free.makespan_s, rel=1e-12)
    assert [v.peak_inflight_per_stage for v in same.vws] == [v.peak_inflight_per_stage for v in free.vws]


def test_engine_refuses_caps_for_another_number_of_vws():
  with pytest.raises(ValueError, match="caps for 2 virtual workers, the run has 1"):
    engine.run([two_stage(1, 1, 1)], engine.EngineConfig(num_waves=1, num_inflight=1, max_held=((1, 1), (1, 1))))


# ------------------------------------------------------------------------------------------------ plans
def test_memory_caps_come_from_schedule_plans_at_their_nm():
  from hetpipe_jax.costs import cluster as cluster_lib, cost_model, profile_format
  from hetpipe_jax.planning import planner
  cluster = cluster_lib.load_cluster("hetpipe_paper")
  prof = profile_format.load_profile(profile_format.default_profile_path("resnet152_imagenet", 32, "cpu", False))
  plans = {m: planner.make_plan(cluster, prof, planner.PlannerConfig(
      policy="ED", num_vws=4, cost=cost_model.CostModelConfig(inflight_memory=m))) for m in ("conservative", "schedule")}
  for m, plan in plans.items():
    for vw in plan.virtual_workers:
      assert vw.held_per_stage is not None and len(vw.held_per_stage) == len(vw.gpus)
      assert vw.held_per_stage[-1] == 1 and all(1 <= h <= plan.num_inflight for h in vw.held_per_stage)
  sched = plans["schedule"]
  assert plan_format.memory_caps(plans["conservative"], plans["conservative"].num_inflight) is None
  assert plan_format.memory_caps(sched, sched.num_inflight) == tuple(vw.held_per_stage for vw in sched.virtual_workers)
  assert plan_format.memory_caps(sched, sched.num_inflight + 1) is None  # counted at another Nm
  # Round trip through the file keeps them; a bad entry is refused with the VW named.
  d = plan_format.plan_to_dict(sched)
  assert plan_format.plan_from_dict(json.loads(json.dumps(d))).virtual_workers == sched.virtual_workers
  d["virtual_workers"][1]["held_per_stage"] = [0] * len(d["virtual_workers"][1]["gpus"])
  with pytest.raises(ValueError, match="virtual worker 1: held_per_stage"):
    plan_format.plan_from_dict(d)
  # Older plans without the field load, with no caps.
  for vw in d["virtual_workers"]:
    del vw["held_per_stage"]
  old = plan_format.plan_from_dict(d)
  assert plan_format.memory_caps(old, old.num_inflight) is None


# ------------------------------------------------------------------------------------------------ the runtime
def test_runtime_enforces_caps_and_the_replay_oracle_holds(synthetic_data_dir):
  # A slow last stage makes stages 0 and 1 hold all Nm = 4 uncapped (test_pipeline's peak test); with caps (3, 2, 1)
  # on emulated devices they hold exactly their caps, and the final weights still equal the sequential replay of
  # the recorded versions.
  import jax
  import numpy as np
  import optax
  from hetpipe_jax import models
  from tests.pipeline_util import assert_params_close, build_vw, sequential_replay
  target = {0: 0.002, 1: 0.002, 2: 0.012}
  vw, source, params0, tx, _ = build_vw(synthetic_data_dir, partition=((0, 1), (1, 2), (2, 4)), num_inflight=4,
                                        optimizer=optax.sgd(0.05, momentum=0.9), max_held=(3, 2, 1))
  vw.task_time_s = lambda task: target[task.stage_id]
  stats = vw.run(16)
  assert list(stats.peak_inflight_per_stage) == [3, 2, 1]
  versions = [r.version_local_updates for r in vw.records]
  assert any(v < p for p, v in enumerate(versions))  # still pipelined
  expected = sequential_replay(models.get_model("mlp_tiny"), params0, tx, [source.get(p) for p in range(16)],
                               versions)
  assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(params0))) > 1e-3
  assert_params_close(vw.layer_params(), expected, rtol=1e-5, atol=1e-6)


def test_runtime_refuses_caps_for_other_methods(synthetic_data_dir):
  from tests.pipeline_util import build_vw
  with pytest.raises(ValueError, match="max_held is not a setting of method 'pipedream'"):
    build_vw(synthetic_data_dir, partition=((0, 2), (2, 4)), num_inflight=2, method="pipedream", max_held=(1, 1))


# ------------------------------------------------------------------------------------------------ a job from a plan
def test_virtual_job_from_a_schedule_plan_records_and_enforces_its_caps(tmp_path, synthetic_data_dir):
  from experiments.configs import tiny
  from hetpipe_jax.jobs import job_config, virtual_job
  from hetpipe_jax.paths import REPO_ROOT
  d = json.loads((REPO_ROOT / "experiments/plans/local_cpu_4node_mlp_tiny_ed.json").read_text())
  d["cost_model"]["inflight_memory"] = "schedule"
  caps = [[2, 1, 1, 1], [3, 2, 1, 1]]
  for vw, c in zip(d["virtual_workers"], caps):
    vw["held_per_stage"] = c
  plan = tmp_path / "plan.json"
  plan.write_text(json.dumps(d))
  config = tiny.get_config()
  config.update({"data_dir": str(synthetic_data_dir), "check_counts": False, "progress": False, "plan": str(plan),
                 "num_minibatches": 12, "emulate_plan": True, "save_task_trace": True})
  settings = job_config.resolve_job(config, "virtual")
  assert settings.memory_caps == tuple(tuple(c) for c in caps)
  summary = virtual_job.run(settings, str(tmp_path / "run"))
  recorded = json.loads((tmp_path / "run" / "config.json").read_text())
  assert recorded["memory_caps"] == caps and recorded["setting_sources"]["memory_caps"].startswith("plan")
  assert summary["memory_caps"] == caps  # config.json and summary.json agree
  # Per VW and stage, from the task trace: at every forward's start, the minibatches the stage holds (forwards
  # started, backwards not ended) are at most its cap, and the cap is reached on the capped stages.
  events = json.loads((tmp_path / "run" / "trace.json").read_text())["traceEvents"]
  tasks = [e for e in events if e.get("ph") == "X"]
  assert tasks
  reached = {}
  for vw, stage in sorted({(e["pid"], e["tid"]) for e in tasks if e["cat"] == "backward"}):  # non-last stages
    mine = [e for e in tasks if e["pid"] == vw and e["tid"] == stage]
    starts = [e["ts"] for e in mine if e["cat"] == "forward"]
    held = [sum(1 for f in mine if f["cat"] == "forward" and f["ts"] <= t)
            - sum(1 for b in mine if b["cat"] == "backward" and b["ts"] + b["dur"] <= t + 1e-3) for t in starts]  # µs, rounding
    assert max(held) <= caps[vw][stage], (vw, stage, held)
    reached.setdefault(vw, []).append(max(held))
  assert sorted(reached) == [0, 1] and all(len(v) == 3 for v in reached.values())
  assert max(max(v) for v in reached.values()) >= 2  # the caps above 1 are reached, not only respected
