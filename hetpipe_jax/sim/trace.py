"""Chrome-trace JSON of pipeline runs (opens in Perfetto / chrome://tracing), from the engine or the runtime.

Simulation layer: standard library only. One process per virtual worker (``pid`` = ``vw_id``), one thread per stage
(``tid`` = ``stage_id``, named after its GPU) and one extra thread for WSP waits; every task is a complete event
(``"ph": "X"``) named by kind and minibatch (``"F3"``, ``"B3"``, ``"FB3"``) with the wave in ``args``; the clock
distance between VWs is a counter on a ``PS`` process. Times are in microseconds, as the format requires.

Both sources are first turned into :class:`engine_report.TaskEvent` lists: the engine's report has them; the
runtime's ``VirtualWorker.task_log`` is converted by :func:`runtime_events`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

from hetpipe_jax.rules.schedule import Task
from hetpipe_jax.sim.engine_report import EngineReport, TaskEvent

US_PER_S = 1e6
_CATEGORY = {"F": "forward", "B": "backward", "FB": "forward_backward"}


def runtime_events(task_log: Iterable[tuple[str, float, float]], vw_id: int,
                   num_inflight: int | None = None) -> list[TaskEvent]:
  """Task events from a runtime ``VirtualWorker.task_log``.

  Args:
    task_log: ``(task, start_s, end_s)`` per task in completion order (seconds since the VW's start): on emulated
      devices the task's span on the emulated device's timeline, else from the executor's dispatch to the
      completion it posted (``runtime.stage_executor.Completion``).
      Dispatch is not start: a stage is one in-order device, so a task starts at
      ``max(dispatch, previous task's end on that stage)``. (A log that already holds start times is unchanged.)
    vw_id: the VW the log belongs to.
    num_inflight: Nm, to give each task its wave (``minibatch_id // Nm``); None leaves ``wave_id`` None.

  Returns:
    Per task, in log order, a :class:`TaskEvent`.

  Raises:
    ValueError: an unparsable task or a task that ends before it was dispatched.
  """
  prev_end: dict[int, float] = {}
  out = []
  for text, dispatch_s, done_s in task_log:
    task = Task.parse(text)
    if done_s < dispatch_s:
      raise ValueError(f"[VW {vw_id}] task {text} observed done at {done_s} s before its dispatch at {dispatch_s} s")
    start = max(dispatch_s, prev_end.get(task.stage_id, dispatch_s))
    prev_end[task.stage_id] = done_s
    wave = None if num_inflight is None else task.minibatch_id // num_inflight
    out.append(TaskEvent(vw_id, str(task), task.stage_id, task.minibatch_id, wave, start, done_s))
  return out


def _kind(event: TaskEvent) -> str:
  return event.task[len(str(event.stage_id)):len(event.task) - len(str(event.minibatch_id))]


def chrome_trace(task_events: Sequence[TaskEvent], ps_waits: Sequence[tuple[int, float, float]] = (),
                 clock_distance_samples: Sequence[tuple] = (),
                 gpu_ids: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
  """The trace dict (``{"traceEvents": [...], "displayTimeUnit": "ms"}``).

  Args:
    task_events: tasks of any number of VWs.
    ps_waits: ``(vw_id, start_s, end_s)`` intervals a VW was blocked by the WSP bound.
    clock_distance_samples: ``(time_s, clock_distance, ...)`` (the engine's samples).
    gpu_ids: per VW, per stage, a GPU name for the thread names.
  """
  events: list[dict[str, Any]] = []
  stages: dict[int, set[int]] = {}
  for e in task_events:
    stages.setdefault(e.vw_id, set()).add(e.stage_id)
    kind = _kind(e)
    events.append({"name": f"{kind}{e.minibatch_id}", "cat": _CATEGORY.get(kind, kind), "ph": "X",
                   "ts": e.start_s * US_PER_S, "dur": (e.end_s - e.start_s) * US_PER_S, "pid": e.vw_id,
                   "tid": e.stage_id, "args": {"task": e.task, "minibatch": e.minibatch_id, "wave": e.wave_id}})
  for v in {w[0] for w in ps_waits}:
    stages.setdefault(v, set())
  wait_tid = {v: max(s, default=-1) + 1 for v, s in stages.items()}
  for v, start, end in ps_waits:
    events.append({"name": "WSP wait", "cat": "ps_wait", "ph": "X", "ts": start * US_PER_S,
                   "dur": (end - start) * US_PER_S, "pid": v, "tid": wait_tid[v], "args": {}})
  meta = []
  for v in sorted(stages):
    meta.append({"name": "process_name", "ph": "M", "pid": v, "tid": 0, "args": {"name": f"VW {v}"}})
    meta.append({"name": "process_sort_index", "ph": "M", "pid": v, "tid": 0, "args": {"sort_index": v}})
    for s in sorted(stages[v]):
      gpu = f" ({gpu_ids[v][s]})" if gpu_ids is not None else ""
      meta.append({"name": "thread_name", "ph": "M", "pid": v, "tid": s, "args": {"name": f"stage {s}{gpu}"}})
      meta.append({"name": "thread_sort_index", "ph": "M", "pid": v, "tid": s, "args": {"sort_index": s}})
    meta.append({"name": "thread_name", "ph": "M", "pid": v, "tid": wait_tid[v], "args": {"name": "WSP wait"}})
  if clock_distance_samples:
    ps_pid = max(stages, default=-1) + 1
    meta.append({"name": "process_name", "ph": "M", "pid": ps_pid, "tid": 0, "args": {"name": "PS"}})
    for sample in clock_distance_samples:
      events.append({"name": "clock distance", "ph": "C", "ts": sample[0] * US_PER_S, "pid": ps_pid, "tid": 0,
                     "args": {"distance": sample[1]}})
  return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def report_trace(report: EngineReport, gpu_ids: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
  """The trace of an engine run made with ``records=True`` (tasks, WSP waits, clock distance)."""
  if gpu_ids is None:
    by_vw: dict[int, list[str]] = {}
    for g in report.gpus:
      by_vw.setdefault(g.vw_id, []).append(g.gpu_id)
    gpu_ids = [by_vw[v] for v in sorted(by_vw)]
  return chrome_trace(report.task_events, report.ps_waits, report.clock_distance_samples, gpu_ids)


def write_trace(trace: dict[str, Any], path: str) -> None:
  """Writes ``trace`` as compact JSON (creating parent folders)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(trace, f, separators=(",", ":"))
