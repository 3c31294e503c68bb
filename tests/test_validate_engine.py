"""Engine validation script helpers: steady-state rules match the engine report's, cases are well-formed."""

import math

import pytest

from experiments import validate_engine as ve
from hetpipe_jax import engine, engine_report, task_times


def test_steady_rules_with_one_warmup_wave_are_the_engine_reports():
  times = [task_times.uniform_task_times([60, 120]), task_times.uniform_task_times([120, 60])]
  report = engine.run(times, engine.EngineConfig(num_waves=8, num_inflight=2, staleness_bound=1))
  completions = ve.completion_times_by_vw([r.__dict__ for r in report.minibatch_records], 2)
  per_vw, total, window = engine_report.steady_rates(completions, 2)
  assert [ve.steady_rate(c, 2, 1) for c in completions] == pytest.approx(per_vw, rel=1e-12)
  got_total, got_window = ve.steady_total(completions, 2, 1)
  assert got_total == pytest.approx(total, rel=1e-12)
  assert got_window == pytest.approx(window)
  assert got_total == pytest.approx(report.total_minibatches_per_s, rel=1e-12)


def test_steady_rate_skips_warmup_waves():
  # Wave 0 and 1 slow (compilation), then one minibatch every 0.1 s.
  times = [5.0, 5.1, 9.0, 9.1] + [9.1 + 0.1 * i for i in range(1, 9)]
  assert ve.steady_rate(times, 2, 2) == pytest.approx(10.0)
  assert ve.steady_rate(times, 2, 1) < 3.0
  assert math.isnan(ve.steady_rate(times[:4], 2, 2))
  with pytest.raises(ValueError, match="warmup_waves"):
    ve.steady_rate(times, 2, 0)


def test_common_clock_shifts_each_vw_by_its_start():
  records = [{"vw_id": v, "minibatch_id": p, "complete_time_s": 1.0 + p, "vw_start_perf_counter_s": 100.0 + 0.5 * v}
             for v in range(2) for p in range(3)]
  assert ve.completion_times_by_vw(records, 2, common_clock=True) == [[1.0, 2.0, 3.0], [1.5, 2.5, 3.5]]
  assert ve.completion_times_by_vw(records, 2) == [[1.0, 2.0, 3.0]] * 2
  with pytest.raises(ValueError, match="minibatch ids"):
    ve.completion_times_by_vw(records[1:], 2)


def test_cases_cover_the_asked_ranges_with_tasks_of_at_least_20_ms():
  cases = ve.CASES
  assert len(cases) >= 10
  assert {c.num_vws for c in cases} == {1, 2, 3}
  assert {c.num_stages for c in cases} == {2, 3, 4}
  assert min(c.num_inflight for c in cases) == 1 and max(c.num_inflight for c in cases) >= 6
  assert min(c.staleness_bound for c in cases) == 0 and max(c.staleness_bound for c in cases) == 4
  for c in cases:
    rows = c.vw_stage_ms()
    assert max(max(r) for r in rows) / min(min(r) for r in rows) <= 4.0
    for r in rows:
      tt = task_times.uniform_task_times(r)
      assert min(tt.forward_s + tt.backward_s + (tt.forward_backward_s,)) >= 0.020 - 1e-12, c.name
    m = ve.num_minibatches(c, True, 3)
    assert m % c.num_inflight == 0 and m // c.num_inflight >= 3 + 3
    assert math.isfinite(ve.predict(c, m, 3)["total_mb_per_s"])


def test_latency_from_probe_takes_medians():
  # 60 + 60 ms stages: 120 ms of tasks; hand-offs add 4 ms, the PS round trip 10 ms; one stalled minibatch.
  records, t = [], 0.0
  for p in range(12):
    busy = 0.124 if p != 7 else 0.400
    records.append({"vw_id": 0, "minibatch_id": p, "inject_time_s": t, "complete_time_s": t + busy})
    t += busy + (0.010 if p != 8 else 0.300)
  got = ve.latency_from_probe(records)
  assert got["send_ms"] == pytest.approx(2.0)
  assert got["push_ms"] == pytest.approx(5.0) and got["pull_ms"] == pytest.approx(5.0)
  assert got["ps_round_trip_ms_max"] == pytest.approx(300.0)


def test_quick_cases_still_span_the_ranges():
  quick = [c for c in ve.CASES if c.in_quick]
  assert len(quick) >= 10
  assert {c.num_vws for c in quick} == {1, 2, 3} and {c.num_stages for c in quick} == {2, 3, 4}
  assert {min(c.num_inflight for c in quick), max(c.num_inflight for c in quick)} == {1, 6}
  assert {min(c.staleness_bound for c in quick), max(c.staleness_bound for c in quick)} == {0, 4}
