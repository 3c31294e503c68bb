"""One in-order worker thread per pipeline stage: the host side of a device queue.

Runtime layer. The VW's scheduler (main thread) decides *what* runs and in which order (``schedule`` rules); a
:class:`StageExecutor` runs each submitted task's dispatch on its own thread, waits until the task's output has
reached its consumer, optionally pads the task to an emulated duration ("sleep after the real work", for devices
that stand in for a slower GPU type), and reports the completion on a shared queue. Stages therefore overlap even
where XLA executes a computation inline in the calling thread (small computations on the CPU backend), and the
scheduler blocks on completions instead of polling.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import jax

from hetpipe_jax.rules.schedule import Task

OVERRUN_TOLERANCE_S = 1e-3  # lateness beyond an emulated task's end that counts as an overrun


@dataclasses.dataclass
class Completion:
  """A finished task: its stage-relative start and end times (seconds since the run's start)."""

  task: Task
  start_s: float
  end_s: float
  overrun_s: float = 0.0  # real work beyond the emulated duration (0 when not emulated or on time)
  dispatch_s: float = 0.0  # time inside the dispatch call (Python + launch; on CPU small kernels run inline)
  error: BaseException | None = None


class StageExecutor:
  """Runs one stage's tasks in submission order on a dedicated thread.

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
      duration_s: emulated duration; the completion is reported no earlier than start + duration.
    """
    self._tasks.put((task, dispatch, duration_s))

  def close(self) -> None:
    self._tasks.put(None)
    self._thread.join()

  def _loop(self) -> None:
    with jax.transfer_guard("disallow"):
      while True:
        item = self._tasks.get()
        if item is None:
          return
        task, dispatch, duration_s = item
        start = time.perf_counter()
        try:
          marker = dispatch()
          dispatched = time.perf_counter()
          marker.block_until_ready()
        except BaseException as e:  # reported to the scheduler, which re-raises it
          self._done.put(Completion(task, start - self._t0, time.perf_counter() - self._t0, error=e))
          return
        overrun = 0.0
        if duration_s is not None:
          target = start + duration_s
          now = time.perf_counter()
          if now < target:
            time.sleep(target - now)
          else:
            overrun = now - target
        self._done.put(Completion(task, start - self._t0, time.perf_counter() - self._t0, overrun,
                                  dispatch_s=dispatched - start))
