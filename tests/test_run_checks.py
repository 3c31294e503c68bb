"""The drills' and the load test's oracles (experiments/run_checks.py) on hand-made records."""

from experiments import run_checks


def test_applied_once_names_missing_repeated_and_unexpected_waves_per_shard():
  applied = [{"vw_id": 0, "wave_id": 0}, {"vw_id": 1, "wave_id": 0}, {"vw_id": 0, "wave_id": 1},
             {"vw_id": 0, "wave_id": 1}, {"vw_id": 1, "wave_id": 5}]
  assert run_checks.applied_once(applied, num_vws=2, num_waves=2) == {
      "missing": [(0, 1, 1)], "twice": [(0, 0, 1)], "unexpected": [(0, 1, 5)]}
  sharded = [{"vw_id": v, "wave_id": 0, "shard": s} for s in (0, 1) for v in (0, 1)]
  assert run_checks.applied_once(sharded, 2, 1) == {"missing": [], "twice": [], "unexpected": []}
  assert run_checks.applied_once(sharded[:3], 2, 1)["missing"] == [(1, 1, 0)]


def test_wsp_violations_and_the_staleness_reached():
  records = [{"local_clock_at_injection": 3, "version_global_clock": 1},
             {"local_clock_at_injection": 4, "version_global_clock": 1},
             {"local_clock_at_injection": 0, "version_global_clock": 0}]
  assert run_checks.wsp_violations(records, staleness_bound=2) == [records[1]]
  assert run_checks.wsp_violations(records, staleness_bound=3) == []
  assert run_checks.max_staleness(records) == 3


def test_loss_jump_compares_the_first_loss_after_the_cut_with_the_three_before():
  metrics = [{"global_clock": c, "loss": l} for c, l in [(5, 2.0), (10, 1.0), (15, 0.5), (20, 0.4), (25, 0.7)]]
  got = run_checks.loss_jump(metrics, cut_clock=20)
  assert got == {"before": [1.0, 0.5, 0.4], "after": 0.7, "ok": True}  # 0.7 <= 2 * 1.0 + 0.05
  metrics[-1]["loss"] = 2.06
  assert not run_checks.loss_jump(metrics, 20)["ok"]
  assert not run_checks.loss_jump(metrics, 25)["ok"]  # nothing after the cut
