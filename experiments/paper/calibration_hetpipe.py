r"""The second calibration: one roofline efficiency per GPU type fitted on the paper's HetPipe cells of one model,
checked by predicting every other Table 4 cell.

  .venv/bin/python experiments/paper/calibration_hetpipe.py [--fit_model=vgg19_imagenet] [--quick] \
      [--results_dir=experiments/paper/results]

**Why a second one.** The first calibration (:mod:`experiments.paper.calibration`) fits the cost model on Table 4's
Horovod cells, and with it our engine predicts HetPipe's VGG-19 cells about 35-53% too slow (``table4.md``). A
conclusion about HetPipe's time to target (issue 25, :mod:`experiments.staleness_study`'s ``paper`` rows) that holds
only under that fit could be an artefact of it; this fit gives HetPipe the paper's own speed instead, and says what
that costs elsewhere.

**What is fitted, on which cells.** The same 4 numbers as the first calibration (one roofline efficiency per GPU
type; links, latencies, memory and the engine keep their defaults), on the 4 HetPipe ED-local cells of
``--fit_model`` in Table 4 (default VGG-19: 300, 530, 572, 606 images/s). Every other Table 4 cell (the other
model's HetPipe row, both Horovod rows) is a **prediction** at the fitted values.

**Fitting procedure** (:func:`fit`). Table 4's columns add one GPU type at a time (V, then R, Q, G). Walk them in
order; with the types fitted so far fixed, the new type's efficiency e is found by bisection on log e over
``[E_MIN, 1]`` such that the engine's HetPipe cell (:func:`experiments.paper.table4.hetpipe_cell`: ED, local PS
placement, D = 0, Nm chosen by the engine as the paper chooses it) reaches the paper's images/s. The engine's rate is
a step function of e (the planner's partitions and Nm change with it), so the fit is the smallest e (to
``BISECT_STEPS`` halvings of the log interval) whose rate reaches the paper's. When even e = 1 falls short, the type
is recorded at 1 with ``reached: false``: the cell then measures what our model cannot do at any efficiency, not a fit
error. When e = ``E_MIN`` already exceeds it, the type is recorded at ``E_MIN`` (``reached: false``).

Writes ``calibration_hetpipe.{json,md,png}``; :func:`calibrated_cluster` gives the fitted cluster to the timing plans
(:mod:`experiments.paper.timing_plans`, ``calibration="hetpipe"``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys

if str(pathlib.Path(__file__).resolve().parents[2]) not in sys.path:  # run as a file: find the package
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from absl import app, flags  # noqa: E402

from experiments.paper import calibration  # noqa: E402
from experiments.paper import common  # noqa: E402
from experiments.paper import paper_tables as pt  # noqa: E402
from experiments.paper import table4  # noqa: E402
from hetpipe_jax.costs.cluster import ClusterSpec  # noqa: E402

E_MIN = 0.05  # the bisection's lowest efficiency (the first calibration's values are 0.25-0.61)
BISECT_STEPS = 12  # halvings of log(1 / E_MIN) = 3.0: the fit's resolution in e is about 0.07%
FIT_MODEL = "vgg19_imagenet"


def hetpipe_images_per_s(cluster: ClusterSpec, profile, column: str, config, max_nm: int | None) -> float:
  """The engine's HetPipe ED-local images/s of Table 4 column ``column`` on ``cluster`` (restricted to the column's
  nodes), Nm chosen by the engine (:func:`experiments.paper.table4.hetpipe_cell`)."""
  sub = common.sub_cluster(cluster, pt.TABLE4_NODES[column])
  return table4.hetpipe_cell(sub, profile, column, config, max_nm).row.images_per_s


def _with(cluster: ClusterSpec, efficiency: dict[str, float]) -> ClusterSpec:
  return calibration.Calibration(dict(efficiency), [], list(efficiency)).apply(cluster)


def fit(cluster: ClusterSpec, profile, table: dict[str, float], config, columns=pt.TABLE4_COLUMNS,
        max_nm: int | None = None, steps: int = BISECT_STEPS) -> calibration.Calibration:
  """Fits one efficiency per GPU type on ``table`` (module docstring).

  Args:
    cluster: the paper's cluster (nodes named as Table 4's columns).
    profile: the fitted model's profile.
    table: Table 4 column -> the model's HetPipe images/s (the paper's, or rates made from known efficiencies).
    config: the engine settings (:func:`experiments.paper.common.compare_config`).
    columns: the columns to walk, in Table 4's order (each adds one node type).
    max_nm: the largest Nm the engine may choose (None: the smallest Max_m).
    steps: bisection halvings per type.

  Returns:
    The :class:`experiments.paper.calibration.Calibration`; each cell records the paper's and the fitted rate,
    whether the rate was reached, and the rates at the interval's ends.
  """
  eff: dict[str, float] = {}
  cells, order = [], []
  prev: tuple[str, ...] = ()
  for col in columns:
    nodes = pt.TABLE4_NODES[col]
    (new_node,) = [n for n in nodes if n not in prev]
    new_type = pt.NODE_TYPES[new_node]
    want = table[col]

    seen: dict[float, float] = {}  # e -> the engine's rate (each e is run once)

    def rate(e: float, t=new_type, c=col, seen=seen) -> float:
      if e not in seen:
        seen[e] = hetpipe_images_per_s(_with(cluster, {**eff, t: e}), profile, c, config, max_nm)
      return seen[e]

    lo, hi = math.log(E_MIN), 0.0
    r_lo, r_hi = rate(E_MIN), rate(1.0)
    if r_hi < want:
      e, reached = 1.0, False
    elif r_lo >= want:
      e, reached = E_MIN, False
    else:
      for _ in range(steps):  # invariant: rate(exp(lo)) < want <= rate(exp(hi))
        mid = (lo + hi) / 2
        if rate(math.exp(mid)) >= want:
          hi = mid
        else:
          lo = mid
      e, reached = math.exp(hi), True
    eff[new_type] = e
    order.append(new_type)
    cells.append({"model": profile.model, "column": col, "gpu_type": new_type, "paper_images_per_s": want,
                  "fitted_images_per_s": rate(e), "efficiency": e, "reached": reached,
                  "images_per_s_at_e_min": r_lo, "images_per_s_at_e_1": r_hi})
    prev = nodes
  return calibration.Calibration(eff, cells, order)


def paper_table(model: str) -> dict[str, float]:
  """Table 4's HetPipe ED-local row of ``model``: column -> images/s."""
  return {col: float(v) for col, v in pt.TABLE4_HETPIPE[model].items() if v is not None}


def saved_calibration(results_dir: str = common.RESULTS_DIR, model: str = FIT_MODEL) -> calibration.Calibration | None:
  """The fit :func:`run` saved in ``results_dir`` (``calibration_hetpipe.json``, full mode, on ``model``), or None."""
  path = pathlib.Path(results_dir) / "calibration_hetpipe.json"
  try:
    d = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  if d.get("quick") or d.get("fit_model") != model:
    return None
  return calibration.Calibration(dict(d["efficiency"]), list(d["cells"]), list(d["order"]))


def calibrated_cluster(cluster: ClusterSpec | None = None, model: str = FIT_MODEL, quick: bool = False,
                       refit: bool = True) -> tuple[ClusterSpec, calibration.Calibration]:
  """The paper cluster with the efficiencies fitted on ``model``'s HetPipe cells (``(cluster, calibration)``).

  ``refit`` False: the fit saved in the results directory (:func:`saved_calibration`; three minutes on 2 cores to
  redo) when there is one, else a new fit."""
  cluster = cluster or common.load_cluster()
  saved = None if refit or quick else saved_calibration(model=model)
  if saved is not None:
    return _with(cluster, saved.efficiency), saved
  cal = fit(cluster, common.load_profile(model), paper_table(model), common.compare_config(quick),
            pt.TABLE4_COLUMNS[:2] if quick else pt.TABLE4_COLUMNS, 3 if quick else None, 4 if quick else BISECT_STEPS)
  # quick: the types no column fitted keep the cluster file's efficiency
  full = {n: cal.efficiency.get(n, t.roofline_efficiency) for n, t in cluster.gpu_types.items()}
  return _with(cluster, full), dataclasses.replace(cal, efficiency=full)


def run(results_dir: str, quick: bool, fit_model: str = FIT_MODEL) -> str:
  """Fits on ``fit_model``'s HetPipe cells, predicts every other Table 4 cell, writes the results; returns the JSON
  path."""
  if fit_model not in pt.MODELS:
    raise ValueError(f"--fit_model={fit_model!r}: one of {', '.join(pt.MODELS)}")
  base = common.load_cluster()
  fitted, cal = calibrated_cluster(base, fit_model, quick)
  first, first_cal = calibration.calibrate(base)
  config = common.compare_config(quick)
  columns = pt.TABLE4_COLUMNS[:2] if quick else pt.TABLE4_COLUMNS
  cmd = common.command("calibration_hetpipe") + ("" if fit_model == FIT_MODEL else f" --fit_model={fit_model}")
  rows, claims = [], []
  for model in pt.MODELS:
    profile = common.load_profile(model)
    for col in columns:
      gpus = calibration.horovod_gpus(base, pt.TABLE4_NODES[col])
      cells = {"hetpipe": (pt.TABLE4_HETPIPE[model][col],
                           hetpipe_images_per_s(fitted, profile, col, config, 3 if quick else None),
                           hetpipe_images_per_s(first, profile, col, config, 3 if quick else None)),
               "horovod": (pt.TABLE4_HOROVOD[model][col],
                           calibration.horovod_images_per_s(fitted, profile, gpus, 30 if quick else 200),
                           calibration.horovod_images_per_s(first, profile, gpus, 30 if quick else 200))}
      for system, (paper, ours, under_first) in cells.items():
        if paper is None:
          continue
        is_fit = system == "hetpipe" and model == fit_model
        err = common.rel_error(ours, paper)
        rows.append({"model": model, "column": col, "system": system, "paper": paper, "ours": ours, "error": err,
                     "calibration_cell": is_fit, "under_horovod_fit": under_first,
                     "error_under_horovod_fit": common.rel_error(under_first, paper)})
        name = pt.MODEL_NAMES[model]
        claims.append(common.claim(
            f"Table 4 {'HetPipe ED-local' if system == 'hetpipe' else 'Horovod'} {name} {col}, fitted on "
            f"{pt.MODEL_NAMES[fit_model]}'s HetPipe cells", paper, round(ours, 1), common.fmt_error(err),
            _why(is_fit, system, cal, col, err, common.rel_error(under_first, paper)), cmd, is_fit))
  markdown = _markdown(rows, cal, first_cal, fit_model, quick)
  payload = {"fit_model": fit_model, "efficiency": cal.efficiency, "order": cal.order, "cells": cal.cells,
             "horovod_fit_efficiency": first_cal.efficiency, "rows": rows, "claims": claims, "quick": quick,
             "e_min": E_MIN, "bisect_steps": 4 if quick else BISECT_STEPS}
  return common.write_results(results_dir, "calibration_hetpipe", payload, markdown, _figure(rows, fit_model))


def _why(is_fit: bool, system: str, cal, col: str, err, err_first) -> str:
  if is_fit:
    cell = next(c for c in cal.cells if c["column"] == col)
    if not cell["reached"]:
      return (f"calibration cell, not reached: even efficiency 1 for {cell['gpu_type']} gives "
              f"{cell['images_per_s_at_e_1']:.0f} images/s; our model cannot run this cell as fast as the paper")
    return f"calibration cell: {cell['gpu_type']}'s efficiency is fitted on it ({cell['efficiency']:.3f})"
  if system == "horovod":
    return (f"prediction; under the Horovod fit this cell was a calibration cell ({common.fmt_error(err_first)}): "
            "efficiencies that give HetPipe its paper speed make a whole-model step faster too")
  return f"prediction (under the Horovod fit: {common.fmt_error(err_first)})"


def _markdown(rows, cal, first_cal, fit_model: str, quick: bool) -> str:
  md = [f"Second calibration: one roofline efficiency per GPU type fitted on {pt.MODEL_NAMES[fit_model]}'s HetPipe "
        "ED-local cells of Table 4 (experiments/paper/calibration_hetpipe.py)" + (" — quick mode" if quick else ""), "",
        "| GPU type | fitted on HetPipe | reached | fitted on Horovod (first calibration) |", "|---|---:|---|---:|"]
  for t in cal.order:
    cell = next(c for c in cal.cells if c["gpu_type"] == t)
    md.append(f"| {t} | {cal.efficiency[t]:.3f} | {'yes' if cell['reached'] else 'no (see its cell)'} | "
              f"{first_cal.efficiency[t]:.3f} |")
  md += ["", "| cell | paper | ours (HetPipe fit) | error | ours (Horovod fit) | error | role |",
         "|---|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    md.append(f"| {'HetPipe' if r['system'] == 'hetpipe' else 'Horovod'} {pt.MODEL_NAMES[r['model']]} {r['column']} | "
              f"{r['paper']} | {r['ours']:.0f} | {common.fmt_error(r['error'])} | {r['under_horovod_fit']:.0f} | "
              f"{common.fmt_error(r['error_under_horovod_fit'])} | "
              f"{'calibration' if r['calibration_cell'] else 'prediction'} |")
  pred = [abs(r["error"]) for r in rows if not r["calibration_cell"] and r["error"] is not None]
  if pred:
    md += ["", f"Predictions: {len(pred)} cells, mean absolute error {100 * sum(pred) / len(pred):.0f}%."]
  return "\n".join(md)


def _figure(rows, fit_model: str):
  plt = common.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
  for ax, system in zip(axes, ("hetpipe", "horovod")):
    rs = [r for r in rows if r["system"] == system]
    x = range(len(rs))
    ax.bar([i - 0.27 for i in x], [r["paper"] for r in rs], 0.27, label="paper")
    ax.bar(list(x), [r["ours"] for r in rs], 0.27, label=f"fit on {pt.MODEL_NAMES[fit_model]} HetPipe")
    ax.bar([i + 0.27 for i in x], [r["under_horovod_fit"] for r in rs], 0.27, label="fit on Horovod")
    ax.set_xticks(list(x), [f"{pt.MODEL_NAMES[r['model']][:3]} {r['column']}" for r in rs], rotation=30, fontsize=7)
    ax.set_title(f"Table 4 {'HetPipe ED-local' if system == 'hetpipe' else 'Horovod'}", fontsize=9)
    ax.set_ylabel("images/s")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  return fig


def main(argv):
  del argv
  path = run(flags.FLAGS.results_dir, flags.FLAGS.quick, flags.FLAGS.fit_model)
  with open(path.replace(".json", ".md"), encoding="utf-8") as f:
    print(f.read())
  print(f"wrote {path}")


if __name__ == "__main__":  # flags only when run as a script: other scripts import this module
  flags.DEFINE_string("results_dir", common.RESULTS_DIR, "Where to write calibration_hetpipe.{json,md,png}.")
  flags.DEFINE_bool("quick", False, "Two columns, 4 bisection steps, fewer engine waves (seconds).")
  flags.DEFINE_enum("fit_model", FIT_MODEL, list(pt.MODELS), "The model whose HetPipe cells are fitted.")
  app.run(main)
