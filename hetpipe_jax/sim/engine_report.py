"""What an event-engine run reports: throughput, utilisation, WSP waits, clock distance, records (HetPipe §8).

Simulation layer: standard library only. Built by :mod:`hetpipe_jax.sim.engine`; rendered as JSON (:meth:`to_dict`)
and as a text table (:func:`format_table`). Minibatch records are :class:`hetpipe_jax.rules.records.MinibatchRecord`, as in the
runtime, so one checker serves the runtime's ``minibatches.jsonl`` and the engine's records.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from typing import Any, Sequence

from hetpipe_jax.rules.records import MinibatchRecord


@dataclasses.dataclass(frozen=True)
class TaskEvent:
  """One task run: ``task`` prints as ``2F0``; ``[start_s, end_s)`` in seconds (virtual, or the runtime's wall
  time); ``wave_id`` None when unknown."""

  vw_id: int
  task: str
  stage_id: int
  minibatch_id: int
  wave_id: int | None
  start_s: float
  end_s: float


@dataclasses.dataclass
class VWReport:
  """One virtual worker.

  Attributes:
    minibatches_per_s: steady state: ``(num_waves - 1) * Nm`` minibatches between the completion of its first and
      its last wave (NaN with a single wave).
    minibatches_per_s_plain: all its minibatches over its last completion time (includes the pipeline fill).
    wait_s: seconds a minibatch could have been injected under the local rule but WSP's bound refused it (as
      ``pipeline.VWStats.wait_s``).
    idle_s: seconds with no task running or ready on any of its stages (as ``pipeline.VWStats.idle_s``).
    peak_inflight_per_stage: most minibatches each stage held (``PipelineRules.peak_held``).
  """

  vw_id: int
  num_minibatches: int
  minibatches_per_s: float
  minibatches_per_s_plain: float
  first_wave_end_s: float
  last_completion_s: float
  wait_s: float
  idle_s: float
  num_pushes: int
  num_pulls: int
  peak_inflight_per_stage: list[int]


@dataclasses.dataclass
class GPUReport:
  """One GPU (= one stage of one VW): busy seconds and utilisation over the run's makespan."""

  vw_id: int
  stage_id: int
  gpu_id: str
  num_tasks: int
  busy_s: float
  utilization: float


@dataclasses.dataclass
class EngineReport:
  """A whole engine run.

  Attributes:
    config: the engine configuration (dict).
    makespan_s: virtual time of the last minibatch completion.
    total_minibatches_per_s: steady state: completions of all VWs inside the window where every VW is past its
      first wave and none has finished, over the window's length (the plain rate when the window is empty).
    total_minibatches_per_s_plain: all minibatches over the makespan.
    steady_window_s: ``(start, end)`` of that window.
    vws, gpus: per VW and per GPU.
    final_global_clock: the PS's global clock after every push arrived.
    max_clock_distance: largest ``max - min`` local clock ever (WSP bounds it by D + 1).
    clock_distance_samples: ``(time_s, clock_distance, min_local_clock, max_local_clock)`` at every local-clock change.
    ps_applied: ``(wave, vw)`` in the PS's application order (records mode only).
    ps_waits: ``(vw_id, start_s, end_s)`` intervals blocked by the WSP bound (records mode only).
    minibatch_records, task_events: records mode only (empty in timing-only mode).
    num_events: events the engine processed; engine_wall_s: host seconds it took.
    nic_busy_s: per node, ``(send, receive)`` seconds its NIC carried inter-node transfers (``shared_nic``; empty
      when no transfer crossed nodes or the rule is off; :mod:`hetpipe_jax.rules.network`).
  """

  config: dict[str, Any]
  makespan_s: float
  total_minibatches_per_s: float
  total_minibatches_per_s_plain: float
  steady_window_s: tuple[float, float]
  vws: list[VWReport]
  gpus: list[GPUReport]
  final_global_clock: int
  max_clock_distance: int
  clock_distance_samples: list[tuple[float, int, int, int]]
  ps_applied: list[tuple[int, int]]
  ps_waits: list[tuple[int, float, float]]
  minibatch_records: list[MinibatchRecord]
  task_events: list[TaskEvent]
  num_events: int
  engine_wall_s: float
  nic_busy_s: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

  def to_dict(self, include_records: bool = True) -> dict[str, Any]:
    """JSON-ready dict (NaN becomes None); ``include_records=False`` drops the per-minibatch/per-task lists."""
    d = dataclasses.asdict(self)
    if not include_records:
      for k in ("minibatch_records", "task_events", "ps_applied", "clock_distance_samples"):
        d.pop(k)
    return json_safe(d)


def json_safe(x):
  """NaN / Inf become None (recursively) so the output is strict JSON."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_safe(v) for v in x]
  return x


def print_json(result, output: str | None = None) -> str:
  """Prints ``result`` as indented strict JSON (:func:`json_safe`), also writing it to ``output`` when given (the
  ending of the experiment scripts); returns the text."""
  text = json.dumps(json_safe(result), indent=2)
  if output:
    with open(output, "w", encoding="utf-8") as f:
      f.write(text)
  print(text)
  return text


def steady_rates(completion_times: Sequence[Sequence[float]], num_inflight: int, warmup_waves: int = 1
                 ) -> tuple[list[float], float, tuple[float, float]]:
  """Steady-state rates from every VW's minibatch completion times: the one steady-state rule (engine and runtime).

  Each VW's first ``warmup_waves`` waves (``warmup_waves * num_inflight`` minibatches) are the warm-up; its steady
  state runs from the end of its warm-up (the completion of minibatch ``warmup_waves * num_inflight - 1``) to its
  last completion. The common window runs from the latest warm-up end to the earliest last completion.

  Args:
    completion_times: per VW, its completion times in seconds, sorted, on one clock shared by all VWs.
    num_inflight: Nm (minibatches per wave).
    warmup_waves: waves per VW left out (>= 1; 1, the engine report's: the window starts at the end of the first
      wave).

  Returns:
    ``(per-VW minibatches/s after its warm-up, total minibatches/s of all VWs' completions inside the common window,
    (window start, window end))``. A per-VW rate is NaN when no minibatch is left after its warm-up; the total is NaN
    when the window is empty (``(nan, nan)`` when some VW has fewer than ``warmup_waves`` waves).

  Raises:
    ValueError: ``warmup_waves < 1``.
  """
  if warmup_waves < 1:
    raise ValueError(f"warmup_waves must be >= 1, got {warmup_waves}")
  k = warmup_waves * num_inflight
  per_vw = []
  for times in completion_times:
    n = len(times) - k
    per_vw.append(n / (times[-1] - times[k - 1]) if n > 0 and times[-1] > times[k - 1] else float("nan"))
  if any(len(t) < k for t in completion_times):
    return per_vw, float("nan"), (float("nan"), float("nan"))
  start = max(t[k - 1] for t in completion_times)
  end = min(t[-1] for t in completion_times)
  if end <= start:
    return per_vw, float("nan"), (start, end)
  count = sum(bisect.bisect_right(t, end) - bisect.bisect_right(t, start) for t in completion_times)
  return per_vw, count / (end - start), (start, end)


def format_table(report: EngineReport) -> str:
  """Per VW minibatches/s, wait and idle; per GPU utilisation; totals."""
  lines = [f"{'VW':>3} {'mb/s steady':>11} {'mb/s plain':>10} {'wait s':>9} {'idle s':>9} {'pushes':>6} "
           f"{'pulls':>6}  peak held per stage"]
  for v in report.vws:
    lines.append(f"{v.vw_id:>3} {v.minibatches_per_s:>11.3f} {v.minibatches_per_s_plain:>10.3f} {v.wait_s:>9.3f} "
                 f"{v.idle_s:>9.3f} {v.num_pushes:>6} {v.num_pulls:>6}  {v.peak_inflight_per_stage}")
  lines.append(f"{'VW':>3} {'stage':>5} {'GPU':<10} {'tasks':>7} {'busy s':>10} {'util':>6}")
  for g in report.gpus:
    lines.append(f"{g.vw_id:>3} {g.stage_id:>5} {g.gpu_id:<10} {g.num_tasks:>7} {g.busy_s:>10.3f} "
                 f"{100 * g.utilization:>5.1f}%")
  lines.append(f"total: {report.total_minibatches_per_s:.3f} minibatches/s steady (window "
               f"{report.steady_window_s[0]:.3f}-{report.steady_window_s[1]:.3f} s), "
               f"{report.total_minibatches_per_s_plain:.3f} plain; makespan {report.makespan_s:.3f} s; global clock "
               f"{report.final_global_clock}; max clock distance {report.max_clock_distance}; "
               f"{report.num_events} events in {report.engine_wall_s:.2f} s")
  return "\n".join(lines)
