"""Engine validation: the event engine's predicted throughput against the real MPI runtime (HetPipe §8).

For each configuration (1-3 VWs, 2-4 stages, Nm 1-6, D 0-4, stage speed ratios up to 4x, homogeneous and
heterogeneous VWs) it runs

* the real job under MPI (``hetpipe_jax.train`` with ``tiny.py``: ``mlp_tiny`` whose real compute is negligible,
  every task padded to its emulated duration by ``config.emulate_stage_ms``), and reads ``minibatches.jsonl``;
* the event engine (:mod:`hetpipe_jax.sim.engine`) on the same task times (``task_times.uniform_task_times`` per VW,
  as ``emulation.emulated_task_times`` builds them), ``EngineConfig(num_waves=M/Nm, num_inflight=Nm,
  staleness_bound=D, pull_every_wave=True)``;

and compares steady-state minibatches/s. Run from the repo root:

  .venv/bin/python experiments/validate_engine.py [--quick | --smoke] [--output=validation.json] [--cases=a,b]

``--smoke`` (CI, seconds): one small 2-VW case, a few waves, no latency probe; still the real MPI job and the engine.

Steady state, one rule on both sides: ``engine_report.steady_rates(..., warmup_waves=w)``, the engine report's rule
with its one warm-up wave widened to ``w`` (:func:`case_warmup_waves`): ``--warmup_waves`` (3) for the runtime's
compile and start-up transient, plus ``2 (D + 1)`` where the bound throttles a VW (the run-ahead transient). The
total is all VWs' completions inside the common window (latest warm-up end to earliest last completion). That needs
one clock for all VWs: ``minibatches.jsonl`` has each VW's times since its own start, and ``summary.json`` has that
start on the machine clock (``per_vw[vw]["start_unix_s"]``, ``time.time()`` taken next to the VW's ``perf_counter``
origin), so a VW's completion on the common clock is its start plus its record time.

Methods (``Case.method``): two or more cases per method of :mod:`hetpipe_jax.rules.methods` besides HetPipe
(``--methods=...`` picks them): PipeDream (1F1B, per-stage updates, WSP), GPipe and 1F1B-flush (M micro-batches, the
stage times given per minibatch and split into M micro-batch tasks, all-reduce BSP across VWs, no PS rank) and
Horovod (one-stage VWs). The engine runs the same method (``EngineConfig.method``); the all-reduce methods' step-end
synchronisation (loss read-back, gradients to the host, ``Allreduce``, the update) gets the probe's PS round trip
as ``allreduce_s``.

Latency (``--latency``): a probe job (1 VW, 2 stages, Nm = 1, D = 0) measures the runtime's hand-off latency between
tasks and its push/PS/pull round trip (medians); the engine gets them as ``send_ms`` and ``push_ms`` / ``pull_ms``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Sequence

if str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:  # run as a file: find the package
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags, logging  # noqa: E402

from hetpipe_jax import flag_checks  # noqa: E402
from hetpipe_jax.costs import task_times  # noqa: E402
from hetpipe_jax.jobs.emulation import parse_stage_ms  # noqa: E402
from hetpipe_jax.paths import REPO_ROOT  # noqa: E402
from hetpipe_jax.rules import methods  # noqa: E402
from hetpipe_jax.sim import engine  # noqa: E402
from hetpipe_jax.sim import engine_report  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "Fewer minibatches per VW and 10 of the 12 cases (about 3 minutes).")
_SMOKE = flags.DEFINE_bool("smoke", False, "Seconds-long end-to-end check (CI): only the SMOKE case, a few waves, no "
                           "latency probe.")
_OUTPUT = flags.DEFINE_string("output", "", "Write the results as JSON here (also printed).")
_CASES = flags.DEFINE_list("cases", [], "Run only these case names (default: all).")
_WARMUP_WAVES = flags.DEFINE_integer("warmup_waves", 3, "Waves per VW excluded from the steady state (>= 1; more "
                                     "where the staleness bound throttles a VW, see case_warmup_waves).")
_LATENCY = flags.DEFINE_bool("latency", True, "Measure the runtime's hand-off and PS round-trip latency with a probe "
                             "job and pass them to the engine as send_ms and push_ms / pull_ms (else all are 0).")
_TOLERANCE = flags.DEFINE_float("tolerance_pct", 10.0, "A row passes when |error| <= this.")
_TIMEOUT_S = flags.DEFINE_integer("timeout_s", 180, "Wall-clock limit of one MPI run.")
_METHODS = flags.DEFINE_list("methods", [], "Run only the cases of these methods (default: every method).")
_RUNS_DIR = flags.DEFINE_string("runs_dir", "", "Where the runs' outputs go (default: a new /tmp/validate_* dir).")

_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
# tiny.py's batch size; a flush case whose M does not divide it runs the largest multiple of M below it (its tasks
# are emulated, so the batch size changes no time).
TINY_BATCH_SIZE = 32
_MPIEXEC = REPO_ROOT / ".venv" / "bin" / "mpiexec"


@dataclasses.dataclass(frozen=True)
class Case:
  """One validation configuration.

  Attributes:
    name: short id.
    num_vws: N virtual workers.
    num_stages: S stages per VW (the tiny MLP has 4 layers, so S <= 4; partition is even).
    stage_ms: ``config.emulate_stage_ms``: per-stage ms for every VW, or ``;``-separated per VW.
    num_inflight: Nm.
    staleness_bound: D.
    in_quick: also run with ``--quick`` (which keeps 10 cases that still span the ranges above).
    method: the training method (``num_inflight`` is M for gpipe, 1f1b_flush and horovod).
  """

  name: str
  num_vws: int
  num_stages: int
  stage_ms: str
  num_inflight: int
  staleness_bound: int
  in_quick: bool = True
  method: str = "hetpipe"

  @property
  def flush(self) -> bool:
    return methods.get_method(self.method).is_flush

  def vw_stage_ms(self) -> list[list[float]]:
    """Per VW, per stage ms of one task (as ``emulation.emulated_task_times`` builds them from
    ``config.emulate_stage_ms``: a minibatch's time, divided over its M micro-batches for the flush methods)."""
    rows = parse_stage_ms(self.stage_ms, self.num_vws, self.num_stages)
    if self.flush:
      rows = [[v / self.num_inflight for v in r] for r in rows]
    return rows


# Every non-last stage >= 60 ms, so its forward (a third) is >= 20 ms; last-stage F+B tasks are >= 60 ms. Stage
# speed ratios up to 4x inside a VW and across VWs. Where VWs differ in speed, either the bound couples them from the
# first waves (D <= 1) or they are never D waves apart in the run (the D >= 2 cases), so the steady state does not
# depend on the VWs' start phase, which the runtime's compile warm-up shifts and the engine cannot know.
CASES = (
    Case("1vw_2s_nm1_d0", 1, 2, "60,120", 1, 0),
    Case("1vw_2s_nm4_d0", 1, 2, "60,240", 4, 0),
    Case("1vw_3s_nm3_d0", 1, 3, "60,120,240", 3, 0, in_quick=False),
    Case("1vw_4s_nm4_d0", 1, 4, "60,60,120,240", 4, 0),
    Case("2vw_2s_het_nm2_d0", 2, 2, "60,120;120,240", 2, 0),
    Case("2vw_3s_nm3_d1", 2, 3, "60,120,60", 3, 1, in_quick=False),
    Case("2vw_4s_het_nm4_d1", 2, 4, "60,60,120,240;120,120,60,60", 4, 1),
    Case("2vw_2s_het_nm6_d2", 2, 2, "60,120;120,60", 6, 2),
    Case("2vw_2s_het_nm2_d4", 2, 2, "60,100;90,120", 2, 4),
    Case("3vw_2s_nm2_d1", 3, 2, "60,90", 2, 1),
    Case("3vw_2s_het_nm5_d3", 3, 2, "60,120;120,120;120,60", 5, 3),
    Case("3vw_3s_het_nm3_d0", 3, 3, "60,120,60;120,120,120;240,120,60", 3, 0),
)
# Two or more per method (same rules as above: tasks >= 10 ms; per-minibatch stage times for the flush methods).
METHOD_CASES = (
    Case("pd_1vw_3s_noam_d0", 1, 3, "60,120,60", 3, 0, method="pipedream", in_quick=False),
    Case("pd_2vw_2s_het_d1", 2, 2, "60,120;120,60", 2, 1, method="pipedream", in_quick=False),
    Case("gp_1vw_2s_m4", 1, 2, "120,240", 4, 0, method="gpipe", in_quick=False),
    Case("gp_2vw_3s_het_m3", 2, 3, "180,180,360;360,180,180", 3, 0, method="gpipe", in_quick=False),
    Case("1f1b_1vw_3s_m4", 1, 3, "120,120,240", 4, 0, method="1f1b_flush", in_quick=False),
    Case("1f1b_2vw_2s_m4", 2, 2, "120,240", 4, 0, method="1f1b_flush", in_quick=False),
    Case("hv_2vw_m1", 2, 1, "120;240", 1, 0, method="horovod", in_quick=False),
    Case("hv_3vw_m2", 3, 1, "120;120;180", 2, 0, method="horovod", in_quick=False),
)
CASES = CASES + METHOD_CASES
# ``--smoke``: two heterogeneous VWs (so the common clock matters), short tasks; not a validation point.
SMOKE = Case("smoke_2vw_het_nm2_d1", 2, 2, "20,40;40,20", 2, 1, in_quick=False)
# Run length per mode: (waves after the warm-up, least minibatches per VW).
LENGTHS = {"full": (6, 40), "quick": (3, 20), "smoke": (2, 4)}


# ------------------------------------------------------------------------------------------------ steady state
def completion_times_by_vw(records: Sequence[dict], num_vws: int, start_unix_s: Sequence[float] | None = None
                           ) -> list[list[float]]:
  """Per VW, its minibatches' completion times in minibatch order (records as in ``minibatches.jsonl``).

  Args:
    records: minibatch records (``vw_id``, ``minibatch_id``, ``complete_time_s`` in seconds since the VW's start).
    num_vws: N.
    start_unix_s: per VW, its start on the machine clock (``summary.json``'s ``per_vw[vw]["start_unix_s"]``): each
      VW's times are shifted by its start so all VWs share one axis, zero at the earliest start. None: unshifted.

  Raises:
    ValueError: a VW has no records, a minibatch is missing or has no completion time, or ``start_unix_s`` does not
      have one entry per VW.
  """
  if start_unix_s is None:
    start_unix_s = [0.0] * num_vws
  if len(start_unix_s) != num_vws:
    raise ValueError(f"start_unix_s has {len(start_unix_s)} entries for {num_vws} VWs")
  by_vw: list[dict[int, float]] = [{} for _ in range(num_vws)]
  for r in records:
    by_vw[int(r["vw_id"])][int(r["minibatch_id"])] = r["complete_time_s"]
  origin = min(start_unix_s)
  out = []
  for v, d in enumerate(by_vw):
    if not d or sorted(d) != list(range(len(d))):
      raise ValueError(f"VW {v}: minibatch ids are not 0..n-1 (got {len(d)} records)")
    times = [d[p] for p in range(len(d))]
    if any(t is None or not math.isfinite(t) for t in times):
      raise ValueError(f"VW {v}: a minibatch has no completion time")
    shift = start_unix_s[v] - origin
    out.append([t + shift for t in times])
  return out


def rates(completions: Sequence[Sequence[float]], num_inflight: int, warmup_waves: int) -> dict:
  """Per-VW and total steady minibatches/s of completions on one clock (``engine_report.steady_rates`` with
  ``warmup_waves``); the total falls back to the sum of the per-VW rates when the common window is empty."""
  per_vw, total, window = engine_report.steady_rates(completions, num_inflight, warmup_waves=warmup_waves)
  fallback = not math.isfinite(total)
  return {"per_vw_mb_per_s": per_vw, "total_mb_per_s": sum(per_vw) if fallback else total,
          "total_is_sum_of_per_vw": fallback, "steady_window_s": list(window)}


def error_pct(predicted: float, measured: float) -> float:
  """``100 * (measured - predicted) / predicted`` (positive: the runtime is faster than predicted)."""
  return 100.0 * (measured - predicted) / predicted


def num_minibatches(case: Case, length: str, warmup_waves: int) -> int:
  """Minibatches per VW: whole waves, at least ``warmup_waves + extra`` waves and ``least`` minibatches, with
  ``(extra, least) = LENGTHS[length]`` (``"full"``: 6, 40; ``"quick"``: 3, 20; ``"smoke"``: 2, 4)."""
  extra, least = LENGTHS[length]
  waves = max(warmup_waves + extra, -(-least // case.num_inflight))
  return waves * case.num_inflight


def case_warmup_waves(case: Case, base: int) -> int:
  """Waves excluded from ``case``'s steady state: ``base`` (compilation), plus ``2 (D + 1)`` when the staleness bound
  throttles a VW in the engine (a VW faster than the others runs ahead at its own rate until it is D + 1 waves
  ahead; in the runtime that run-ahead starts only after the compile warm-up, which holds the VWs in step, so it
  must be outside the window on both sides)."""
  probe = predict(case, num_minibatches(case, "full", base), base)
  return base + (2 * (case.staleness_bound + 1) if max(probe["wait_s"]) > 0 else 0)


# ------------------------------------------------------------------------------------------------ the two sides
def predict(case: Case, minibatches: int, warmup_waves: int, send_ms: float = 0.0, push_ms: float = 0.0,
            pull_ms: float = 0.0) -> dict:
  """The engine's prediction for ``case``: :func:`rates` of its virtual completion times (as :func:`measure`).

  ``minibatches``: the rules' (micro-)batches per VW (a multiple of Nm, or of M)."""
  times = [task_times.uniform_task_times(r, send_ms=send_ms, push_ms=push_ms, pull_ms=pull_ms)
           for r in case.vw_stage_ms()]
  if case.flush:  # no PS: the step-end synchronisation costs about the probe's PS round trip
    times = [dataclasses.replace(t, push_s=0.0, pull_s=0.0, allreduce_s=(push_ms + pull_ms) * 1e-3) for t in times]
  config = engine.EngineConfig(num_waves=minibatches // case.num_inflight, num_inflight=case.num_inflight,
                               staleness_bound=case.staleness_bound, pull_every_wave=True, method=case.method)
  report = engine.run(times, config)
  completions = completion_times_by_vw([dataclasses.asdict(r) for r in report.minibatch_records], case.num_vws)
  return {**rates(completions, case.num_inflight, warmup_waves),
          "engine_report_total_mb_per_s": report.total_minibatches_per_s,
          "engine_report_per_vw_mb_per_s": [v.minibatches_per_s for v in report.vws],
          "wait_s": [v.wait_s for v in report.vws], "makespan_s": report.makespan_s}


def run_job(case: Case, minibatches: int, data_dir: pathlib.Path, workdir: pathlib.Path, timeout_s: int,
            extra_flags: Sequence[str] = ()) -> tuple[list[dict], dict, float]:
  """Runs ``case`` as a real MPI job; returns ``(minibatches.jsonl records, summary.json, wall seconds)``.

  Raises:
    RuntimeError: the job failed (the message holds the tail of its output).
  """
  ranks = case.num_vws + (0 if case.flush else 1)  # the all-reduce methods have no PS rank
  # The job counts minibatches (a flush step is one minibatch of M micro-batches); the rules count micro-batches.
  job_minibatches = minibatches // case.num_inflight if case.flush else minibatches
  batch_flags = []
  if case.flush and TINY_BATCH_SIZE % case.num_inflight:  # M micro-batches must divide the minibatch: the largest
    batch_flags = [f"--config.batch_size={TINY_BATCH_SIZE // case.num_inflight * case.num_inflight}"]  # that does
  cmd = [str(_MPIEXEC), "-n", str(ranks), str(_PYTHON), "-m", "mpi4py", "-m", "hetpipe_jax.train",
         "--config=experiments/configs/tiny.py", f"--workdir={workdir}",
         f"--config.num_virtual_workers={case.num_vws}", f"--config.num_stages={case.num_stages}",
         "--config.partition=", f"--config.num_inflight={case.num_inflight}",
         f"--config.staleness_bound={case.staleness_bound}", f"--config.emulate_stage_ms={case.stage_ms}",
         f"--config.num_minibatches={job_minibatches}", "--config.progress=False", "--config.check_counts=False",
         f"--config.data_dir={data_dir}", f"--config.method={case.method}", *batch_flags, *extra_flags]
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
  wall = time.perf_counter() - t0
  if proc.returncode != 0:
    raise RuntimeError(f"case {case.name}: job exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
  with open(workdir / "minibatches.jsonl", encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  summary = json.loads((workdir / "summary.json").read_text())
  return records, summary, wall


def measure(case: Case, minibatches: int, warmup_waves: int, data_dir: pathlib.Path, workdir: pathlib.Path,
            timeout_s: int) -> dict:
  """The runtime's :func:`rates` for ``case`` on the VWs' common clock (the same rules as :func:`predict`)."""
  records, summary, wall = run_job(case, minibatches, data_dir, workdir, timeout_s)
  stats = summary["per_vw"]
  starts = [stats[str(v)]["start_unix_s"] for v in range(case.num_vws)]
  completions = completion_times_by_vw(records, case.num_vws, start_unix_s=starts)
  return {**rates(completions, case.num_inflight, warmup_waves), "job_wall_s": wall,
          "first_completion_skew_s": max(c[0] for c in completions) - min(c[0] for c in completions),
          "wait_s": [stats[str(v)]["wait_s"] for v in range(case.num_vws)],
          "num_overruns": [stats[str(v)]["num_overruns"] for v in range(case.num_vws)],
          "overrun_s": [stats[str(v)]["overrun_s"] for v in range(case.num_vws)]}


# ------------------------------------------------------------------------------------------------ latency probe
PROBE = Case("latency_probe", 1, 2, "60,60", 1, 0)
PROBE_MINIBATCHES = 30


def latency_from_probe(records: Sequence[dict], stage_ms: Sequence[float] = (60.0, 60.0), skip: int = 4) -> dict:
  """The runtime's latencies, in ms, from a 1-VW, 2-stage, Nm = 1, D = 0 run (:data:`PROBE`); medians, so that CPU
  stalls from other processes on the machine do not count.

  * A minibatch's inject-to-complete time exceeds its three tasks' emulated sum by the hand-offs between them
    (executor → scheduler → next stage's executor); the engine has this as a send on each of the two cuts, so
    ``send_ms`` is half the excess.
  * With Nm = 1 and D = 0 the next minibatch waits after each completion for the wave's push, the PS and the pull
    reply (and the update, the wave-end read-back, the rebase): the completion-to-next-injection gap, which the
    engine has as ``push_s + pull_s``; split evenly.

  Args:
    records: the probe's minibatch records, one VW.
    stage_ms: the probe's stage times.
    skip: leading minibatches left out (compilation).
  """
  records = sorted(records, key=lambda r: r["minibatch_id"])[skip:]
  busy = sorted(1e3 * (r["complete_time_s"] - r["inject_time_s"]) - sum(stage_ms) for r in records)
  gaps = sorted(1e3 * (b["inject_time_s"] - a["complete_time_s"]) for a, b in zip(records, records[1:]))
  median = lambda xs: xs[len(xs) // 2]  # noqa: E731
  handoff, round_trip = max(0.0, median(busy)), max(0.0, median(gaps))
  return {"handoff_excess_ms_median": handoff, "ps_round_trip_ms_median": round_trip,
          "ps_round_trip_ms_max": gaps[-1], "send_ms": handoff / 2, "push_ms": round_trip / 2,
          "pull_ms": round_trip / 2}


# ------------------------------------------------------------------------------------------------ main
def format_table(rows: Sequence[dict], tolerance_pct: float) -> str:
  """One line per case: Nm, D, stage ms, predicted and measured total minibatches/s, error %, per-VW errors."""
  lines = [f"{'case':<22} {'method':<10} {'N':>1} {'S':>1} {'Nm':>2} {'D':>1} {'stage ms':<34} {'M':>3} {'W':>2} "
           f"{'pred mb/s':>9} {'meas mb/s':>9} {'err %':>6}  per-VW err %"]
  for r in rows:
    c = r["case"]
    ok = "" if abs(r["error_pct"]) <= tolerance_pct else "  MISS"
    lines.append(f"{c['name']:<22} {c.get('method', 'hetpipe'):<10} {c['num_vws']:>1} {c['num_stages']:>1} "
                 f"{c['num_inflight']:>2} "
                 f"{c['staleness_bound']:>1} {c['stage_ms']:<34} {r['num_minibatches_per_vw']:>3} "
                 f"{r['warmup_waves']:>2} "
                 f"{r['predicted']['total_mb_per_s']:>9.3f} "
                 f"{r['measured']['total_mb_per_s']:>9.3f} {r['error_pct']:>+6.1f}  "
                 f"{' '.join(f'{e:+.1f}' for e in r['per_vw_error_pct'])}{ok}")
  return "\n".join(lines)


def main(argv):
  del argv
  from hetpipe_jax.data import synthetic
  wall0 = time.perf_counter()
  warmup = _WARMUP_WAVES.value
  root = pathlib.Path(_RUNS_DIR.value or tempfile.mkdtemp(prefix="validate_engine_", dir="/tmp"))
  root.mkdir(parents=True, exist_ok=True)
  data_dir = synthetic.write_synthetic_fashion_mnist(root / "data", 2048, 64)
  length = "smoke" if _SMOKE.value else "quick" if _QUICK.value else "full"
  if _SMOKE.value:  # only the SMOKE case, without the latency probe
    flag_checks.refuse_replaced("--smoke", ["cases", "methods", "quick", "latency"])
    cases = [SMOKE]
  else:
    cases = [c for c in CASES if (c.name in _CASES.value if _CASES.value else c.in_quick or not _QUICK.value)]
    if _METHODS.value:
      cases = [c for c in cases if c.method in _METHODS.value]
  unknown = set(_CASES.value) - {c.name for c in CASES}
  if unknown:
    raise app.UsageError(f"unknown --cases {sorted(unknown)}; known: {[c.name for c in CASES]}")
  latency = {"send_ms": 0.0, "push_ms": 0.0, "pull_ms": 0.0}
  if _LATENCY.value and not _SMOKE.value:
    records, _, _ = run_job(PROBE, PROBE_MINIBATCHES, data_dir, root / PROBE.name, _TIMEOUT_S.value)
    latency = latency_from_probe(records)
    logging.info("latency probe: %s", latency)
  rows = []
  for case in cases:
    w = case_warmup_waves(case, warmup)
    m = num_minibatches(case, length, w)
    predicted = predict(case, m, w, latency["send_ms"], latency["push_ms"], latency["pull_ms"])
    predicted["no_latency_total_mb_per_s"] = predict(case, m, w)["total_mb_per_s"]
    measured = measure(case, m, w, data_dir, root / case.name, _TIMEOUT_S.value)
    row = {"case": dataclasses.asdict(case), "num_minibatches_per_vw": m, "warmup_waves": w, "predicted": predicted,
           "measured": measured, "error_pct": error_pct(predicted["total_mb_per_s"], measured["total_mb_per_s"]),
           "per_vw_error_pct": [error_pct(p, q) for p, q in zip(predicted["per_vw_mb_per_s"],
                                                                 measured["per_vw_mb_per_s"])]}
    rows.append(row)
    logging.info("%s: predicted %.3f, measured %.3f mb/s (%+.1f%%), job %.1f s", case.name,
                 predicted["total_mb_per_s"], measured["total_mb_per_s"], row["error_pct"], measured["job_wall_s"])
  tol = _TOLERANCE.value
  result = {
      "mode": length, "quick": _QUICK.value, "warmup_waves": warmup, "tolerance_pct": tol, "latency": latency,
      "num_pass": sum(abs(r["error_pct"]) <= tol for r in rows), "num_cases": len(rows),
      "max_abs_error_pct": max(abs(r["error_pct"]) for r in rows),
      "total_wall_s": time.perf_counter() - wall0, "rows": rows,
  }
  print(format_table(rows, tol))
  print(f"{result['num_pass']}/{len(rows)} within ±{tol:g}%; max |error| {result['max_abs_error_pct']:.1f}%; "
        f"latency: send {latency['send_ms']:.2f} ms, push {latency['push_ms']:.2f} ms, "
        f"pull {latency['pull_ms']:.2f} ms; "
        f"total {result['total_wall_s']:.0f} s")
  engine_report.print_json(result, _OUTPUT.value)


if __name__ == "__main__":
  app.run(main)
