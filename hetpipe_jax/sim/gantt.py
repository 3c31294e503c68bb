"""Gantt chart of a pipelined run, one panel per virtual worker, in the style of HetPipe Figure 1.

Plotting tool (matplotlib, Agg backend; no jax): one row per GPU (stage 0 on top), forward tasks, backward tasks
and the last stage's forward+backward in distinct colours, each labelled with its minibatch number; dashed lines
at wave ends (the completion of a wave's last minibatch, when the VW pushes); WSP waits (injection blocked by the
staleness bound, HetPipe §5) shaded. Works on :class:`engine_report.TaskEvent` lists from the engine or from the
runtime (``trace.runtime_events``).
"""

from __future__ import annotations

import os
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=g-import-not-at-top
from matplotlib.patches import Patch  # noqa: E402  pylint: disable=g-import-not-at-top

from hetpipe_jax.sim.engine_report import EngineReport, TaskEvent  # noqa: E402

COLORS = {"F": "#6baed6", "B": "#fd8d3c", "FB": "#74c476"}
LABELS = {"F": "forward", "B": "backward", "FB": "forward+backward (last stage)"}
WAIT_COLOR = "#bdbdbd"


def _kind(e: TaskEvent) -> str:
  return e.task[len(str(e.stage_id)):len(e.task) - len(str(e.minibatch_id))]


def plot_gantt(task_events: Sequence[TaskEvent], path: str, *, ps_waits: Sequence[tuple[int, float, float]] = (),
               num_inflight: int | None = None, gpu_ids: Sequence[Sequence[str]] | None = None,
               vw_ids: Sequence[int] | None = None, time_window_s: tuple[float, float] | None = None,
               title: str | None = None, time_unit: str = "ms") -> None:
  """Draws the chart and writes a PNG.

  Args:
    task_events: tasks of one or more VWs.
    path: output PNG path (parent folders are created).
    ps_waits: ``(vw_id, start_s, end_s)`` WSP waits to shade.
    num_inflight: Nm, to mark wave ends (each wave's last minibatch completing on stage 0); None: no marks.
    gpu_ids: per VW, per stage, the GPU name for the row labels.
    vw_ids: which VWs to draw (default: all, at most 8).
    time_window_s: ``(start, end)`` to draw (default: everything).
    title: figure title.
    time_unit: ``"ms"`` or ``"s"`` on the x axis.

  Raises:
    ValueError: no task events, or an unknown time unit.
  """
  if not task_events:
    raise ValueError("no task events to draw (run the engine with records=True)")
  scale = {"ms": 1e3, "s": 1.0}.get(time_unit)
  if scale is None:
    raise ValueError(f"time_unit must be 'ms' or 's', got {time_unit!r}")
  if vw_ids is None:
    vw_ids = sorted({e.vw_id for e in task_events})[:8]
  lo, hi = time_window_s if time_window_s is not None else (min(e.start_s for e in task_events),
                                                             max(e.end_s for e in task_events))
  by_vw = {v: [e for e in task_events if e.vw_id == v and e.end_s > lo and e.start_s < hi] for v in vw_ids}
  num_stages = {v: 1 + max((e.stage_id for e in task_events if e.vw_id == v), default=0) for v in vw_ids}
  height = sum(0.5 * num_stages[v] + 0.9 for v in vw_ids) + 0.6
  fig, axes = plt.subplots(len(vw_ids), 1, figsize=(14, height), squeeze=False, sharex=True,
                           gridspec_kw={"height_ratios": [num_stages[v] + 1 for v in vw_ids]})
  span = (hi - lo) * scale
  for ax, v in zip(axes[:, 0], vw_ids):
    s_count = num_stages[v]
    for _, start, end in (w for w in ps_waits if w[0] == v and w[2] > lo and w[1] < hi):
      ax.axvspan(start * scale, end * scale, color=WAIT_COLOR, alpha=0.45, hatch="//", lw=0, zorder=0)
    for e in by_vw[v]:
      kind = _kind(e)
      x, w = e.start_s * scale, (e.end_s - e.start_s) * scale
      y = s_count - 1 - e.stage_id
      ax.barh(y, w, left=x, height=0.8, color=COLORS.get(kind, "#999999"), edgecolor="black", linewidth=0.5,
              zorder=2)
      if w > span / 160:
        mid = (max(x, lo * scale) + min(x + w, hi * scale)) / 2  # centre of the visible part
        ax.text(mid, y, str(e.minibatch_id), ha="center", va="center", zorder=3, clip_on=True,
                fontsize=8 if w > span / 60 else 6)
    if num_inflight is not None:
      for e in by_vw[v]:
        if e.stage_id == 0 and _kind(e) in ("B", "FB") and (e.minibatch_id + 1) % num_inflight == 0:
          x = e.end_s * scale
          near_right = x > lo * scale + 0.9 * span
          ax.axvline(x, color="crimson", ls="--", lw=1.0, zorder=4)
          ax.text(x, s_count - 0.45, f" wave {e.minibatch_id // num_inflight} ends ", color="crimson", fontsize=7,
                  va="bottom", ha="right" if near_right else "left", zorder=4, clip_on=True)
    names = [f"stage {s}" + (f" ({gpu_ids[v][s]})" if gpu_ids is not None else "") for s in range(s_count)]
    ax.set_yticks(range(s_count))
    ax.set_yticklabels(list(reversed(names)), fontsize=8)
    ax.set_ylim(-0.6, s_count - 0.4 + 0.5)
    ax.set_title(f"VW {v}", loc="left", fontsize=10, fontweight="bold")
    ax.grid(axis="x", ls=":", lw=0.5, zorder=0)
    ax.set_xlim(lo * scale, hi * scale)
  axes[-1, 0].set_xlabel(f"time ({time_unit})")
  handles = [Patch(facecolor=COLORS[k], edgecolor="black", label=LABELS[k]) for k in ("F", "B", "FB")]
  if ps_waits:
    handles.append(Patch(facecolor=WAIT_COLOR, alpha=0.45, hatch="//", label="WSP wait (blocked by bound D)"))
  if num_inflight is not None:
    handles.append(plt.Line2D([], [], color="crimson", ls="--", label="wave end (push)"))
  fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / height))
  fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False,
             bbox_to_anchor=(0.5, 1 - 0.45 / height))
  if title:
    fig.suptitle(title, y=1 - 0.05 / height, fontsize=11, va="top")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def plot_report(report: EngineReport, path: str, **kwargs) -> None:
  """:func:`plot_gantt` of an engine run made with ``records=True`` (its tasks, WSP waits, Nm and GPU names)."""
  by_vw: dict[int, list[str]] = {}
  for g in report.gpus:
    by_vw.setdefault(g.vw_id, []).append(g.gpu_id)
  kwargs.setdefault("gpu_ids", [by_vw[v] for v in sorted(by_vw)])
  kwargs.setdefault("num_inflight", report.config["num_inflight"])
  plot_gantt(report.task_events, path, ps_waits=report.ps_waits, **kwargs)
