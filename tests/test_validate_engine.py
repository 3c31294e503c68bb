"""The one steady-state rule (``engine_report.steady_rates``), as the engine and the validation script use it; the
script's helpers and cases."""

import math

import pytest

from experiments import validate_engine as ve
from hetpipe_jax.costs import task_times
from hetpipe_jax.sim import engine
from hetpipe_jax.sim import engine_report


def test_steady_rates_default_is_the_engine_reports_and_the_validation_uses_it():
  times = [task_times.uniform_task_times([60, 120]), task_times.uniform_task_times([120, 60])]
  report = engine.run(times, engine.EngineConfig(num_waves=8, num_inflight=2, staleness_bound=1))
  completions = ve.completion_times_by_vw([r.__dict__ for r in report.minibatch_records], 2)
  per_vw, total, window = engine_report.steady_rates(completions, 2)
  assert per_vw == pytest.approx([v.minibatches_per_s for v in report.vws], rel=1e-12)
  assert total == pytest.approx(report.total_minibatches_per_s, rel=1e-12)
  assert window == pytest.approx(report.steady_window_s)
  assert engine_report.steady_rates(completions, 2, warmup_waves=1) == (per_vw, total, window)
  got = ve.rates(completions, 2, 1)
  assert got["per_vw_mb_per_s"] == per_vw and got["total_mb_per_s"] == total and not got["total_is_sum_of_per_vw"]
  assert got["steady_window_s"] == list(window)


def test_steady_rates_skip_warmup_waves_per_vw():
  # Wave 0 and 1 slow (compilation), then one minibatch every 0.1 s.
  times = [5.0, 5.1, 9.0, 9.1] + [9.1 + 0.1 * i for i in range(1, 9)]
  rate = lambda w: engine_report.steady_rates([times], 2, warmup_waves=w)[0][0]  # noqa: E731
  assert rate(2) == pytest.approx(10.0)
  assert rate(1) < 3.0
  assert math.isnan(engine_report.steady_rates([times[:4]], 2, warmup_waves=2)[0][0])
  with pytest.raises(ValueError, match="warmup_waves"):
    engine_report.steady_rates([times], 2, warmup_waves=0)


def test_steady_rates_total_window_starts_at_the_latest_warmup_end():
  # Nm = 1: a wave is one minibatch. VW 0's warm-up ends at 5 (two waves) or 1 (one); VW 1's at 6 or 2.
  completions = [[1.0, 5.0, 6.0, 7.0, 8.0], [2.0, 6.0, 6.5, 7.0, 7.5, 8.5]]
  per_vw, total, window = engine_report.steady_rates(completions, 1, warmup_waves=2)
  assert per_vw == pytest.approx([3 / 3.0, 4 / 2.5])
  assert window == (6.0, 8.0) and total == pytest.approx(5 / 2.0)  # (6, 8]: 7, 8 and 6.5, 7, 7.5
  per_vw, total, window = engine_report.steady_rates(completions, 1)
  assert per_vw == pytest.approx([4 / 7.0, 5 / 6.5])
  assert window == (2.0, 8.0) and total == pytest.approx(8 / 6.0)
  per_vw, total, window = engine_report.steady_rates(completions, 1, warmup_waves=5)  # VW 0 has nothing left
  assert math.isnan(per_vw[0]) and per_vw[1] == pytest.approx(1.0) and math.isnan(total) and window == (8.0, 8.0)
  per_vw, total, window = engine_report.steady_rates(completions, 1, warmup_waves=6)  # VW 0 is still warming up
  assert all(math.isnan(x) for x in (*per_vw, total, *window))
  got = ve.rates(completions, 1, 5)
  assert got["total_is_sum_of_per_vw"] and math.isnan(got["total_mb_per_s"])
  with pytest.raises(ValueError, match="warmup_waves"):
    engine_report.steady_rates(completions, 1, warmup_waves=-1)


def test_common_clock_shifts_each_vw_by_its_start():
  records = [{"vw_id": v, "minibatch_id": p, "complete_time_s": 1.0 + p} for v in range(2) for p in range(3)]
  starts = [1.7e9 + 0.5, 1.7e9]
  assert ve.completion_times_by_vw(records, 2, start_unix_s=starts) == [[1.5, 2.5, 3.5], [1.0, 2.0, 3.0]]
  assert ve.completion_times_by_vw(records, 2) == [[1.0, 2.0, 3.0]] * 2
  with pytest.raises(ValueError, match="minibatch ids"):
    ve.completion_times_by_vw(records[1:], 2)
  with pytest.raises(ValueError, match="start_unix_s"):
    ve.completion_times_by_vw(records, 2, start_unix_s=starts[:1])


def test_run_job_launches_the_plain_entry_point(monkeypatch, tmp_path):
  calls = []

  def fake_run(cmd, **kwargs):
    calls.append((cmd, kwargs))
    raise RuntimeError("stop")

  monkeypatch.setattr(ve.subprocess, "run", fake_run)
  with pytest.raises(RuntimeError, match="stop"):
    ve.run_job(ve.SMOKE, 8, tmp_path, tmp_path / "w", 10)
  (cmd, kwargs), = calls
  assert cmd[cmd.index("mpi4py") - 1:cmd.index("mpi4py") + 3] == ["-m", "mpi4py", "-m", "hetpipe_jax.train"]
  assert "-n" in cmd and cmd[cmd.index("-n") + 1] == "3"
  assert kwargs["env"]["PYTHONPATH"] == str(ve.REPO_ROOT)


def test_cases_cover_the_asked_ranges_with_tasks_of_at_least_20_ms():
  cases = [c for c in ve.CASES if c.method == "hetpipe"]
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
    m = ve.num_minibatches(c, "quick", 3)
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


def test_every_method_has_two_validation_cases_and_the_engine_runs_them():
  by_method = {}
  for c in ve.CASES:
    by_method.setdefault(c.method, []).append(c)
  assert set(by_method) == {"hetpipe", "pipedream", "gpipe", "1f1b_flush", "horovod"}
  assert all(len(v) >= 2 for v in by_method.values())
  for c in ve.METHOD_CASES:
    assert not c.in_quick  # --quick stays the HetPipe validation
    for r in c.vw_stage_ms():  # a task (a micro-batch for the flush methods) lasts >= 10 ms
      tt = task_times.uniform_task_times(r)
      assert min(tt.forward_s + tt.backward_s + (tt.forward_backward_s,)) >= 0.010 - 1e-12, c.name
    m = ve.num_minibatches(c, "quick", 3)
    assert m % c.num_inflight == 0
    assert math.isfinite(ve.predict(c, m, 3, push_ms=1.0, pull_ms=1.0)["total_mb_per_s"])
