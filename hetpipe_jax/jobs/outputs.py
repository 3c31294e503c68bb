"""The outputs of one training run, written the same way by the MPI job and the virtual-time job.

Runtime layer (json, orbax through :mod:`hetpipe_jax.jobs.checkpoint`, matplotlib for ``metrics.png``). One
:class:`RunOutputs` per run owns its workdir:

* ``config.json``: the config as it ran (:func:`hetpipe_jax.jobs.job_config.resolved_config`: every plan-decided setting
  replaced by the value that ran, and where it came from);
* ``metrics.jsonl``: one line per logged global-clock tick (loss, test accuracy when evaluated, times, rates);
* ``minibatches.jsonl``: every minibatch's :class:`hetpipe_jax.rules.records.MinibatchRecord`;
* ``ps_applied.jsonl``: the parameter server's wave applications in order (``wave_id``, ``vw_id``): the arrival
  order under ``ps_apply="on_receipt"``; with ``minibatches.jsonl``'s vector clocks it replays the run;
* ``summary.json``: the run's results and the settings that ran (the application list only as a count and a check);
* ``metrics.png``: loss and test accuracy against time and minibatches;
* ``checkpoint/``: the final global weights (orbax).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from hetpipe_jax.jobs import checkpoint
from hetpipe_jax.jobs.job_config import ConfigError, config_to_json
from hetpipe_jax.rules import records as records_lib
from hetpipe_jax.sim import trace
from hetpipe_jax.sim.engine_report import json_safe

FINISHED_MARKERS = ("summary.json", "checkpoint")


class ReplicasDivergedError(RuntimeError):
  """The data-parallel replicas of an all-reduce run ended with different weights (they must be identical)."""


def weights_sha256(flat: Any) -> str:
  """SHA-256 (hex) of flat float32 weights in the layer-ordered layout (little-endian bytes): config.json's
  ``initial_weights_sha256`` and summary.json's replica digests."""
  return hashlib.sha256(np.ascontiguousarray(flat, dtype="<f4").tobytes()).hexdigest()


def check_replicas_identical(digests: Mapping[int, str], workdir: str | pathlib.Path) -> None:
  """Raises :class:`ReplicasDivergedError` unless every VW's final weights have the same digest (all-reduce runs:
  every replica applies the same update, so any difference is a bug).

  Args:
    digests: per VW, :func:`weights_sha256` of its final weights.
    workdir: the run's directory (named in the error; its outputs are written first).
  """
  groups: dict[str, list[int]] = {}
  for v, d in sorted(digests.items()):
    groups.setdefault(d, []).append(int(v))
  if len(groups) > 1:
    shown = "; ".join(f"VWs {vws} {d[:12]}" for d, vws in groups.items())
    raise ReplicasDivergedError(f"the data-parallel replicas' final weights differ ({shown}): every replica must "
                                f"apply the same update; the run's outputs in {workdir} are not a valid result")


def check_workdir(workdir: str | pathlib.Path) -> None:
  """Raises :class:`ConfigError` when ``workdir`` already holds a finished run (nothing is ever overwritten) or
  cannot be written (it is created if missing)."""
  out = pathlib.Path(workdir)
  if any((out / name).exists() for name in FINISHED_MARKERS):
    raise ConfigError(f"--workdir={workdir} already holds a finished run; choose a new --workdir")
  try:  # before any work: a workdir that cannot be written fails now, not at the first checkpoint
    out.mkdir(parents=True, exist_ok=True)
    probe = out / f".write_probe_{os.getpid()}"
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    raise ConfigError(f"--workdir={workdir} cannot be written ({e.strerror or e}); choose a writable --workdir") from None


def applied_in_order(applied: Sequence[Sequence[int]], num_virtual_workers: int) -> bool:
  """True when every VW's waves appear once each, in wave order (0, 1, 2, ...), and every VW has as many (§5).

  Holds under both ``ps_apply`` modes; :func:`applied_clock_aligned` is the stricter order of ``clock_aligned``.
  """
  per_vw: list[list[int]] = [[] for _ in range(num_virtual_workers)]
  for wave, vw in applied:
    if not 0 <= vw < num_virtual_workers:
      return False
    per_vw[vw].append(int(wave))
  return all(waves == list(range(len(per_vw[0]))) for waves in per_vw)


def applied_clock_aligned(applied: Sequence[Sequence[int]], num_virtual_workers: int) -> bool:
  """True when ``applied`` is ``(wave 0, VW 0..N-1), (wave 1, VW 0..N-1), ...`` (``ps_apply="clock_aligned"``)."""
  return [tuple(a) for a in applied] == [(w, v) for w in range(len(applied) // max(num_virtual_workers, 1))
                                         for v in range(num_virtual_workers)]


class RunOutputs:
  """Writes one run's files (module docstring) into ``workdir``, creating it.

  Args:
    workdir: the run's directory; must not hold a finished run.

  Raises:
    ConfigError: ``workdir`` holds a finished run.
  """

  def __init__(self, workdir: str | pathlib.Path):
    check_workdir(workdir)
    self.dir = pathlib.Path(workdir)
    self.dir.mkdir(parents=True, exist_ok=True)
    self._metrics = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")

  def write_config(self, resolved: Mapping[str, Any]) -> None:
    """Writes ``config.json`` (the config as it runs)."""
    (self.dir / "config.json").write_text(config_to_json(resolved))

  def log_metrics(self, line: Mapping[str, Any]) -> None:
    """Appends one line to ``metrics.jsonl`` (flushed, so a crash keeps what was logged)."""
    self._metrics.write(json.dumps(json_safe(dict(line))) + "\n")
    self._metrics.flush()

  def write_minibatches(self, records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Writes ``minibatches.jsonl``, sorted by (VW, minibatch); returns the summary's extra-update statistics
    (:func:`hetpipe_jax.rules.records.extra_update_stats`)."""
    rows = sorted((dict(r) for r in records), key=lambda r: (r["vw_id"], r["minibatch_id"]))
    for r in rows:  # per-stage versions exist for PipeDream only (every stage uses one version otherwise)
      for key in ("stage_versions", "example_ids"):  # example ids: whenever data ran
        if r.get(key, 0) is None:
          del r[key]
    with open(self.dir / "minibatches.jsonl", "w", encoding="utf-8") as f:
      for r in rows:
        f.write(json.dumps(json_safe(r)) + "\n")
    return {"extra_updates": records_lib.extra_update_stats(rows)}

  def write_ps_applied(self, applied: Sequence[Sequence[int]], num_virtual_workers: int,
                       shard_logs: Sequence[Sequence[Sequence[int]]] | None = None,
                       staleness: Sequence[Sequence[float]] | None = None) -> dict[str, Any]:
    """Writes ``ps_applied.jsonl``; returns the summary fields: the count, whether each VW's waves were applied once
    each in order, and whether the whole order is clock-aligned.

    ``staleness`` (one PS, ``ps_staleness_scaling`` other than ``"none"``): per entry of ``applied`` its
    ``(tau, scale)`` (:class:`hetpipe_jax.rules.wsp.ParameterServerState`), written as the lines' ``tau`` and
    ``scale``; the summary gets their mean and maximum.

    With sharded parameter servers (``shard_logs``: per shard its application order; ``applied`` is shard 0's) the
    lines carry a ``shard`` field, shard by shard, and the fields hold for every shard (count: per shard).
    """
    if shard_logs is not None and len(shard_logs) > 1:
      with open(self.dir / "ps_applied.jsonl", "w", encoding="utf-8") as f:
        for shard, log in enumerate(shard_logs):
          for wave, vw in log:
            f.write(json.dumps({"wave_id": int(wave), "vw_id": int(vw), "shard": shard}) + "\n")
      counts = {len(log) for log in shard_logs}
      return {"applied_waves_count": counts.pop() if len(counts) == 1 else -1,
              "applied_waves_in_order": all(applied_in_order(log, num_virtual_workers) for log in shard_logs),
              "applied_clock_aligned": all(applied_clock_aligned(log, num_virtual_workers) for log in shard_logs),
              "applied_waves_count_per_shard": [len(log) for log in shard_logs],
              "applied_waves_in_order_per_shard": [applied_in_order(log, num_virtual_workers) for log in shard_logs]}
    if staleness is not None and len(staleness) != len(applied):
      raise ValueError(f"{len(staleness)} staleness entries for {len(applied)} applied waves")
    with open(self.dir / "ps_applied.jsonl", "w", encoding="utf-8") as f:
      for i, (wave, vw) in enumerate(applied):
        line = {"wave_id": int(wave), "vw_id": int(vw)}
        if staleness is not None:
          line.update(tau=int(staleness[i][0]), scale=float(staleness[i][1]))
        f.write(json.dumps(line) + "\n")
    fields = {"applied_waves_count": len(applied),
              "applied_waves_in_order": applied_in_order(applied, num_virtual_workers),
              "applied_clock_aligned": applied_clock_aligned(applied, num_virtual_workers)}
    if staleness is not None:
      taus = [int(t) for t, _ in staleness]
      fields["ps_staleness"] = {"mean_tau": sum(taus) / max(len(taus), 1), "max_tau": max(taus, default=0),
                                "mean_scale": sum(float(x) for _, x in staleness) / max(len(staleness), 1)}
    return fields

  def save_checkpoint(self, layer_params: list[Any]) -> pathlib.Path:
    """Saves the final global weights in ``checkpoint/`` (orbax); returns its path."""
    return checkpoint.save_weights(self.dir / "checkpoint", layer_params)

  def finish(self, summary: Mapping[str, Any]) -> None:
    """Closes ``metrics.jsonl``, draws ``metrics.png`` from it, and writes ``summary.json`` (a finished run's last
    file)."""
    if not self._metrics.closed:
      self._metrics.close()
    plot_metrics(self.dir / "metrics.jsonl", self.dir / "metrics.png")
    (self.dir / "summary.json").write_text(json.dumps(json_safe(dict(summary)), indent=2))


def held_out_metric(lines: list[dict]) -> tuple[str, str]:
  """``(key, label)`` of the held-out metric that metrics lines carry: bits per byte (language models) or accuracy."""
  if any(r.get("test_bits_per_byte") is not None for r in lines):
    return "test_bits_per_byte", "held-out bits per byte"
  return "test_accuracy", "test accuracy"


def plot_metrics(metrics_path: str | pathlib.Path, png_path: str | pathlib.Path) -> pathlib.Path | None:
  """Draws training loss and the held-out metric against time and against minibatches from ``metrics.jsonl``.

  Time is ``wall_time_s`` (MPI runs) or ``simulated_time_s`` (virtual time), whichever the lines carry. The held-out
  metric is ``test_bits_per_byte`` when the evaluations carry it (language models), else ``test_accuracy``.

  Returns:
    The PNG's path, or None when the file has no lines to plot.
  """
  lines = [json.loads(t) for t in pathlib.Path(metrics_path).read_text().splitlines() if t.strip()]
  if not lines:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  time_key = "simulated_time_s" if any("simulated_time_s" in r for r in lines) else "wall_time_s"
  time_label = "simulated seconds" if time_key == "simulated_time_s" else "wall-clock seconds"
  fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharey="row")
  held_out = held_out_metric(lines)
  for row, (key, label) in enumerate((("loss", "training loss"), held_out)):
    pts = [r for r in lines if r.get(key) is not None and r.get(time_key) is not None and "minibatches" in r]
    for col, (xkey, xlabel) in enumerate(((time_key, time_label), ("minibatches", "minibatches (all VWs)"))):
      ax = axes[row][col]
      ax.plot([r[xkey] for r in pts], [r[key] for r in pts], marker="o" if key.startswith("test_") else None,
              markersize=3)
      ax.set_xlabel(xlabel)
      ax.set_ylabel(label)
      ax.grid(alpha=0.3)
  fig.suptitle(f"training loss and {held_out[1]}")
  fig.tight_layout()
  fig.savefig(png_path, dpi=90)
  plt.close(fig)
  return pathlib.Path(png_path)


def write_runtime_trace(reports: dict, num_inflight: int, out: pathlib.Path) -> None:
  """A runtime run's task trace (``config.save_task_trace``, both MPI jobs): ``tasks.jsonl``, a Chrome trace
  (Perfetto) and a Figure-1-style Gantt PNG of every VW's measured tasks (``reports``: per VW its report, whose
  ``tasks`` are ``(task name, start s, end s)``)."""
  from hetpipe_jax.sim import gantt  # matplotlib only when drawing
  events = []
  with open(out / "tasks.jsonl", "w", encoding="utf-8") as f:
    for vw in sorted(reports):
      for task, start_s, end_s in reports[vw]["tasks"]:
        f.write(json.dumps({"vw_id": vw, "task": task, "start_s": start_s, "end_s": end_s}) + "\n")
      events += trace.runtime_events(reports[vw]["tasks"], vw, num_inflight)
  trace.write_trace(trace.chrome_trace(events), str(out / "trace.json"))
  # About a second from the middle of the run (the first waves include JIT compilation).
  starts = sorted(e.start_s for e in events)
  start = starts[len(starts) // 2]
  end = min(max(e.end_s for e in events), start + 1.0)
  gantt.plot_gantt(events, str(out / "gantt.png"), num_inflight=num_inflight, time_window_s=(start, end),
                   title="runtime (wall time, middle of the run)")
