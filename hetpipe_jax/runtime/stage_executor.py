"""One in-order worker thread per pipeline stage: the host side of a device queue.

Runtime layer. The VW's scheduler (main thread) decides *what* runs and in which order (``schedule`` rules); a
:class:`StageExecutor` runs each submitted task's dispatch on its own thread, waits until the task's output has
reached its consumer, optionally pads the task to an emulated duration ("sleep after the real work", for devices
that stand in for a slower GPU type), and reports the completion on a shared queue. Stages therefore overlap even
where XLA executes a computation inline in the calling thread (small computations on the CPU backend), and the
scheduler blocks on completions instead of polling.

Emulated devices keep their own timeline, as an in-order device queue would: a task starts on its device when it
was submitted and the stage's previous task has ended there (``max(submission, previous device end)``), and ends
there at ``max(start + duration, when its real output was ready)``. The host's delays in noticing an end (the
sleep's wake-up, the executor thread getting the GIL back, posting) therefore do not push the stage's later tasks
back: only what the scheduler really waits for (a completion before it can submit the successor) costs time, as
on a GPU, where the host enqueues work asynchronously and the device runs it back to back.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import jax

from hetpipe_jax.host_timers import fine_timer_slack  # noqa: F401  (re-exported: stage ranks, benchmarks)
from hetpipe_jax.rules.schedule import Task

OVERRUN_TOLERANCE_S = 1e-3  # lateness beyond an emulated task's end that counts as an overrun


def clock_pair(tries: int = 5) -> tuple[float, float]:
  """``(time.perf_counter(), time.time())`` read as close to one instant as this thread can: the pair of the
  ``tries`` readings whose ``perf_counter`` reads bracket ``time()`` most tightly, seconds.

  Ranks that share one run clock (the driver's start in Unix seconds, each rank's ``perf_counter`` offset from it)
  need the pair read together: a rank descheduled between two plain reads (8 ranks on 2 cores) would shift every
  time it records by that pause, and a task could appear to start before the task it consumes ended.
  """
  best = None
  for _ in range(tries):
    a = time.perf_counter()
    unix = time.time()
    b = time.perf_counter()
    if best is None or b - a < best[0]:
      best = (b - a, 0.5 * (a + b), unix)
  return best[1], best[2]


@dataclasses.dataclass
class Completion:
  """A finished task: its stage-relative start and end times (seconds since the run's start)."""

  task: Task
  start_s: float  # emulated: the start on the emulated device, max(submit_s, previous task's device_end_s); else
  # when the executor began the dispatch call
  end_s: float  # when the executor posted the completion (the scheduler observes the task done from then on)
  overrun_s: float = 0.0  # real work beyond the emulated duration (0 when not emulated or on time)
  dispatch_s: float = 0.0  # time inside the dispatch call (Python + launch; on CPU small kernels run inline)
  error: BaseException | None = None
  submit_s: float = 0.0  # when the scheduler submitted the task
  device_end_s: float = 0.0  # emulated: the end on the emulated device, max(start + duration, output ready) <=
  # end_s; else end_s. The executor's lateness in reporting the end is end_s - device_end_s.
  loss: float | None = None  # stage ranks: a remote last stage's FB reports its minibatch's loss with its completion


class StageExecutor:
  """Runs one stage's tasks in submission order on a dedicated thread (the host side of the stage's device queue).

  Args:
    stage_id: the stage.
    done: the queue on which every :class:`Completion` is posted (shared by the VW's stages).
    t0: ``time.perf_counter()`` of the run's start.
  """

  def __init__(self, stage_id: int, done: queue.SimpleQueue, t0: float):
    self.stage_id = stage_id
    self._done = done
    self._t0 = t0
    self._tasks: queue.SimpleQueue = queue.SimpleQueue()
    self._thread = threading.Thread(target=self._loop, name=f"stage-{stage_id}", daemon=True)
    self._thread.start()

  def submit(self, task: Task, dispatch: Callable[[], Any], duration_s: float | None = None) -> None:
    """Queues ``task``; ``dispatch()`` launches it and returns an array that is ready once its output arrived.

    Args:
      duration_s: emulated duration; the task starts on the emulated device at ``max(now, the previous task's
        device end)`` and its completion is reported no earlier than that start plus ``duration_s``.
    """
    self._tasks.put((task, dispatch, duration_s, time.perf_counter()))

  def close(self) -> None:
    self._tasks.put(None)
    self._thread.join()

  def _loop(self) -> None:
    fine_timer_slack()
    t0 = self._t0
    device_free = 0.0  # perf_counter time at which the emulated device finished its previous task
    with jax.transfer_guard("disallow"):
      while True:
        item = self._tasks.get()
        if item is None:
          return
        task, dispatch, duration_s, submitted = item
        picked = time.perf_counter()
        try:
          marker = dispatch()
          dispatched = time.perf_counter()
          marker.block_until_ready()
        except BaseException as e:  # reported to the scheduler, which re-raises it
          now = time.perf_counter()
          self._done.put(Completion(task, picked - t0, now - t0, error=e, submit_s=submitted - t0,
                                    device_end_s=now - t0))
          return
        overrun = 0.0
        if duration_s is None:
          start = picked
          end = device_end = device_free = time.perf_counter()
        else:
          ready = time.perf_counter()
          start = submitted if submitted > device_free else device_free
          device_end = start + duration_s
          if ready < device_end:
            time.sleep(device_end - ready)  # sleep() resumes after signals; it never returns early
          else:
            overrun = ready - device_end
            device_end = ready
          device_free = device_end
          end = time.perf_counter()
        self._done.put(Completion(task, start - t0, end - t0, overrun, dispatch_s=dispatched - picked,
                                  submit_s=submitted - t0, device_end_s=device_end - t0))
