"""The per-stage in-order executor: order, times, emulated durations (padding, overruns), errors, close.

Work is emulated with sleeps (split between the dispatch call and the wait on its output, as a JAX dispatch is), so
the expected times are closed forms; lower bounds are strict, upper bounds carry ``SLACK_S`` for a loaded machine.
"""

import ctypes
import queue
import sys
import threading
import time

import jax
import numpy as np
import pytest

from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.runtime.stage_executor import OVERRUN_TOLERANCE_S, Completion, StageExecutor

SLACK_S = 0.2  # scheduling latency allowed on top of a closed-form upper bound
EPS_S = 1e-6  # float rounding between perf_counter differences
PR_GET_TIMERSLACK = 30  # linux/prctl.h


class SleepMarker:
  """Stands in for a dispatched array: waiting on it takes ``wait_s`` (the device finishing the work)."""

  def __init__(self, wait_s: float = 0.0, error: BaseException | None = None):
    self.wait_s = wait_s
    self.error = error

  def block_until_ready(self):
    time.sleep(self.wait_s)
    if self.error is not None:
      raise self.error
    return self


def work(dispatch_s: float = 0.0, wait_s: float = 0.0, log: list | None = None, name=None):
  """A dispatch function: ``dispatch_s`` inside the call, then ``wait_s`` until its output is ready."""
  def dispatch():
    if log is not None:
      log.append(name)
    time.sleep(dispatch_s)
    return SleepMarker(wait_s)
  return dispatch


def fwd(minibatch_id: int, stage_id: int = 0) -> Task:
  return Task(stage_id, TaskKind.FORWARD, minibatch_id)


def collect(done: queue.SimpleQueue, n: int, timeout_s: float = 5.0) -> list[Completion]:
  return [done.get(timeout=timeout_s) for _ in range(n)]


@pytest.fixture
def make_executor():
  """``make_executor(stage_id, t0=None)`` -> (executor, done queue, t0); every executor is closed at teardown."""
  made = []

  def make(stage_id=0, t0=None, done=None):
    done = queue.SimpleQueue() if done is None else done
    t0 = time.perf_counter() if t0 is None else t0
    ex = StageExecutor(stage_id, done, t0)
    made.append(ex)
    return ex, done, t0

  yield make
  for ex in made:
    ex.close()


def stage_thread_alive(stage_id: int) -> bool:
  return any(t.name == f"stage-{stage_id}" and t.is_alive() for t in threading.enumerate())


def test_tasks_run_one_at_a_time_in_submission_order(make_executor):
  ex, done, _ = make_executor()
  gate = threading.Event()
  active, max_active, started = [0], [0], []
  lock = threading.Lock()

  def task_work(name, seconds):
    def dispatch():
      with lock:
        active[0] += 1
        max_active[0] = max(max_active[0], active[0])
      started.append(name)
      if name == "first":
        gate.wait(5.0)
      else:
        time.sleep(seconds)
      with lock:
        active[0] -= 1
      return SleepMarker()
    return dispatch

  # The first task blocks until every task is queued; later tasks get shorter, so any reordering or parallelism
  # would show in the completion order.
  ex.submit(fwd(0), task_work("first", 0.0))
  for p, seconds in zip(range(1, 5), (0.06, 0.04, 0.02, 0.0)):
    ex.submit(fwd(p), task_work(p, seconds))
  gate.set()
  completions = collect(done, 5)
  assert [c.task for c in completions] == [fwd(p) for p in range(5)]
  assert started == ["first", 1, 2, 3, 4]
  assert max_active[0] == 1
  for a, b in zip(completions, completions[1:]):
    assert b.start_s >= a.end_s  # no overlap
  assert all(c.error is None and c.overrun_s == 0.0 for c in completions)


def test_completion_times_are_relative_to_t0_and_split_dispatch_from_wait(make_executor):
  t0 = time.perf_counter() - 50.0  # the run started 50 s ago
  ex, done, _ = make_executor(t0=t0)
  before = time.perf_counter() - t0
  ex.submit(fwd(3, stage_id=1), work(dispatch_s=0.03, wait_s=0.05))
  (c,) = collect(done, 1)
  after = time.perf_counter() - t0
  assert c.task == fwd(3, stage_id=1)
  assert before <= c.start_s <= c.end_s <= after
  assert 0.03 <= c.dispatch_s <= 0.03 + SLACK_S
  assert 0.08 - EPS_S <= c.end_s - c.start_s <= 0.08 + SLACK_S  # dispatch + wait for the output
  assert c.dispatch_s <= c.end_s - c.start_s - 0.05 + EPS_S  # the wait is not counted in dispatch_s
  assert c.overrun_s == 0.0 and c.error is None


def test_emulated_tasks_are_padded_back_to_back(make_executor):
  ex, done, t0 = make_executor()
  d = 0.06
  submitted = time.perf_counter() - t0
  for p in range(3):
    ex.submit(fwd(p), work(), duration_s=d)
  completions = collect(done, 3)
  # Emulated start = max(submission, previous emulated end): task k ends no earlier than submitted + (k + 1) d.
  for k, c in enumerate(completions):
    assert c.task == fwd(k)
    assert c.end_s >= submitted + (k + 1) * d - EPS_S
    assert c.end_s - c.start_s >= d - EPS_S
    assert c.overrun_s == 0.0
    assert submitted <= c.submit_s <= c.start_s
    # On the emulated device the tasks run back to back from the first submission, exactly: the executor's
    # lateness in reporting an end (its sleep's wake-up, the GIL) does not push the next task back.
    assert c.device_end_s == pytest.approx(completions[0].submit_s + (k + 1) * d, abs=EPS_S)
    assert c.device_end_s <= c.end_s
  for a, b in zip(completions, completions[1:]):
    assert b.start_s == a.device_end_s  # the device does not overlap tasks
  assert completions[-1].end_s <= submitted + 3 * d + SLACK_S

  # After an idle gap the next emulated start is the new submission, not the previous end.
  time.sleep(0.1)
  resubmitted = time.perf_counter() - t0
  ex.submit(fwd(3), work(), duration_s=0.05)
  (c,) = collect(done, 1)
  assert c.start_s == c.submit_s >= resubmitted
  assert c.device_end_s == pytest.approx(c.start_s + 0.05, abs=EPS_S)
  assert resubmitted + 0.05 - EPS_S <= c.end_s <= resubmitted + 0.05 + SLACK_S


def test_padding_covers_the_real_work(make_executor):
  # The real work counts towards the emulated duration ("sleep after the real work" up to start + duration).
  ex, done, _ = make_executor()
  ex.submit(fwd(0), work(dispatch_s=0.05, wait_s=0.1), duration_s=0.25)
  (c,) = collect(done, 1)
  assert c.overrun_s == 0.0
  assert 0.25 - EPS_S <= c.end_s - c.start_s <= 0.25 + 0.1  # work then duration would take 0.4 s


@pytest.mark.parametrize("duration_s", [0.02, 0.0])
def test_work_longer_than_duration_is_an_overrun(make_executor, duration_s):
  ex, done, _ = make_executor()
  ex.submit(fwd(0), work(dispatch_s=0.06, wait_s=0.06), duration_s=duration_s)
  (c,) = collect(done, 1)
  real_s = c.end_s - c.start_s
  assert c.overrun_s > OVERRUN_TOLERANCE_S
  assert c.overrun_s >= 0.12 - duration_s - EPS_S  # both the dispatch and the wait count
  assert c.overrun_s <= real_s - duration_s + EPS_S
  assert 0.12 - EPS_S <= real_s <= 0.12 + SLACK_S  # no padding after an overrun


def test_work_shorter_than_duration_or_not_emulated_is_no_overrun(make_executor):
  ex, done, _ = make_executor()
  ex.submit(fwd(0), work(dispatch_s=0.01, wait_s=0.01), duration_s=0.1)
  ex.submit(fwd(1), work(dispatch_s=0.01, wait_s=0.01), duration_s=None)
  emulated, plain = collect(done, 2)
  assert emulated.overrun_s == 0.0 and plain.overrun_s == 0.0
  assert emulated.end_s - emulated.start_s >= 0.1 - EPS_S
  assert 0.02 - EPS_S <= plain.end_s - plain.start_s <= 0.02 + SLACK_S  # no padding without a duration


@pytest.mark.parametrize("where", ["dispatch", "wait"])
def test_an_exception_is_reported_on_the_queue(make_executor, where):
  ex, done, t0 = make_executor(stage_id=5)
  error = ValueError("device fell over")

  def failing():
    if where == "dispatch":
      raise error
    return SleepMarker(0.01, error=error)

  ex.submit(fwd(0), work(wait_s=0.01))
  ex.submit(fwd(1), failing, duration_s=0.05)
  ok, failed = collect(done, 2)
  assert ok.task == fwd(0) and ok.error is None
  assert failed.task == fwd(1)
  assert failed.error is error
  assert ok.end_s <= failed.start_s <= failed.end_s <= time.perf_counter() - t0
  ex.close()  # returns although the loop has ended
  assert not stage_thread_alive(5)


def test_dispatch_runs_under_the_transfer_guard(make_executor):
  d0, d1 = jax.devices()[:2]
  square = jax.jit(lambda a: a * a + 1.0)
  x = jax.device_put(np.arange(4, dtype=np.float32), d0)
  out = {}

  def explicit():
    out["y"] = jax.device_put(square(x), d1)  # explicit move to the consumer's device
    return out["y"]

  def implicit():
    return square(np.arange(4, dtype=np.float32))  # an implicit host-to-device transfer

  ex, done, _ = make_executor()
  ex.submit(fwd(0), explicit)
  ex.submit(fwd(1), implicit)
  good, bad = collect(done, 2)
  assert good.error is None
  assert out["y"].devices() == {d1}
  np.testing.assert_array_equal(np.asarray(out["y"]), [1.0, 2.0, 5.0, 10.0])
  assert bad.task == fwd(1)
  assert bad.error is not None and "Disallowed host-to-device transfer" in str(bad.error)


def test_stages_overlap(make_executor):
  done = queue.SimpleQueue()
  t0 = time.perf_counter()
  executors = [make_executor(stage_id=s, t0=t0, done=done)[0] for s in range(3)]
  for s, ex in enumerate(executors):
    ex.submit(fwd(0, stage_id=s), work(wait_s=0.2))
  completions = collect(done, 3)
  assert sorted(c.task.stage_id for c in completions) == [0, 1, 2]
  # Three 0.2 s tasks on three stages run side by side: 0.2 s in all, not 0.6 s.
  assert max(c.end_s for c in completions) - min(c.start_s for c in completions) <= 0.2 + SLACK_S
  assert max(c.start_s for c in completions) < min(c.end_s for c in completions)


def test_close_finishes_queued_tasks_then_stops_the_thread(make_executor):
  ex, done, _ = make_executor(stage_id=7)
  assert stage_thread_alive(7)
  for p in range(3):
    ex.submit(fwd(p, stage_id=7), work(wait_s=0.02))
  ex.close()
  assert not stage_thread_alive(7)
  completions = [done.get_nowait() for _ in range(3)]
  assert [c.task for c in completions] == [fwd(p, stage_id=7) for p in range(3)]
  assert done.empty()


def test_emulated_device_timeline_ignores_late_pickups(make_executor):
  # Each task's real work (10 ms inside the dispatch call) starts only when the executor picks it up, after the
  # previous task's end was posted (late by the sleep's wake-up and the hand-off); the emulated device still runs
  # the queued tasks back to back, as a GPU's queue would: task k ends at submission + (k + 1) d, exactly.
  ex, done, _ = make_executor()
  d = 0.03
  for p in range(4):
    ex.submit(fwd(p), work(dispatch_s=0.01), duration_s=d)
  completions = collect(done, 4)
  first = completions[0].submit_s
  for k, c in enumerate(completions):
    assert c.device_end_s == pytest.approx(first + (k + 1) * d, abs=EPS_S)
    assert c.device_end_s <= c.end_s
    assert c.overrun_s == 0.0


def test_an_overrun_moves_the_emulated_device_timeline(make_executor):
  # Task 0's real work (0.1 s) outlasts its 0.02 s: it ends on the device when its output is ready, and task 1
  # starts there, so task 1 (no real work) is padded to its full duration and is no overrun.
  ex, done, _ = make_executor()
  ex.submit(fwd(0), work(wait_s=0.1), duration_s=0.02)
  ex.submit(fwd(1), work(), duration_s=0.05)
  late, after = collect(done, 2)
  assert late.overrun_s >= 0.08 - EPS_S
  assert late.device_end_s == pytest.approx(late.start_s + 0.02 + late.overrun_s, abs=EPS_S)
  assert after.start_s == late.device_end_s
  assert after.overrun_s == 0.0
  assert after.device_end_s == pytest.approx(late.device_end_s + 0.05, abs=EPS_S)
  assert after.end_s >= after.device_end_s


def test_an_emulated_task_after_a_plain_one_starts_when_it_ended(make_executor):
  ex, done, _ = make_executor()
  ex.submit(fwd(0), work(wait_s=0.05))  # not emulated: its device is busy until its output is ready
  ex.submit(fwd(1), work(), duration_s=0.03)
  plain, emulated = collect(done, 2)
  assert plain.device_end_s == plain.end_s
  assert emulated.start_s >= plain.device_end_s  # no overlap on the device
  assert emulated.device_end_s == pytest.approx(emulated.start_s + 0.03, abs=EPS_S)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux thread attribute")
def test_executor_threads_sleep_with_a_fine_timer_slack(make_executor):
  # Linux lets a thread's sleeps end up to its timer slack late (50 µs by default): the executor sets its own to
  # 1 ns so an emulated 2 ms task is not reported 50 µs late; other threads keep theirs.
  get_slack = lambda: ctypes.CDLL(None).prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)  # noqa: E731
  seen = {}

  def dispatch():
    seen["slack_ns"] = get_slack()
    return SleepMarker()

  before = get_slack()
  ex, done, _ = make_executor()
  ex.submit(fwd(0), dispatch, duration_s=0.002)
  (c,) = collect(done, 1)
  assert c.error is None
  assert seen["slack_ns"] == 1
  assert get_slack() == before  # the calling thread's slack is untouched


def test_clock_pair_keeps_the_tightest_bracketed_reading(monkeypatch):
  """Ranks share one run clock through a ``(perf_counter, time())`` pair. A reading whose two ``perf_counter`` reads
  lie far apart (the thread was descheduled in between) is not used: the pair is the midpoint of the tightest
  bracket and its ``time()``."""
  from hetpipe_jax.runtime import stage_executor
  # five readings (perf before, unix, perf after): gaps 5 ms, 0.2 ms, 3 ms, 0.01 ms, 1 ms
  perf = iter([0.0, 0.005, 1.0, 1.0002, 2.0, 2.003, 3.0, 3.00001, 4.0, 4.001])
  unix = iter([100.004, 101.0001, 102.002, 103.000005, 104.0005])
  fake = type("FakeTime", (), {"perf_counter": staticmethod(lambda: next(perf)),
                               "time": staticmethod(lambda: next(unix))})
  monkeypatch.setattr(stage_executor, "time", fake)
  p, u = stage_executor.clock_pair()
  assert p == pytest.approx(3.000005, abs=1e-12) and u == 103.000005
  monkeypatch.undo()
  # the real clocks: the pair maps one onto the other within a millisecond
  p, u = stage_executor.clock_pair()
  later_perf, later_unix = time.perf_counter(), time.time()
  assert abs((later_unix - u) - (later_perf - p)) < 1e-3
