"""The staleness study's results from its runs' records: quality at a fixed evaluation, the gaps to each row's
reference (seed-paired), time to target under the paper's timing, the issue's goals scored, the Markdown tables,
REPRODUCTION.md's claims and the plot (``experiments/staleness_study.py`` runs the grid and calls these).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

from experiments.paper import common
from experiments.staleness_grid import LOWER_IS_BETTER, Row, Task, VARIANTS
from experiments.staleness_why import ELSEWHERE, WHY
from hetpipe_jax.paths import REPO_ROOT

def time_to_target(curve, target: float, lower: bool) -> float | None:
  """Simulated seconds at which the held-out quality first reaches ``target`` (None: never), linearly
  interpolated between the evaluation before it and the first at or past it."""
  prev = None
  for _, t, q in curve:
    if (q <= target) if lower else (q >= target):
      if prev is None or prev[1] == q:
        return float(t)
      return float(prev[0] + (target - prev[1]) / (q - prev[1]) * (t - prev[0]))
    prev = (t, q)
  return None


def value_at(rec: dict, at: int) -> float | None:
  """A run's held-out quality: its final value (``at`` = 0, finished runs only), or its evaluation at ``at``
  minibatches (every VW together; the evaluation within half a wave of it), also of an unfinished run."""
  if not at:
    return rec.get("final") if rec.get("returncode") == 0 else None
  tol = 0.5 * rec["row"]["nm"] * rec["row"]["num_vws"] + 1e-9
  return next((q for mb, _, q in rec.get("curve", []) if abs(mb - at) <= tol), None)


def aggregate(tasks: dict, rows, records: dict, missing: dict, at: dict[str, int] | None = None) -> list[dict]:
  """One table row per grid row: quality mean ± sd over seeds and the gap to its reference (same method family,
  VWs and seeds; reference variant, Nm = 1, D = 0). ``at``: per task, the minibatch count whose evaluation is the
  quality (unfinished runs count when they reached it); absent or 0: each finished run's final value."""
  at = at or {}
  by_key = {}
  for r in rows:
    recs = [records.get(f"{r.key}.s{s}") for s in range(r.seeds)]
    ok = [x for x in recs if x and value_at(x, at.get(r.task, 0)) is not None]
    by_key[r.key] = (r, ok, recs)
  out = []
  for r in rows:
    _, ok, recs = by_key[r.key]
    task = tasks[r.task]
    point = at.get(r.task, 0)
    lower = LOWER_IS_BETTER[task.metric]
    vals = [value_at(x, point) for x in ok]
    q = common.stats(vals)
    ref_row = Row(r.group, r.task, "hetpipe" if r.method in ("hetpipe", "pipedream") else r.method,
                  VARIANTS[r.variant].reference, r.num_vws, 1, 0, r.seeds, r.timing)
    ref = by_key.get(ref_row.key)
    gap = None
    if ref and ref[1] and ok and ref_row.key != r.key:
      refq = {x["seed"]: value_at(x, point) for x in ref[1]}
      pairs = [(value_at(x, point), refq[x["seed"]]) for x in ok if x["seed"] in refq]
      if pairs:
        rel = [(a - b) / b if lower else (a - b) for a, b in pairs]
        gap = {"kind": "relative" if lower else "points", "per_seed": rel, **common.stats(rel)}
    finished = [x for x in ok if x.get("returncode") == 0]
    out.append({"key": r.key, "group": r.group, "task": r.task, "method": r.method, "variant": r.variant,
                "variant_label": VARIANTS[r.variant].label, "num_vws": r.num_vws, "nm": r.nm, "d": r.d,
                "seeds_requested": r.seeds, "seeds_run": len(ok), "seeds_finished": len(finished),
                "metric": task.metric, "quality": q, "per_seed": vals, "seeds": [x["seed"] for x in ok],
                "reference": ref_row.key if ref_row.key != r.key else None,
                "gap_to_reference": gap, "not_run": missing.get(r.key),
                "failed": [x["key"] for x in recs if x and x.get("returncode") not in (0, "partial")],
                "minibatches": point or (finished[0]["num_minibatches"] if finished else None),
                "minibatches_per_s": common.stats([x["minibatches_per_s"] for x in finished])})
  return out


def partial_record(task: Task, row: Row, seed: int, out: pathlib.Path) -> dict | None:
  """An unfinished run's record from its ``metrics.jsonl`` evaluations (``returncode`` "partial"), or None."""
  key = f"{row.key}.s{seed}"
  workdir, cmd_path = out / "runs" / key, out / "runs" / f"{key}.cmd"
  if not (workdir / "metrics.jsonl").exists() or not cmd_path.exists():
    return None
  curve = []
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    try:
      e = json.loads(line)
    except ValueError:
      continue  # a line being written
    if "test_accuracy" in e:
      q = e["test_loss"] / math.log(2) if task.metric == "test_bits_per_byte" else e["test_accuracy"]
      curve.append((e["minibatches"], e["simulated_time_s"], q))
  if not curve:
    return None
  return {"key": key, "row": dataclasses.asdict(row), "seed": seed, "command": cmd_path.read_text(),
          "returncode": "partial", "curve": curve, "num_minibatches": curve[-1][0]}


# The time-to-target groups (rows timed on the paper's cluster), in the order they are reported: per group the
# calibration its cluster is fitted on (experiments/paper/calibration*.py; label, description) and the proxy's
# optimizer. Each proxy family's uncompensated HetPipe is its variant that is its own reference (``sgd``,
# ``momentum``); the others of the group are its compensated ones.
_HOROVOD_FIT = ("Horovod cells", "roofline efficiency per GPU type fitted on the paper's Horovod Table 4 cells "
                                 "(experiments/paper/calibration.py)")
_HETPIPE_FIT = ("VGG-19's HetPipe cells", "roofline efficiency per GPU type fitted on the paper's VGG-19 HetPipe "
                                          "Table 4 cells (experiments/paper/calibration_hetpipe.py)")
PAPER_GROUPS = {
    "paper": (*_HOROVOD_FIT, "SGD"),
    "paper_hetpipe_fit": (*_HETPIPE_FIT, "SGD"),
    "paper_momentum": (*_HOROVOD_FIT, "momentum SGD"),
    "paper_momentum_hetpipe_fit": (*_HETPIPE_FIT, "momentum SGD"),
}


def paper_time_to_target(table: list[dict], records: dict, tasks: dict, group: str = "paper") -> dict:
  """Time to the proxy's target on the paper's cluster for the rows of ``group`` (a key of :data:`PAPER_GROUPS`):
  the highest multiple of 5% (at most 70%) every run of the group reaches. Each seed's time is compared with the same
  seed's of Horovod, 1F1B-flush and uncompensated HetPipe D = 0 (the group's variant that is its own reference) for
  the compensated HetPipe row with the least mean time."""
  runs = {t["key"]: [records[f"{t['key']}.s{s}"] for s in range(t["seeds_requested"])
                     if records.get(f"{t['key']}.s{s}", {}).get("returncode") in (0, "partial")]
          for t in table if t["task"] == "paper" and t["group"] == group}
  rows = [t for t in table if runs.get(t["key"])]
  if not rows:
    return {}
  best = min(max(q for _, _, q in x["curve"]) for rs in runs.values() for x in rs)
  target = round(min(0.7, math.floor(best / 0.05 + 1e-9) * 0.05), 4)
  per = {}
  for t in rows:
    tt = [time_to_target(x["curve"], target, False) for x in runs[t["key"]]]
    unfinished = sum(x["returncode"] != 0 for x in runs[t["key"]])
    per[t["key"]] = {"label": f"{t['method']} {t['variant_label']} Nm={t['nm']} D={t['d']}" + (
                         f" ({unfinished} run(s) unfinished: curve so far)" if unfinished else ""),
                     "method": t["method"],
                     "variant": t["variant"], "nm": t["nm"], "d": t["d"], "per_seed": tt, **common.stats(tt),
                     "seeds": [x["seed"] for x in runs[t["key"]]]}
  def plain(v):  # the group's uncompensated variant: its own reference
    return VARIANTS[v["variant"]].reference == v["variant"]

  comp = {k: v for k, v in per.items() if v["method"] == "hetpipe" and not plain(v) and v["mean"]}
  uncomp_d0 = next((v for v in per.values() if v["method"] == "hetpipe" and plain(v) and v["d"] == 0), None)
  best_comp = min(comp.items(), key=lambda kv: kv[1]["mean"]) if comp else None
  versus = []
  if best_comp:
    for name, other in (("Horovod", next((v for v in per.values() if v["method"] == "horovod"), None)),
                        ("1F1B-flush", next((v for v in per.values() if v["method"] == "1f1b_flush"), None)),
                        ("uncompensated HetPipe D=0", uncomp_d0)):
      if other is None:
        continue
      pairs = [(a, b) for a, b, sa, sb in zip(best_comp[1]["per_seed"], other["per_seed"], best_comp[1]["seeds"],
                                             other["seeds"]) if a is not None and b is not None and sa == sb]
      red = [1 - a / b for a, b in pairs]
      versus.append({"against": name, "time_reduction_per_seed": red, **common.stats(red),
                     "goal": 0.25, "met": bool(red) and float(np.mean(red)) >= 0.25})
  return {"target_accuracy": target, "per_row": per, "best_compensated": best_comp[0] if best_comp else None,
          "versus": versus, "group": group, "calibration": PAPER_GROUPS[group][1], "optimizer": PAPER_GROUPS[group][2]}


def _row(table, **kw):
  return next((t for t in table if all(t[k] == v for k, v in kw.items()) and t["seeds_run"]), None)


def _gap(g) -> str:
  if not g:
    return "n/a"
  return f"{100 * g['mean']:+.1f}%" if g["kind"] == "relative" else f"{100 * g['mean']:+.2f} points"


def goals(table: list[dict], paper: dict[str, dict]) -> list[dict]:
  """Issue 25's goals, each met or missed with the measured numbers (a goal without its rows: not measured).
  ``paper``: :func:`paper_time_to_target` per group of :data:`PAPER_GROUPS` that has rows (the SGD groups are
  reported also when they have none)."""
  out = []

  def fmt(t):
    q = t["quality"]
    return f"{q['mean']:.3f} ± {q['std']:.3f} ({q['n']} of {t['seeds_requested']} seeds, {t['minibatches']} minibatches)"

  for t in table:
    if t["group"] != "lm_in_vw" or t["nm"] == 1 or t["method"] != "hetpipe" or not t["seeds_run"]:
      continue
    ref = _row(table, key=t["reference"]) if t["reference"] else None
    g = t["gap_to_reference"]
    at_600 = t["minibatches"] == 600  # the absolute bound (today's Adam at Nm = 1) is for 600 minibatches
    met = bool(g and g["mean"] <= 0.02 and (not at_600 or t["quality"]["mean"] <= 3.14))
    out.append({"goal": f"LM in a VW: {t['variant_label']}, Nm={t['nm']}, 1 VW, D=0 within 2% of Nm=1 (and <= 3.14 "
                        "bits/byte at 600 minibatches)", "row": t["key"], "met": met,
                "measured": f"{fmt(t)} bits/byte; Nm=1 reference {fmt(ref) if ref else 'not run'}; gap "
                            f"{_gap(g)}"})
  for t in table:
    if t["group"] != "lm_cross_vw" or t["nm"] == 1 or not t["seeds_run"]:
      continue
    ref = _row(table, key=t["reference"]) if t["reference"] else None
    g = t["gap_to_reference"]
    out.append({"goal": f"LM across VWs: {t['variant_label']}, 2 VWs, Nm={t['nm']}, D={t['d']} within 3% of Nm=1, "
                        "D=0", "row": t["key"], "met": bool(g and g["mean"] <= 0.03),
                "measured": f"{fmt(t)} bits/byte; reference {fmt(ref) if ref else 'not run'}; gap "
                            f"{_gap(g)}"})
  for t in table:
    if t["group"] != "cnn" or (t["nm"], t["d"]) != (4, 4) or not t["seeds_run"]:
      continue
    ref = _row(table, key=t["reference"]) if t["reference"] else None
    g = t["gap_to_reference"]
    out.append({"goal": f"CNN: {t['method']} {t['variant_label']}, Nm=4, D=4 within 0.5 points of Nm=1, D=0 after "
                        "one epoch", "row": t["key"], "met": bool(g and g["mean"] >= -0.005),
                "measured": f"{fmt(t)} test accuracy; reference {fmt(ref) if ref else 'not run'}; gap "
                            f"{_gap(g)}"})
  for group, (cal, _, opt) in PAPER_GROUPS.items():
    p = paper.get(group, {})
    for v in p.get("versus", []):
      out.append({"goal": f"Time to target on the paper's cluster (VGG-19 timing, calibrated on {cal}, {opt} "
                          f"proxy): best compensated HetPipe >= 25% sooner than {v['against']}",
                  "row": p["best_compensated"],
                  "met": v["met"], "measured": f"time reduction {100 * v['mean']:+.1f}% ± {100 * v['std']:.1f} over "
                                               f"{v['n']} seeds (target {p['target_accuracy']:.0%})"})
      if any("unfinished" in x["label"] for x in p["per_row"].values()):
        out[-1].update(met=False, status=f"{'within' if v['met'] else 'outside'} the bound on unfinished runs' "
                                         f"curves (target {p['target_accuracy']:.0%}; trend, not shown met)")
  groups_measured = {t["group"] for t in table if t["seeds_run"]}
  if "lm_cross_vw" not in groups_measured:
    out.append({"goal": "LM across VWs: 2 VWs, Nm=2, D=1 within 3% of 2 VWs, Nm=1, D=0", "row": None, "met": False,
                "status": "not measured", "measured": "no run of the lm_cross_vw rows finished or reached an "
                "evaluation (compute: see the tables). Under MPI, not in this study (experiments/lm_check.py, "
                "docs/measurements/lm_fortunes.md, 1 run each): Muon at Nm=2, D=1 is 8.0% behind Muon at Nm=1, D=0 "
                "(2.617 against 2.424 bits/byte after 1,000 minibatches per VW), 4.9% with weight prediction: missed"})
  for group, (cal, _, opt) in PAPER_GROUPS.items():
    p = paper.get(group, {})
    if not p.get("versus") and (p or opt == "SGD"):
      done = sorted(v["label"] for v in p.get("per_row", {}).values())
      out.append({"goal": f"Time to target on the paper's cluster (VGG-19 timing, calibrated on {cal}, {opt} proxy): "
                          "best compensated HetPipe >= 25% sooner than Horovod, 1F1B-flush and uncompensated HetPipe "
                          "D=0",
                  "row": None, "met": False, "status": "not measured",
                  "measured": "the compensated HetPipe runs did not reach an evaluation; runs with a curve: "
                              + (", ".join(done) or "none")})
  for g, met, why in ELSEWHERE:
    out.append({"goal": g, "row": None, "met": bool(met), "measured": why,
                "status": "not measured" if met is None else "met elsewhere" if met else "missed elsewhere"})
  rows = {t["key"]: t for t in table}
  for g in out:
    t = rows.get(g["row"] or "")
    if t and "status" not in g:
      goal_point = {"lm": 600, "cnn": None}.get(t["task"])
      partial = (t["seeds_run"] < t["seeds_requested"] or t["seeds_finished"] < t["seeds_run"] or
                 (goal_point and t["minibatches"] != goal_point))
      if partial:  # measured short of the goal's point or seeds: a trend, never "met"
        g["status"] = (f"{'within' if g['met'] else 'outside'} the bound at {t['minibatches']} minibatches, "
                       f"{t['seeds_run']} of {t['seeds_requested']} seeds (trend; the goal is not shown met)")
        g["met"] = False
    g.setdefault("status", "met" if g["met"] else "missed")
    g["why"] = WHY.get(g["row"] or "", "")
  return out


def markdown(result: dict) -> str:
  lines = ["# Staleness and its remedies", "",
           "Held-out quality after a fixed number of minibatches (every VW together), mean ± sd over seeds; gap: "
           "against the Nm = 1, D = 0 run of the same method family, VWs, optimizer and seeds (LM: relative, "
           "positive = worse; accuracy: points). Virtual time: exact numerics; commands in the JSON."]
  if result.get("at_minibatches"):
    lines.append(f"Quality read at a fixed evaluation, not the end of the run: "
                 f"{', '.join(f'{k} at {v} minibatches' for k, v in result['at_minibatches'].items())}"
                 + (" (unfinished runs included where they reached it; seeds column: counted / requested)."
                    if result.get("partial") else "."))
  lines.append("")
  for task_name, task in result["tasks"].items():
    rows = [t for t in result["table"] if t["task"] == task_name]
    if not rows:
      continue
    unit = "bits/byte" if task["metric"] == "test_bits_per_byte" else "test accuracy"
    lines += [f"## {task['label']}", "", f"| group | method | variant | VWs | Nm | D | seeds | {unit} | per seed | "
              "gap to Nm=1, D=0 | minibatches |", "|---|---|---|---:|---:|---:|---|---|---|---|---:|"]
    for t in rows:
      q, g = t["quality"], t["gap_to_reference"]
      if not t["seeds_run"]:
        qs = f"not run: {t['not_run'] or ('failed ' + ', '.join(t['failed']) if t['failed'] else 'no finished run')}"
      else:
        qs = f"{q['mean']:.4f} ± {q['std']:.4f}"
      gs = ("reference" if t["reference"] is None else "n/a" if not g else
            f"{100 * g['mean']:+.1f}% ± {100 * g['std']:.1f}" if g["kind"] == "relative" else
            f"{100 * g['mean']:+.2f} ± {100 * g['std']:.2f} pts")
      lines.append(f"| {t['group']} | {t['method']} | {t['variant_label']} | {t['num_vws']} | {t['nm']} | {t['d']} | "
                   f"{t['seeds_run']}/{t['seeds_requested']} | {qs} | "
                   f"{', '.join(f'{x:.4f}' for x in t['per_seed'])} | {gs} | {t['minibatches'] or ''} |")
    lines.append("")
  for group, p in result.get("paper_time_to_target", {}).items():
    lines += [f"## Time to {p['target_accuracy']:.0%} test accuracy on the paper's cluster (simulated s), calibrated "
              f"on {PAPER_GROUPS[group][0]}, {PAPER_GROUPS[group][2]} proxy", "",
              f"Timing: VGG-19 plans on hetpipe_paper; cost model: {p['calibration']}.", "",
              "| config | time to target (s) | per seed |", "|---|---|---|"]
    for v in p["per_row"].values():
      lines.append(f"| {v['label']} | {_mean_sd(v)} | {', '.join('—' if x is None else f'{x:.1f}' for x in v['per_seed'])} |")
    lines.append("")
  lines += ["## Goals (issue 25)", "", "| goal | met | measured |", "|---|---|---|"]
  for g in result["goals"]:
    lines.append(f"| {g['goal']} | {g['status']} | {g['measured']} |")
  return "\n".join(lines) + "\n"


def _mean_sd(v: dict) -> str:
  return "not reached" if v["mean"] is None else f"{v['mean']:.1f} ± {v['std']:.1f}"


def paper_results(result: dict, png: pathlib.Path) -> dict:
  """The results file ``experiments/paper/reproduction.py`` renders as REPRODUCTION.md's section "Staleness and its
  remedies": one claim per goal (``paper``: the goal, ``ours``: what was measured), the table, the plot, and the
  time-to-target rows shown beside the uncompensated ones of Figures 5 and 6 (``beside``)."""
  claims = [{"claim": g["goal"], "paper": "(issue 25 goal)", "ours": g["measured"], "difference": g["status"],
             "why": g.get("why", ""), "command": result["rerun_command"], "calibrated": False}
            for g in result["goals"]]
  beside = []
  by_group = result.get("paper_time_to_target", {})
  for group in ("paper", "paper_momentum"):  # per proxy family: the Horovod fit's rows, the HetPipe fit beside
    p, fit = by_group.get(group), by_group.get(f"{group}_hetpipe_fit") or {}
    if not p:
      continue
    cmd = result["rerun_command"] + ("" if group == "paper" else
                                     f" --extensions --groups={group},{group}_hetpipe_fit")  # extension rows
    beside += [f"Beside them, from `{cmd}` (same timing, the proxy on {PAPER_GROUPS[group][2]}; "
               f"target {p['target_accuracy']:.0%}, {len(next(iter(p['per_row'].values()))['per_seed'])} seeds): "
               "time to the target in simulated seconds of the paper's cluster, mean ± sd, under the calibration on "
               f"the Horovod cells and (last column, target {fit.get('target_accuracy', 0):.0%}) on VGG-19's HetPipe "
               "cells (experiments/paper/calibration_hetpipe.py).", "",
               "| config (VGG-19 timing) | to target (s) | on the HetPipe fit (s) |", "|---|---|---|"]
    others = {(v["method"], v["variant"], v["nm"], v["d"]): v for v in fit.get("per_row", {}).values()}
    for v in p["per_row"].values():
      o = others.get((v["method"], v["variant"], v["nm"], v["d"]))
      beside.append(f"| {v['label']} | {_mean_sd(v)} | {_mean_sd(o) if o else 'not run'} |")
    beside.append("")
  beside = beside[:-1]  # no blank line after the last table
  try:
    shown = str(png.resolve().relative_to(REPO_ROOT))
  except ValueError:
    shown = str(png)
  return {"experiment": result["experiment"], "quick": result["quick"], "command": result["command"],
          "claims": claims, "markdown": result["markdown"], "png": shown, "beside": {"convergence": beside}}


def plot(result: dict, path: pathlib.Path) -> None:
  """Held-out quality against minibatches, one panel per task, one line per row (mean over seeds)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  tasks = [n for n in result["tasks"] if any(t["task"] == n and t["seeds_run"] for t in result["table"])]
  fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(6.5 * max(1, len(tasks)), 5), squeeze=False)
  for ax, name in zip(axes[0], tasks):
    for t in result["table"]:
      # against minibatches a row timed on the second calibration is the same curve as on the first: drawn once
      if t["task"] != name or not t["seeds_run"] or t["group"].endswith("_hetpipe_fit"):
        continue
      curves = [result["records"][f"{t['key']}.s{s}"]["curve"] for s in t["seeds"]]
      n = min(len(c) for c in curves)
      x = [c[0] for c in curves[0][:n]]
      y = np.mean([[p[2] for p in c[:n]] for c in curves], axis=0)
      ax.plot(x, y, marker="o", ms=3, lw=1.2, ls="-" if t["method"] == "hetpipe" else "--",
              label=f"{t['method']} {t['variant']} V{t['num_vws']} Nm{t['nm']} D{t['d']}")
    ax.set_title(result["tasks"][name]["label"], fontsize=9)
    ax.set_xlabel("minibatches (every VW together)")
    ax.set_ylabel("held-out bits/byte" if result["tasks"][name]["metric"] == "test_bits_per_byte" else
                  "test accuracy")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
