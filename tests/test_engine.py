"""Event engine and task times: closed forms, WSP bounds, hooks order, peak in-flight (HetPipe §4, §5, §8)."""

import dataclasses
import json

import numpy as np
import pytest

from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs import profile_format
from hetpipe_jax.costs import task_times
from hetpipe_jax.jobs import outputs
from hetpipe_jax.planning import plan_times
from hetpipe_jax.planning import planner
from hetpipe_jax.rules import wsp
from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.sim import engine

REL = 1e-9  # virtual-time arithmetic is exact up to float rounding


def run(times, **kw):
  kw.setdefault("num_waves", 10)
  kw.setdefault("num_inflight", 2)
  return engine.run(times, engine.EngineConfig(**kw))


def mid_run_rate(report, vw_id, k):
  """Minibatches/s over the k completions before the middle one: no pipeline fill, no drain."""
  c = [r.complete_time_s for r in report.minibatch_records if r.vw_id == vw_id]
  m = len(c) // 2
  return k / (c[m] - c[m - k])


# ----------------------------------------------------------------------------------------- task times
def test_task_duration_is_compute_plus_send_of_its_output():
  tt = task_times.VWTaskTimes(forward_s=(1.0, 2.0), backward_s=(3.0, 4.0), forward_backward_s=5.0,
                              send_activation_s=(0.1, 0.2), send_gradient_s=(0.3, 0.4), push_s=0.0, pull_s=0.0)
  assert tt.task_duration_s(Task(0, TaskKind.FORWARD, 7)) == pytest.approx(1.1)
  assert tt.task_duration_s(Task(1, TaskKind.FORWARD, 7)) == pytest.approx(2.2)
  assert tt.task_duration_s(Task(2, TaskKind.FORWARD_BACKWARD, 7)) == pytest.approx(5.4)
  assert tt.task_duration_s(Task(1, TaskKind.BACKWARD, 7)) == pytest.approx(4.3)
  assert tt.task_duration_s(Task(0, TaskKind.BACKWARD, 7)) == pytest.approx(3.0)  # stage 0 sends nothing back
  with pytest.raises(ValueError, match="last stage"):
    tt.task_duration_s(Task(1, TaskKind.FORWARD_BACKWARD, 0))
  with pytest.raises(ValueError, match="stages 0..1"):
    tt.task_duration_s(Task(2, TaskKind.FORWARD, 0))


def test_task_times_validation():
  with pytest.raises(ValueError, match="backward_s has 1 entries, expected 2"):
    task_times.VWTaskTimes((1.0, 1.0), (1.0,), 1.0, (0.0, 0.0), (0.0, 0.0), 0.0, 0.0)
  with pytest.raises(ValueError, match=r"push_s\[0\] must be a finite non-negative"):
    task_times.VWTaskTimes((), (), 1.0, (), (), -1.0, 0.0)
  with pytest.raises(ValueError, match="stage_ms is empty"):
    task_times.uniform_task_times([])
  with pytest.raises(ValueError, match="fwd_fraction"):
    task_times.uniform_task_times([1.0], fwd_fraction=1.5)
  with pytest.raises(ValueError, match=r"stage_ms\[1\]"):
    task_times.uniform_task_times([1.0, float("nan")])


def test_task_times_from_plan_sum_to_the_plans_stage_times():
  cluster = cluster_lib.load_cluster("hetpipe_paper")
  profile = profile_format.load_profile(profile_format.default_profile_path("resnet152_imagenet", 32, "cpu", False))
  plan = planner.make_plan(cluster, profile, planner.PlannerConfig(policy="HD", num_vws=4))
  times = plan_times.task_times_from_plan(plan, profile, cluster)
  for vw, tt in zip(plan.virtual_workers, times):
    got = [tt.stage_time_s(s) * 1e3 for s in range(tt.num_stages)]
    np.testing.assert_allclose(got, vw.stage_time_ms, rtol=1e-6)
    assert all(b > f for f, b in zip(tt.forward_s, tt.backward_s))  # backward costs more than forward
    remote, local = plan_times.ps_transfer_bytes(plan, profile, cluster, vw.vw_id)
    assert remote + local == sum(l.param_bytes for l in profile.layers)
    assert tt.push_s == tt.pull_s > cluster.inter_node_link.transfer_time_s(remote) > 0
  with pytest.raises(ValueError, match="cluster 'local_cpu' is not the plan's cluster"):
    plan_times.task_times_from_plan(plan, profile, cluster_lib.load_cluster("local_cpu"))


# ----------------------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("num_stages,num_inflight,fwd_fraction", [
    (1, 1, 0.3), (1, 3, 0.3), (3, 1, 1 / 3), (4, 1, 0.5), (4, 2, 1 / 3), (4, 3, 0.5), (4, 4, 1 / 3), (4, 6, 0.5),
    (5, 5, 1 / 3), (2, 8, 0.1)])
def test_single_vw_equal_stages_steady_state_closed_form(num_stages, num_inflight, fwd_fraction):
  # Equal stage times t, no transfers: Nm minibatches per round trip of S*t, at most one per t (bottleneck stage
  # does fwd + bwd = t per minibatch): rate = min(1/t, Nm/(S*t)) = cost_model.vw_throughput_per_s.
  t_ms = 10.0
  tt = task_times.uniform_task_times([t_ms] * num_stages, fwd_fraction=fwd_fraction)
  r = run([tt], num_waves=max(8, 240 // num_inflight), num_inflight=num_inflight, staleness_bound=0)
  expected = min(1 / (t_ms * 1e-3), num_inflight / (num_stages * t_ms * 1e-3))
  assert expected == pytest.approx(cost_model.vw_throughput_per_s([t_ms] * num_stages, num_inflight), rel=REL)
  assert mid_run_rate(r, 0, 4 * num_inflight) == pytest.approx(expected, rel=REL)
  assert r.vws[0].wait_s == 0.0


@pytest.mark.parametrize("n,pull_every_wave", [(1, True), (1, False), (3, False), (3, True)])
def test_nm1_round_trip_includes_push_and_pull(n, pull_every_wave):
  # Nm = 1, D = 0: minibatch k+1 starts only when wave k's push has reached the PS and the pull came back:
  # period = S*t + push + pull; the VW waits (and idles) push + pull per wave, except after the last.
  # With n > 1 and pull_every_wave the wave-end pull asks for the clock the next wave needs, so it waits for the last
  # push and is the only pull (test_wave_end_pull_waits_for_what_the_bound_needs).
  s_count, t_ms, push_ms, pull_ms, waves = 3, 10.0, 4.0, 6.0, 12
  tt = task_times.uniform_task_times([t_ms] * s_count, push_ms=push_ms, pull_ms=pull_ms)
  r = run([tt] * n, num_waves=waves, num_inflight=1, staleness_bound=0, pull_every_wave=pull_every_wave)
  period = (s_count * t_ms + push_ms + pull_ms) * 1e-3
  for v in r.vws:
    assert v.minibatches_per_s == pytest.approx(1 / period, rel=REL)
    assert v.wait_s == pytest.approx((waves - 1) * (push_ms + pull_ms) * 1e-3, rel=REL)
    assert v.idle_s == pytest.approx(v.wait_s, rel=REL)
  assert r.total_minibatches_per_s == pytest.approx(n / period, rel=1e-6)


@pytest.mark.parametrize("n,s_count,pull_every_wave", [(2, 1, False), (3, 2, True), (4, 3, False), (3, 1, True)])
def test_shared_ps_link_serialises_every_push_and_pull_closed_form(n, s_count, pull_every_wave):
  # n identical VWs, Nm = 1, D = 0, round trip R = S*t, push P, pull Q with R <= (n-1) min(P, Q).
  # Shared link: the n pushes of a wave go one after another (VW i's arrives at S_k + (i+1) P, S_k when the wave's
  # first push starts); the last one completes clock k+1 and the PS sends the n pull replies, one after another
  # (VW i's arrives at S_k + nP + (i+1) Q); VW i then computes minibatch k+1 (R) and pushes again, but the link
  # still carries the later replies and the earlier pushes (R <= (n-1) min(P, Q)), so S_{k+1} = S_k + n (P + Q):
  # the link is never idle and VW i completes minibatch k >= 1 at 2R + (k-1) n (P+Q) + nP + (i+1) Q; S_0 = R.
  # Without sharing every VW completes minibatch k at R + k (R + P + Q) (test_nm1_round_trip_includes_push_and_pull).
  t_ms, push_ms, pull_ms, waves = 1.0, 5.0, 7.0, 12
  rt_ms = s_count * t_ms
  assert rt_ms <= (n - 1) * min(push_ms, pull_ms)
  tt = task_times.uniform_task_times([t_ms] * s_count, push_ms=push_ms, pull_ms=pull_ms)
  for contention in (True, False):
    r = run([tt] * n, num_waves=waves, num_inflight=1, staleness_bound=0, pull_every_wave=pull_every_wave,
            ps_link_contention=contention)
    assert len(r.minibatch_records) == n * waves
    for rec in r.minibatch_records:
      i, k = rec.vw_id, rec.minibatch_id
      if not contention:
        expected_ms = rt_ms + k * (rt_ms + push_ms + pull_ms)
      elif k == 0:
        expected_ms = rt_ms
      else:
        expected_ms = 2 * rt_ms + (k - 1) * n * (push_ms + pull_ms) + n * push_ms + (i + 1) * pull_ms
      assert rec.complete_time_s == pytest.approx(expected_ms * 1e-3, rel=REL), (contention, i, k)
    period_s = (n * (push_ms + pull_ms) if contention else rt_ms + push_ms + pull_ms) * 1e-3
    for v in range(n):
      assert mid_run_rate(r, v, 4) == pytest.approx(1 / period_s, rel=REL)
    if contention:  # the link carries one VW's push + pull at a time: 1/(P + Q) minibatches/s in all
      assert sum(mid_run_rate(r, v, 4) for v in range(n)) == pytest.approx(1e3 / (push_ms + pull_ms), rel=REL)


def test_wave_end_pull_waits_for_what_the_bound_needs():
  s_count, t_ms, push_ms, pull_ms, waves = 3, 10.0, 4.0, 6.0, 12
  tt = task_times.uniform_task_times([t_ms] * s_count, push_ms=push_ms, pull_ms=pull_ms)
  r = run([tt] * 3, num_waves=waves, num_inflight=1, staleness_bound=0, pull_every_wave=True)
  # The wave-end pull asks for the clock the next wave needs, so VWs in step never need a second pull: one pull
  # per wave and the same rate as pulling only on demand.
  on_demand = run([tt] * 3, num_waves=waves, num_inflight=1, staleness_bound=0, pull_every_wave=False)
  assert all(v.num_pulls <= waves for v in r.vws)
  assert r.total_minibatches_per_s == pytest.approx(on_demand.total_minibatches_per_s, rel=1e-9)


def test_identical_vws_run_exactly_like_one_vw_d0():
  # D = 0 and identical VWs: every VW's timing equals a single VW's with the same PS costs (the PS sync cost is
  # the only thing that separates them from the pure pipeline rate).
  tt = task_times.uniform_task_times([10.0, 12.0, 8.0, 11.0], send_ms=0.5, push_ms=7.0, pull_ms=7.0)
  # On-demand pulls (the wave-end pull of lock-stepped VWs races the other pushes, see the lockstep test above).
  one = run([tt], num_waves=20, num_inflight=3, staleness_bound=0, pull_every_wave=False)
  four = run([tt] * 4, num_waves=20, num_inflight=3, staleness_bound=0, pull_every_wave=False)
  base = [r.complete_time_s for r in one.minibatch_records]
  for v in range(4):
    got = [r.complete_time_s for r in four.minibatch_records if r.vw_id == v]
    np.testing.assert_allclose(got, base, rtol=REL)
  assert four.total_minibatches_per_s == pytest.approx(4 * one.vws[0].minibatches_per_s, rel=1e-6)
  free = run([dataclasses.replace(tt, push_s=0.0, pull_s=0.0)], num_waves=20, num_inflight=3, staleness_bound=0,
             pull_every_wave=False)
  assert one.vws[0].minibatches_per_s < free.vws[0].minibatches_per_s  # the PS sync cost


def test_slow_vw_holds_the_others_to_its_speed():
  fast = task_times.uniform_task_times([10.0, 10.0, 10.0])
  slow = task_times.uniform_task_times([20.0, 20.0, 20.0])
  waves, d = 60, 1
  r = run([fast, slow, fast], num_waves=waves, num_inflight=3, staleness_bound=d)
  rates = [v.minibatches_per_s for v in r.vws]
  assert rates[0] == pytest.approx(rates[1], rel=0.05) and rates[2] == pytest.approx(rates[1], rel=0.05)
  assert r.max_clock_distance <= d + 1
  assert all(dist <= d + 1 for _, dist, _, _ in r.clock_distance_samples)
  assert r.vws[0].wait_s > 0.4 * r.makespan_s and r.vws[1].wait_s == 0.0
  free = run([fast, slow, fast], num_waves=waves, num_inflight=3, staleness_bound=waves)
  assert free.vws[0].minibatches_per_s > 1.8 * free.vws[1].minibatches_per_s  # unbounded: no holding back


# ----------------------------------------------------------------------------------------- WSP invariants
def check_wsp_invariants(report, num_vws, num_waves, nm, d):
  recs = report.minibatch_records
  assert len(recs) == num_vws * num_waves * nm
  for r in recs:
    assert r.version_global_clock >= r.local_clock_at_injection - d, r  # global staleness bound (HetPipe §5)
    assert r.version_local_updates >= r.minibatch_id - (nm - 1), r  # local staleness s_local = Nm - 1
    assert r.wave_id == r.minibatch_id // nm
    assert r.inject_time_s <= r.complete_time_s
  for r in recs:  # the vector clock names the pulled weights; its minimum is their global clock
    assert len(r.version_vector_clock) == num_vws and min(r.version_vector_clock) == r.version_global_clock, r
  assert outputs.applied_in_order(report.ps_applied, num_vws)  # each VW's waves once, in wave order
  assert len(report.ps_applied) == num_vws * num_waves
  if report.config["ps_apply"] == "clock_aligned":
    assert report.ps_applied == [(w, v) for w in range(num_waves) for v in range(num_vws)]
    assert all(len(set(r.version_vector_clock)) == 1 for r in recs)  # never an extra update
  assert report.final_global_clock == num_waves
  assert report.max_clock_distance <= d + 1
  for v in report.vws:
    assert v.num_pushes == num_waves


@pytest.mark.parametrize("ps_apply", ["on_receipt", "clock_aligned"])
@pytest.mark.parametrize("seed", range(12))
def test_random_heterogeneous_runs_obey_every_bound(seed, ps_apply):
  rng = np.random.default_rng(seed)
  n, s_count, nm, d = int(rng.integers(1, 5)), int(rng.integers(1, 6)), int(rng.integers(1, 6)), int(rng.integers(0, 4))
  times = [task_times.uniform_task_times(list(rng.uniform(1.0, 4.0, s_count)),
                                         fwd_fraction=float(rng.uniform(0.2, 0.5)),
                                         send_ms=float(rng.uniform(0, 0.5)), push_ms=float(rng.uniform(0, 5)),
                                         pull_ms=float(rng.uniform(0, 5))) for _ in range(n)]
  waves = 15
  contention = bool(seed % 2)
  r = run(times, num_waves=waves, num_inflight=nm, staleness_bound=d, pull_every_wave=bool(seed % 3),
          ps_link_contention=contention, ps_apply=ps_apply)
  check_wsp_invariants(r, n, waves, nm, d)
  bound = cost_model.max_inflight_per_stage(s_count, nm)
  for v in r.vws:
    assert all(p <= b for p, b in zip(v.peak_inflight_per_stage, bound))
  # Every GPU is busy exactly its tasks' durations; utilisation in [0, 1].
  for g in r.gpus:
    tt = times[g.vw_id]
    assert g.busy_s == pytest.approx(waves * nm * tt.stage_time_s(g.stage_id), rel=1e-9)
    assert 0 < g.utilization <= 1 + 1e-12
  timing_only = engine.run(times, engine.EngineConfig(waves, nm, d, bool(seed % 3), records=False,
                                                      ps_link_contention=contention, ps_apply=ps_apply))
  assert timing_only.makespan_s == r.makespan_s and timing_only.minibatch_records == []


def test_task_events_follow_the_schedule_rules():
  tt = task_times.uniform_task_times([3.0, 1.0, 2.0, 1.5], send_ms=0.2)
  r = run([tt], num_waves=6, num_inflight=4, staleness_bound=0)
  by_stage = {}
  for e in r.task_events:
    by_stage.setdefault(e.stage_id, []).append(e)
  for s, events in by_stage.items():
    for a, b in zip(events, events[1:]):
      assert a.end_s <= b.start_s + 1e-15  # one in-order device per stage
  end = {(e.stage_id, e.task[len(str(e.stage_id)):-len(str(e.minibatch_id))], e.minibatch_id): e.end_s
         for e in r.task_events}
  for e in r.task_events:  # a task starts after its predecessor's output has arrived
    kind = e.task[len(str(e.stage_id)):-len(str(e.minibatch_id))]
    if kind in ("F", "FB") and e.stage_id > 0:
      assert e.start_s >= end[(e.stage_id - 1, "F", e.minibatch_id)]
    if kind == "B":
      nxt = "FB" if e.stage_id + 1 == 3 else "B"
      assert e.start_s >= end[(e.stage_id + 1, nxt, e.minibatch_id)]


# The row of minibatches.jsonl, written by hand (rules/records.MinibatchRecord; the runtime and virtual time write
# ``record.__dict__`` through jobs/outputs.RunOutputs.write_minibatches). None: NaN in strict JSON.
MINIBATCH_ROW_TYPES = (("vw_id", int), ("minibatch_id", int), ("wave_id", int), ("local_clock_at_injection", int),
                       ("version_id", int), ("version_local_updates", int), ("version_global_clock", int),
                       ("version_vector_clock", list), ("inject_time_s", float), ("complete_time_s", float), ("loss", type(None)))


class OrderHooks:
  """Records completions, injections and pull replies in event order (what each record's fields count)."""

  def __init__(self):
    self.calls = []

  def on_minibatch_complete(self, vw_id, minibatch_id, t):
    self.calls.append(("complete", vw_id, minibatch_id, t))

  def on_inject(self, vw_id, minibatch_id, t):
    self.calls.append(("inject", vw_id, minibatch_id, t))

  def on_pull_reply(self, vw_id, vector_clock, t):
    self.calls.append(("pull", vw_id, vector_clock, t))


def test_engine_records_fill_every_field_of_the_runtime_row_by_its_definition(tmp_path):
  nm, waves, d = 3, 6, 1
  times = [task_times.uniform_task_times([2.0, 3.1, 1.7], send_ms=0.13, push_ms=2.3, pull_ms=1.9),
           task_times.uniform_task_times([4.1, 1.3], send_ms=0.07, push_ms=0.9, pull_ms=3.7)]
  hooks = OrderHooks()
  r = engine.run(times, engine.EngineConfig(waves, nm, d, pull_every_wave=True), hooks=hooks)
  outputs.RunOutputs(tmp_path / "run").write_minibatches(rec.__dict__ for rec in r.minibatch_records)
  rows = [json.loads(line) for line in (tmp_path / "run" / "minibatches.jsonl").read_text().splitlines()]
  assert [(v, p) for v in range(2) for p in range(waves * nm)] == [(x["vw_id"], x["minibatch_id"]) for x in rows]
  for row in rows:
    assert list(row) == [name for name, _ in MINIBATCH_ROW_TYPES], row
    for name, kind in MINIBATCH_ROW_TYPES:
      assert type(row[name]) is kind, (name, row)  # pylint: disable=unidiomatic-typecheck  # bool is no int
  # Values by their definitions, counted from the event order the hooks saw.
  calls = hooks.calls
  inject_at = {c[1:3]: i for i, c in enumerate(calls) if c[0] == "inject"}
  complete_time = {c[1:3]: c[3] for c in calls if c[0] == "complete"}
  stage0_end = {(e.vw_id, e.minibatch_id): e.end_s for e in r.task_events if e.stage_id == 0 and "B" in e.task}
  pulled_before = 0
  for row in rows:
    v, p = row["vw_id"], row["minibatch_id"]
    before = [c for c in calls[:inject_at[(v, p)]] if c[1] == v]
    completed = sum(c[0] == "complete" for c in before)
    pulls = [c[2] for c in before if c[0] == "pull"]
    pulled_before += bool(pulls)
    assert row["wave_id"] == p // nm
    assert row["version_local_updates"] == completed  # own minibatches 0..n-1 (they complete in order)
    assert p - (nm - 1) <= completed <= p
    assert row["local_clock_at_injection"] == completed // nm  # completed waves
    assert row["version_id"] == completed + len(pulls)  # +1 per completion and per installed pull
    assert row["version_vector_clock"] == list(pulls[-1] if pulls else (0, 0))
    assert row["version_global_clock"] == min(row["version_vector_clock"])
    assert row["inject_time_s"] == calls[inject_at[(v, p)]][3]
    assert row["complete_time_s"] == complete_time[(v, p)] == stage0_end[(v, p)] > row["inject_time_s"]
    assert row["loss"] is None  # NaN: the engine computes no loss
  assert pulled_before >= waves  # the pull-dependent fields were exercised


# ----------------------------------------------------------------------------------------- hooks
class RecordingHooks:

  def __init__(self):
    self.calls = []

  def on_inject(self, vw_id, minibatch_id, t):
    self.calls.append(("inject", vw_id, minibatch_id, t))

  def on_task_start(self, vw_id, task, t):
    self.calls.append(("start", vw_id, str(task), t))

  def on_minibatch_complete(self, vw_id, minibatch_id, t):
    self.calls.append(("complete", vw_id, minibatch_id, t))

  def on_wave_end(self, vw_id, wave_id, t):
    self.calls.append(("wave_end", vw_id, wave_id, t))

  def on_push(self, vw_id, wave_id, t):
    self.calls.append(("push", vw_id, wave_id, t))

  def on_pull_sent(self, vw_id, vector_clock, t):
    self.calls.append(("sent", vw_id, vector_clock, t))

  def on_pull_reply(self, vw_id, vector_clock, t):
    self.calls.append(("pull", vw_id, vector_clock, t))


def test_hooks_are_called_in_the_documented_order():
  nm, waves, d = 2, 5, 0
  times = [task_times.uniform_task_times([2.0, 3.0, 1.0], push_ms=1.0, pull_ms=1.5),
           task_times.uniform_task_times([4.0, 1.0, 1.0], push_ms=0.5, pull_ms=0.5)]
  hooks = RecordingHooks()
  r = engine.run(times, engine.EngineConfig(waves, nm, d), hooks=hooks)
  calls = hooks.calls
  assert [c[3] for c in calls] == sorted(c[3] for c in calls)  # event order = virtual-time order
  index = {c[:3]: i for i, c in enumerate(calls)}
  for rec in r.minibatch_records:
    v, p = rec.vw_id, rec.minibatch_id
    assert calls[index[("inject", v, p)]][3] == rec.inject_time_s
    assert calls[index[("complete", v, p)]][3] == rec.complete_time_s
    assert index[("inject", v, p)] < index[("start", v, f"0F{p}")] < index[("complete", v, p)]
    if p + nm < waves * nm:  # p's completion lets p + Nm in: complete comes first (same event or earlier)
      assert index[("complete", v, p)] < index[("inject", v, p + nm)]
  for v in range(2):
    pushes = [c for c in calls if c[0] == "push" and c[1] == v]
    assert [c[2] for c in pushes] == list(range(waves))
    for c in pushes:  # a push arrives after its wave's last minibatch completed and its wave end was told
      last = index[("complete", v, (c[2] + 1) * nm - 1)]
      assert calls[last + 1] == ("wave_end", v, c[2], calls[last][3])  # right after it, in the same event
      assert last < index[c[:3]]
    assert [c[2] for c in calls if c[0] == "wave_end" and c[1] == v] == list(range(waves))
    clocks = [c[2] for c in calls if c[0] == "pull" and c[1] == v]
    assert clocks == sorted(clocks) and len(clocks) == r.vws[v].num_pulls
    # Each reply carries the vector clock the PS had when it answered (on_pull_sent), which comes first.
    sent = [c for c in calls if c[0] == "sent" and c[1] == v]
    assert [c[2] for c in sent] == clocks
    pulls = [c for c in calls if c[0] == "pull" and c[1] == v]
    assert all(index[a[:3]] < index[b[:3]] and a[3] <= b[3] for a, b in zip(sent, pulls))
  # Each record's version_vector_clock is the last pull reply delivered to that VW before its injection.
  for rec in r.minibatch_records:
    before = calls[:index[("inject", rec.vw_id, rec.minibatch_id)]]
    pulls = [c[2] for c in before if c[0] == "pull" and c[1] == rec.vw_id]
    assert rec.version_vector_clock == (pulls[-1] if pulls else (0, 0))


def test_engine_drives_the_sync_states_it_is_given():
  times = [task_times.uniform_task_times([2.0, 3.0], push_ms=1.0, pull_ms=1.5),
           task_times.uniform_task_times([4.0, 1.0], push_ms=0.5, pull_ms=0.5)]
  config = engine.EngineConfig(num_waves=4, num_inflight=2, staleness_bound=1)
  states = [wsp.VWSyncState(2, 1, True) for _ in times]
  seen = []

  class ReadingHooks:  # hooks see the state the engine advances (the VirtualWorkers' own, in virtual time)

    def on_inject(self, vw_id, minibatch_id, t):
      seen.append((vw_id, minibatch_id, states[vw_id].local_clock))

  r = engine.run(times, config, hooks=ReadingHooks(), sync_states=states)
  assert [s.local_clock for s in states] == [4, 4]
  assert all(s.pull_required is None for s in states)
  for rec in r.minibatch_records:
    assert (rec.vw_id, rec.minibatch_id, rec.local_clock_at_injection) in seen
  plain = engine.run(times, config)
  assert [x.complete_time_s for x in plain.minibatch_records] == [x.complete_time_s for x in r.minibatch_records]
  with pytest.raises(ValueError, match="2 entries for 1"):
    engine.run(times[:1], config, sync_states=[wsp.VWSyncState(2, 1)] * 2)
  with pytest.raises(ValueError, match=r"\(2, 0, True\); the engine config has \(2, 1, True\)"):
    engine.run(times, config, sync_states=[wsp.VWSyncState(2, 1), wsp.VWSyncState(2, 0)])
  with pytest.raises(ValueError, match="not fresh"):
    engine.run(times, config, sync_states=states)


# ----------------------------------------------------------------------------------------- in-flight bound
def test_peak_inflight_reaches_the_cost_model_bound():
  # Fast stages before a slow stage 2: every non-last stage runs all Nm forwards before any backward.
  tt = task_times.uniform_task_times([0.1, 0.1, 10.0, 0.1], fwd_fraction=0.5)
  r = run([tt], num_waves=5, num_inflight=6, staleness_bound=0, records=False)
  assert r.vws[0].peak_inflight_per_stage == cost_model.max_inflight_per_stage(4, 6)


def test_config_and_input_errors():
  with pytest.raises(ValueError, match="num_waves"):
    engine.EngineConfig(num_waves=0, num_inflight=1)
  with pytest.raises(ValueError, match="num_inflight"):
    engine.EngineConfig(num_waves=1, num_inflight=0)
  with pytest.raises(ValueError, match="staleness_bound"):
    engine.EngineConfig(num_waves=1, num_inflight=1, staleness_bound=-1)
  with pytest.raises(ValueError, match="task_times is empty"):
    engine.run([], engine.EngineConfig(1, 1))
  with pytest.raises(ValueError, match="gpu_ids"):
    engine.run([task_times.uniform_task_times([1.0])], engine.EngineConfig(1, 1), gpu_ids=[["a", "b"]])


# ----------------------------------------------------------------------------------------- PS application modes
def test_on_receipt_versions_hold_more_updates_than_clock_aligned_ones_at_the_same_clock():
  """Same cluster (3 VWs, 1x / 1.5x / 3x slower, D = 2) under both modes: the clock rule, hence every timing and
  every record's global clock, is the same; on_receipt's pulled weights hold every update clock_aligned's hold and,
  for some minibatches, faster VWs' newer waves too (HetPipe §5–§6's extra updates); clock_aligned's never."""
  times = [task_times.uniform_task_times([2.0, 2.0], push_ms=0.3, pull_ms=0.3),
           task_times.uniform_task_times([3.0, 3.0], push_ms=0.3, pull_ms=0.3),
           task_times.uniform_task_times([6.0, 6.0], push_ms=0.3, pull_ms=0.3)]
  for pull_every_wave in (True, False):
    runs = {mode: run(times, num_waves=12, num_inflight=2, staleness_bound=2, pull_every_wave=pull_every_wave,
                      ps_apply=mode) for mode in ("on_receipt", "clock_aligned")}
    on_receipt, aligned = runs["on_receipt"], runs["clock_aligned"]
    assert on_receipt.makespan_s == aligned.makespan_s
    assert [r.complete_time_s for r in on_receipt.minibatch_records] == \
        [r.complete_time_s for r in aligned.minibatch_records]
    more = 0
    for a, b in zip(on_receipt.minibatch_records, aligned.minibatch_records):
      assert (a.vw_id, a.minibatch_id, a.version_global_clock) == (b.vw_id, b.minibatch_id, b.version_global_clock)
      g = b.version_global_clock
      assert b.version_vector_clock == (g, g, g)
      assert min(a.version_vector_clock) == g and all(c >= g for c in a.version_vector_clock)
      more += sum(a.version_vector_clock) > 3 * g
      assert wsp.extra_updates(b.version_vector_clock, b.vw_id) == 0
    assert more >= 3, more  # lower bound: extra updates really occur
    # Both logs hold every VW's waves once; only clock_aligned's is in wave-major order.
    assert aligned.ps_applied == [(w, v) for w in range(12) for v in range(3)]
    assert on_receipt.ps_applied != aligned.ps_applied
    assert sorted(on_receipt.ps_applied) == sorted(aligned.ps_applied)


def test_engine_rejects_an_unknown_ps_apply():
  with pytest.raises(ValueError, match="ps_apply='eventually'"):
    engine.EngineConfig(num_waves=1, num_inflight=1, ps_apply="eventually")


@pytest.mark.parametrize("push_ms,pull_ms", [(0.0, 0.0), (2.0, 3.0)])
def test_a_vw_pull_request_never_overtakes_its_own_push(push_ms, pull_ms):
  """A VW's push and its pull request travel one ordered channel (module docstring): the pull it requests at a
  wave end reaches the PS after that wave's push, so under on_receipt every reply holds each wave the VW had ended
  before the PS answered (its own entry of the vector clock is its number of wave ends so far), and the answer comes
  no earlier than the push's arrival. Both with zero push/pull times (same-time events: order by sending) and with
  positive ones."""
  nm, waves = 2, 6
  times = [task_times.uniform_task_times([2.0, 3.0], push_ms=push_ms, pull_ms=pull_ms),
           task_times.uniform_task_times([4.0, 1.0], push_ms=push_ms / 2, pull_ms=pull_ms / 2)]
  hooks = RecordingHooks()
  engine.run(times, engine.EngineConfig(waves, nm, 4, pull_every_wave=True, ps_apply="on_receipt"), hooks=hooks)
  calls = hooks.calls
  answered = 0
  for v in range(2):
    for i, call in enumerate(calls):
      if call[0] != "sent" or call[1] != v:
        continue
      ended = sum(1 for c in calls[:i] if c[0] == "wave_end" and c[1] == v)
      arrived = [c for c in calls[:i] if c[0] == "push" and c[1] == v]
      assert call[2][v] == ended == len(arrived), (v, call, ended, len(arrived))
      assert call[3] >= arrived[-1][3]
      answered += 1
  assert answered >= 2 * (waves - 1)  # a pull after (nearly) every wave end of both VWs
