"""The VW's run loop on the host path: ready tasks start before the minibatch updates, the completion log (the
benchmark's instrumentation) and the task log follow each stage's emulated device timeline, and garbage
collections during a run leave older objects alone."""

import gc
import threading
import time

import pytest

from hetpipe_jax.rules import schedule
from hetpipe_jax.rules.schedule import Task
from hetpipe_jax.runtime import vw_driver
from hetpipe_jax.runtime.stage_executor import StageExecutor
from tests.pipeline_util import build_vw

TWO_STAGES = [(0, 2), (2, 4)]
THREE_STAGES = [(0, 1), (1, 3), (3, 4)]
FOUR_STAGES = [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_tasks_made_ready_start_before_the_minibatch_updates(synthetic_data_dir, monkeypatch):
  """When a completion the scheduler thread books makes a task ready, the task goes to its stage before the
  scheduler applies a minibatch's updates (inline compute on the CPU backend), even when both completions were taken
  off the queue together. Stage 0 is the slowest (emulated 6 ms tasks), so forwards queue behind its minibatch-ending
  backwards, and the scheduler thread is slow to come back (each PS poll takes 8 ms): such a forward's completion
  follows the backward's to the scheduler thread (a stage's completions are booked in order), which books both and
  must start the forward's successor before it applies the update."""
  submitted = set()

  class RecordingExecutor(StageExecutor):
    def submit(self, task, dispatch, duration_s=None):
      submitted.add(task)
      super().submit(task, dispatch, duration_s)

  class BookingLog(list):  # whether the scheduler (main) thread booked each task
    def __init__(self):
      super().__init__()
      self.on_scheduler = []

    def append(self, item):
      self.on_scheduler.append(threading.current_thread() is threading.main_thread())
      super().append(item)

  monkeypatch.setattr(vw_driver, "StageExecutor", RecordingExecutor)
  vw, *_ = build_vw(synthetic_data_dir, partition=THREE_STAGES, num_inflight=4)
  vw.task_time_s = lambda task: 0.006 if task.stage_id == 0 else 0.001
  vw.task_log = log = BookingLog()
  poll = vw.ps.poll_pull

  def slow_poll():
    time.sleep(0.008)
    return poll()

  vw.ps.poll_pull = slow_poll
  update = vw.complete_minibatch
  late, updates = [], 0

  def checked_update(mb, now):
    nonlocal updates
    updates += 1
    # Tasks this thread booked: it started their successors itself, before coming here.
    booked_here = [Task.parse(text) for (text, _, _), main in zip(list(log), list(log.on_scheduler)) if main]
    late.extend(succ for task in booked_here for succ in schedule.successors(task, 3) if succ not in submitted)
    update(mb, now)

  vw.complete_minibatch = checked_update
  vw.run(16)
  assert updates == 16
  assert not late, late
  # The case above happened: tasks that do not end a minibatch were booked by the scheduler thread.
  routed = [Task.parse(text) for (text, _, _), main in zip(log, log.on_scheduler) if main]
  assert any(not schedule.completes_minibatch(t) for t in routed), routed
  # ... and every stage's completions were booked in the order its device ran them (a forward that ended behind a
  # minibatch's last backward waited for it on the scheduler thread instead of being booked first).
  for st in range(3):
    starts = [start for text, start, _ in log if Task.parse(text).stage_id == st]
    assert starts == sorted(starts), st


def test_completion_log_and_task_log_follow_the_emulated_devices(synthetic_data_dir):
  target = {0: 0.004, 1: 0.008}  # seconds per task on stage 0 / stage 1
  vw, *_ = build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=2)
  vw.task_time_s = lambda task: target[task.stage_id]
  log = []
  stats = vw.run(8, completion_log=log)
  assert len(log) == stats.num_tasks == 8 * 3
  assert [str(c.task) for c, _, _ in log] == [text for text, _, _ in vw.task_log]
  ends = {}
  for (c, received, woke), (_, start, end) in zip(log, vw.task_log):
    assert isinstance(woke, bool) and c.error is None
    # The task log holds each task's span on its emulated device; the executor posts its end no earlier, and the
    # scheduler takes it off the queue after that.
    assert c.submit_s <= c.start_s == start
    assert start + target[c.task.stage_id] - 1e-9 <= end == c.device_end_s <= c.end_s <= received
    ends[c.task] = c.end_s
  for c, _, _ in log:  # a task is submitted only after its predecessor's end was posted
    for succ in schedule.successors(c.task, 2):
      assert next(d.submit_s for d, _, _ in log if d.task == succ) >= ends[c.task]
  for s in (0, 1):  # one in-order device per stage: back to back at most, never overlapping
    spans = [(c.start_s, c.device_end_s) for c, _, _ in log if c.task.stage_id == s]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
  # Every stage is local: a task that does not end its minibatch is booked on its executor's thread (it never wakes
  # the scheduler thread); a minibatch's last task goes to the scheduler, which blocked on the queue in between.
  assert not any(woke for c, _, woke in log if not schedule.completes_minibatch(c.task))
  assert any(woke for c, _, woke in log if schedule.completes_minibatch(c.task))
  record_ends = [r.complete_time_s for r in vw.records]
  assert record_ends == [c.end_s for c, _, _ in log if schedule.completes_minibatch(c.task)]


def test_a_hop_between_stages_does_not_wait_for_the_scheduler_thread(synthetic_data_dir):
  """A local stage's completion is booked on its executor's thread, which starts the tasks it made ready: while the
  scheduler thread is busy (here: slow minibatch updates), tasks still move from stage to stage."""
  warm, *_ = build_vw(synthetic_data_dir, partition=FOUR_STAGES, num_inflight=4)
  warm.run(4)  # compiles every stage function: the run below has 2 ms tasks throughout
  vw, *_ = build_vw(synthetic_data_dir, partition=FOUR_STAGES, num_inflight=4, stages=warm.stages)
  vw.task_time_s = lambda task: 0.002
  update = vw.complete_minibatch
  busy = []

  def slow_update(mb, now):  # the first update is slow: the other minibatches in flight have hops left to make
    t = time.perf_counter()
    if not busy:
      time.sleep(0.05)
    update(mb, now)
    busy.append((now, t, time.perf_counter()))

  vw.complete_minibatch = slow_update
  log = []
  vw.run(8, completion_log=log)
  # perf_counter - run time: each update starts after its minibatch's end (``now``), so the smallest difference
  # is the run's origin plus at most the quickest pick-up (well under the 1 ms margin below).
  origin = min(t - now for now, t, _ in busy)
  _, t, end = busy[0]
  window = (t - origin + 0.001, end - origin - 0.005)  # the first update's sleep, in run time
  inside = [c.task for c, _, _ in log if window[0] < c.submit_s < window[1]]
  # The three minibatches behind the first drain through stages 2, 1, 0 meanwhile (scheduler-driven hops: none).
  assert len(inside) >= 3, (inside, window)


def test_run_keeps_older_objects_out_of_garbage_collections(synthetic_data_dir):
  """During a run the objects that existed before it are frozen (a full collection over them would stop every
  stage thread for 0.1-0.3 s); they are unfrozen when the run returns or raises."""
  vw, *_ = build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=2)
  before = gc.get_freeze_count()
  during = []
  update = vw.complete_minibatch

  def counting_update(mb, now):
    during.append(gc.get_freeze_count())
    update(mb, now)

  vw.complete_minibatch = counting_update
  vw.run(4)
  assert len(during) == 4 and min(during) > before
  assert gc.get_freeze_count() == before

  dispatch = vw.dispatch

  def failing_dispatch(task, mb):
    if task.minibatch_id == 1:
      raise RuntimeError("device fell over")
    return dispatch(task, mb)

  vw.dispatch = failing_dispatch
  with pytest.raises(RuntimeError, match="device fell over"):
    vw.run(4)
  assert gc.get_freeze_count() == before
