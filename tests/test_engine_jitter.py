"""Per-task timing jitter in the event engine (``EngineConfig.task_time_cv``): its distribution against the closed
form of a log-normal factor of mean 1, reproducibility, sends left exact, and WSP bounds under jitter (HetPipe §5,
§8.4's waiting statistics)."""

import math

import numpy as np
import pytest

from hetpipe_jax.costs import task_times
from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.sim import engine


def one_stage(fb_ms, push_ms=0.0):
  return task_times.VWTaskTimes(forward_s=(), backward_s=(), forward_backward_s=fb_ms * 1e-3, send_activation_s=(),
                                send_gradient_s=(), push_s=push_ms * 1e-3, pull_s=push_ms * 1e-3)


def durations(report, stage_id=None):
  return np.array([e.end_s - e.start_s for e in report.task_events if stage_id is None or e.stage_id == stage_id])


@pytest.mark.parametrize("cv", [0.1, 0.3])
def test_task_durations_have_mean_one_and_the_set_coefficient_of_variation(cv):
  # One stage, Nm = 1: every task is one draw times 10 ms. 4,000 draws: the sample mean is within 5 standard errors
  # of 10 ms (cv * 10 ms / sqrt(n)), and the sample CV within 10% of cv (its standard error is about 2-4% here).
  report = engine.run([one_stage(10.0)], engine.EngineConfig(num_waves=4000, num_inflight=1, task_time_cv=cv,
                                                             jitter_seed=3))
  d = durations(report)
  assert len(d) == 4000
  assert abs(d.mean() - 0.010) <= 5 * cv * 0.010 / math.sqrt(len(d))
  assert d.std() / d.mean() == pytest.approx(cv, rel=0.10)
  assert d.min() > 0 and len(np.unique(d)) == len(d)  # every task drew its own factor
  # Sequential tasks on one device: the makespan is their sum (the jitter is the only source of variation).
  assert report.makespan_s == pytest.approx(d.sum(), rel=1e-9)


def test_no_jitter_is_the_deterministic_engine():
  times = [task_times.uniform_task_times([20.0, 40.0], send_ms=2.0), task_times.uniform_task_times([30.0, 30.0])]
  base = engine.run(times, engine.EngineConfig(num_waves=6, num_inflight=3, staleness_bound=1))
  zero = engine.run(times, engine.EngineConfig(num_waves=6, num_inflight=3, staleness_bound=1, task_time_cv=0.0,
                                               jitter_seed=99))
  assert zero.makespan_s == base.makespan_s
  assert [(e.start_s, e.end_s) for e in zero.task_events] == [(e.start_s, e.end_s) for e in base.task_events]


def test_jitter_is_reproducible_per_seed():
  times = [task_times.uniform_task_times([20.0, 40.0]), task_times.uniform_task_times([30.0, 30.0])]
  cfg = lambda seed: engine.EngineConfig(num_waves=6, num_inflight=3, staleness_bound=1,  # noqa: E731
                                         task_time_cv=0.2, jitter_seed=seed)
  a, b, c = engine.run(times, cfg(1)), engine.run(times, cfg(1)), engine.run(times, cfg(2))
  assert [(e.start_s, e.end_s) for e in a.task_events] == [(e.start_s, e.end_s) for e in b.task_events]
  assert a.makespan_s != c.makespan_s


def test_sends_are_not_jittered():
  # Stage 0's forward computes 1 ns and sends its activation for 10 ms: its duration stays 10 ms (+ 1 ns * factor)
  # at CV 0.5, while the compute-heavy last stage varies.
  times = task_times.VWTaskTimes(forward_s=(1e-9,), backward_s=(1e-9,), forward_backward_s=0.02,
                                 send_activation_s=(0.01,), send_gradient_s=(0.0,), push_s=0.0, pull_s=0.0)
  report = engine.run([times], engine.EngineConfig(num_waves=50, num_inflight=2, task_time_cv=0.5))
  fwd0 = np.array([e.end_s - e.start_s for e in report.task_events
                   if Task.parse(e.task).kind is TaskKind.FORWARD and e.stage_id == 0])
  assert len(fwd0) == 100
  assert np.allclose(fwd0, 0.01, rtol=0, atol=1e-7)
  last = durations(report, stage_id=1)
  assert last.std() / last.mean() > 0.3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wsp_bound_holds_and_is_reached_under_jitter(seed):
  # Two identical VWs: deterministic, they never drift apart (clock distance 1, no waiting); jitter drives them
  # apart until WSP's bound stops the faster one: local clocks at most D + 1 apart, and that distance is reached.
  times = [task_times.uniform_task_times([20.0, 20.0], push_ms=1.0, pull_ms=1.0)] * 2
  config = lambda cv: engine.EngineConfig(num_waves=200, num_inflight=2, staleness_bound=1,  # noqa: E731
                                          task_time_cv=cv, jitter_seed=seed)
  still = engine.run(times, config(0.0))
  assert still.max_clock_distance == 1 and sum(v.wait_s for v in still.vws) == 0
  report = engine.run(times, config(0.3))
  assert report.max_clock_distance == 1 + 1
  assert sum(v.wait_s for v in report.vws) > 0


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), 11.0])
def test_bad_task_time_cv_is_refused(bad):
  with pytest.raises(ValueError, match="task_time_cv"):
    engine.EngineConfig(num_waves=1, num_inflight=1, task_time_cv=bad)
