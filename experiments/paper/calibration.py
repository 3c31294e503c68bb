r"""Calibration protocol: one roofline efficiency per GPU type, fitted on the paper's Horovod throughputs (Table 4).

  .venv/bin/python experiments/paper/calibration.py [--quick] [--results_dir=experiments/paper/results] \
      [--write_cluster=/tmp/hetpipe_paper_calibrated.json]   # then: python -m hetpipe_jax.compare --cluster=<it>

**What is calibrated.** The cost model's only free compute parameter is the roofline efficiency (achieved / peak
FLOP/s and memory bandwidth, :mod:`hetpipe_jax.costs.cost_model`); the cluster file's default (0.5 for every
type) is a guess. We fit one efficiency per GPU type (4 numbers) and nothing else: links, latencies, memory and the
engine keep their documented defaults.

**On which paper numbers** (``CALIBRATION_CELLS``): the 7 Horovod cells of Table 4 (VGG-19: 164, 205, 265, 339;
ResNet-152: 233, 353, 415 images/s), because Horovod is the one system of the paper whose speed is a closed function
of one GPU's speed: a BSP step of N GPUs, each computing one minibatch of 32 on the whole model, then a ring
all-reduce, so ``images/s = 32 N / (max_g T_g + allreduce)`` (the engine runs exactly this,
:mod:`hetpipe_jax.rules.allreduce`). Figure 3's single-VW numbers would be the other natural choice, but the paper
gives them only inside the plot. Every other number of §8 (Table 4's HetPipe row, Figure 4, Table 3 / Figure 3's
shapes) is a **prediction**.

**Fitting procedure** (:func:`fit`): Table 4's columns add one GPU type at a time (V, then R, Q, G). Walk them in
order; in a column with types fitted so far, each cell's paper rate gives the step time, minus our all-reduce time
(:func:`hetpipe_jax.costs.allreduce_cost.allreduce_time_s`) the compute time ``T_needed`` of the slowest GPU,
taken to be the new type: ``e_cell = T_new(e = 1) / T_needed``, with ``T(e = 1)`` the roofline time of the whole
model at efficiency 1 (``cost_model.layer_times_ms``; the roofline scales exactly as ``1 / e`` when compute and
memory efficiency are equal). When the types fitted before are already slower than ``T_needed``, the cell only bounds
the new type's time from above and ``e_cell`` is the lowest efficiency it allows (recorded as ``identifies_type:
false``; RTX 2060, by 1%). The type's efficiency is the geometric mean of its cells' (least squares on log compute
time, one value shared by both models). :func:`horovod_images_per_s`
then runs every cell through the engine at the fitted values and the residuals are reported (``calibration.json``).

The Horovod cells are run on the paper's GPUs whatever our memory model says (before issue 28 it excluded the Quadro
P4000 and RTX 2060 for VGG-19 at batch 32, which the paper ran: docs/measurements/memory_model.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
from typing import Sequence

if str(pathlib.Path(__file__).resolve().parents[2]) not in sys.path:  # run as a file: find the package
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from absl import app, flags  # noqa: E402

from experiments.paper import common  # noqa: E402
from experiments.paper import paper_tables as pt  # noqa: E402
from hetpipe_jax.costs import allreduce_cost  # noqa: E402
from hetpipe_jax.costs import cluster as cluster_lib  # noqa: E402
from hetpipe_jax.costs import cost_model  # noqa: E402
from hetpipe_jax.costs import task_times as task_times_lib  # noqa: E402
from hetpipe_jax.costs.cluster import ClusterSpec, Gpu  # noqa: E402
from hetpipe_jax.costs.profile_format import ModelProfile  # noqa: E402
from hetpipe_jax.sim import engine  # noqa: E402

# (method, model, Table 4 column): the paper cells the cost model is fitted on. Everything else is a prediction.
CALIBRATION_CELLS = tuple(("horovod", model, col) for model, _, col, _ in pt.table4_cells("horovod"))


class CalibrationError(ValueError):
  """A calibration cell cannot be fitted (no compute time left after the all-reduce, or an efficiency above 1)."""


def is_calibration_cell(method: str, model: str, column: str) -> bool:
  """Whether the paper's ``method`` / ``model`` / Table 4 ``column`` cell is in the calibration set."""
  return (method, model, column) in CALIBRATION_CELLS


def whole_model_ms(profile: ModelProfile, cluster: ClusterSpec, gpu_type: str, efficiency: float | None) -> float:
  """Forward+backward time (ms) of the whole model on ``gpu_type`` at roofline ``efficiency`` (None: the type's or
  the cost model's default)."""
  t = cluster.gpu_types[gpu_type]
  if efficiency is not None:
    t = dataclasses.replace(t, roofline_efficiency=efficiency)
  return float(cost_model.layer_times_ms(profile, t, cost_model.CostModelConfig()).sum())


def horovod_gpus(cluster: ClusterSpec, nodes: Sequence[str]) -> list[Gpu]:
  return [g for g in cluster.gpus() if g.node in nodes]


def horovod_allreduce_s(cluster: ClusterSpec, profile: ModelProfile, gpus: Sequence[Gpu]) -> float:
  return allreduce_cost.allreduce_time_s([([g], [(0, profile.num_layers)]) for g in gpus], profile, cluster)


def horovod_images_per_s(cluster: ClusterSpec, profile: ModelProfile, gpus: Sequence[Gpu], num_steps: int = 100
                         ) -> float:
  """Horovod (one replica per GPU, M = 1) on ``gpus`` run by the engine (all-reduce BSP), images/s; memory is not
  checked (module docstring)."""
  costs = cost_model.build_stage_costs(profile, cluster, cost_model.CostModelConfig(method="horovod"))
  fwd = task_times_lib.forward_prefix_ms(profile, cluster, cost_model.CostModelConfig(method="horovod"))
  ar = horovod_allreduce_s(cluster, profile, gpus)
  times = [task_times_lib.vw_task_times([g], [(0, profile.num_layers)], costs, fwd, cluster, allreduce_s=ar)
           for g in gpus]
  report = engine.run(times, engine.EngineConfig(num_waves=num_steps, num_inflight=1, records=False,
                                                 method="horovod"), gpu_ids=[[g.gpu_id] for g in gpus])
  return report.total_minibatches_per_s * profile.batch_size


def horovod_fits(cluster: ClusterSpec, profile: ModelProfile, gpus: Sequence[Gpu]) -> bool:
  """Whether our memory model lets every GPU of ``gpus`` hold the whole model (Horovod's one-stage memory)."""
  costs = cost_model.build_stage_costs(profile, cluster, cost_model.CostModelConfig(method="horovod"))
  n = profile.num_layers
  return all(costs.stage_memory_bytes(0, n, True, 1, 1) <= costs.capacity_bytes[g.gpu_type] for g in gpus)


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The fitted efficiencies and how they were obtained.

  Attributes:
    efficiency: GPU type -> fitted roofline efficiency.
    cells: per calibration cell: model, column, the type it fits, paper images/s, implied efficiency.
    order: the GPU types in fitting order.
  """

  efficiency: dict[str, float]
  cells: list[dict]
  order: list[str]

  def apply(self, cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with every fitted type's ``roofline_efficiency`` set (same name: plans made on it match)."""
    types = {name: dataclasses.replace(t, roofline_efficiency=self.efficiency.get(name, t.roofline_efficiency))
             for name, t in cluster.gpu_types.items()}
    return dataclasses.replace(cluster, gpu_types=types)


def fit(cluster: ClusterSpec, profiles: dict[str, ModelProfile],
        horovod_table: dict[str, dict[str, float | None]] | None = None) -> Calibration:
  """Fits one efficiency per GPU type on ``CALIBRATION_CELLS`` (module docstring).

  Args:
    cluster: the paper's cluster (its nodes named as Table 4's columns).
    profiles: model name -> profile, for the models of ``horovod_table``.
    horovod_table: model -> Table 4 column -> Horovod images/s (default: the paper's, ``TABLE4_HOROVOD``; tests
      pass rates made from known efficiencies).

  Raises:
    CalibrationError: a cell leaves no compute time or needs an efficiency above 1.
  """
  eff: dict[str, float] = {}
  cells, order = [], []
  prev_nodes: tuple[str, ...] = ()
  for col in pt.TABLE4_COLUMNS:
    nodes = pt.TABLE4_NODES[col]
    (new_node,) = [n for n in nodes if n not in prev_nodes]
    new_type = pt.NODE_TYPES[new_node]
    logs = []
    for model, profile in profiles.items():
      paper = (horovod_table or pt.TABLE4_HOROVOD)[model][col]
      if paper is None or (horovod_table is None and not is_calibration_cell("horovod", model, col)):
        continue
      gpus = horovod_gpus(cluster, nodes)
      step_s = len(gpus) * profile.batch_size / paper
      needed_ms = (step_s - horovod_allreduce_s(cluster, profile, gpus)) * 1e3
      slowest_before = max((whole_model_ms(profile, cluster, pt.NODE_TYPES[n], eff[pt.NODE_TYPES[n]])
                            for n in prev_nodes), default=0.0)
      if not needed_ms > 0:
        raise CalibrationError(f"Horovod {model} {col}: the paper's {paper} images/s leave no compute time per step "
                               f"after our all-reduce ({needed_ms:.0f} ms): the cell cannot be fitted")
      e = whole_model_ms(profile, cluster, new_type, 1.0) / needed_ms
      if e > 1.0:
        raise CalibrationError(f"Horovod {model} {col}: {new_type!r} would need efficiency {e:.2f} > 1")
      logs.append(math.log(e))
      cells.append({"model": model, "column": col, "gpu_type": new_type, "paper_images_per_s": paper,
                    "compute_ms_per_step": needed_ms, "implied_efficiency": e,
                    # The cell identifies the new type only when it is the slowest; otherwise it bounds its time
                    # from above and the implied value is the lowest efficiency consistent with it.
                    "identifies_type": bool(needed_ms > slowest_before)})
    eff[new_type] = math.exp(sum(logs) / len(logs))
    order.append(new_type)
    prev_nodes = nodes
  return Calibration(eff, cells, order)


def write_calibrated_cluster(path: str, name: str = "hetpipe_paper_calibrated") -> dict:
  """Writes the paper cluster's JSON with the fitted ``roofline_efficiency`` per type, named ``name``, so the CLIs
  can use it (``python -m hetpipe_jax.compare --cluster=<path>``). Returns the dict written."""
  with open(os.path.join(cluster_lib.CLUSTER_DIR, common.CLUSTER + ".json"), encoding="utf-8") as f:
    d = json.load(f)
  _, cal = calibrate()
  d["name"] = name
  d["_comment"] = (d.get("_comment", "") + " roofline_efficiency: fitted by experiments/paper/calibration.py on the "
                   "paper's Horovod throughputs (Table 4); regenerate, do not edit.")
  for t in d["gpu_types"]:
    t["roofline_efficiency"] = cal.efficiency[t["name"]]
  cluster_lib.cluster_from_dict(d)  # validates
  with open(path, "w", encoding="utf-8") as f:
    json.dump(d, f, indent=2)
  return d


def calibrate(cluster: ClusterSpec | None = None) -> tuple[ClusterSpec, Calibration]:
  """The paper cluster with the fitted efficiencies (``(calibrated cluster, calibration)``)."""
  cluster = cluster or common.load_cluster()
  cal = fit(cluster, {m: common.load_profile(m) for m in pt.MODELS})
  return cal.apply(cluster), cal




def run(results_dir: str, quick: bool) -> str:
  """Fits, checks every calibration cell in the engine, writes the results; returns the JSON path."""
  base = common.load_cluster()
  calibrated, cal = calibrate(base)
  profiles = {m: common.load_profile(m) for m in pt.MODELS}
  rows, claims = [], []
  for cell in cal.cells:
    model, col = cell["model"], cell["column"]
    gpus = horovod_gpus(base, pt.TABLE4_NODES[col])
    ours = horovod_images_per_s(calibrated, profiles[model], gpus, 30 if quick else 200)
    default = horovod_images_per_s(base, profiles[model], gpus, 30 if quick else 200)
    err = common.rel_error(ours, cell["paper_images_per_s"])
    rows.append({**cell, "ours_images_per_s": ours, "uncalibrated_images_per_s": default, "error": err})
    claims.append(common.claim(
        f"Table 4 Horovod {pt.MODEL_NAMES[model]} {col} (calibration cell for {cell['gpu_type']})",
        cell["paper_images_per_s"], round(ours, 1), common.fmt_error(err),
        "calibration cell: the efficiency of its new GPU type is fitted on it (one value per type, shared by both "
        "models, so the two models' cells split the difference)", common.command("calibration"), True))
  md = ["Calibration: one roofline efficiency per GPU type, fitted on Table 4's Horovod cells "
        "(experiments/paper/calibration.py)", "",
        "| GPU type | fitted efficiency | cells (model, column: implied efficiency) |", "|---|---:|---|"]
  for t in cal.order:
    cs = "; ".join(f"{pt.MODEL_NAMES[c['model']]} {c['column']}: {c['implied_efficiency']:.3f}"
                   for c in cal.cells if c["gpu_type"] == t)
    md.append(f"| {t} | {cal.efficiency[t]:.3f} | {cs} |")
  md += ["", "| cell | paper images/s | ours (calibrated) | error | uncalibrated (0.5) |", "|---|---:|---:|---:|---:|"]
  for r in rows:
    md.append(f"| Horovod {pt.MODEL_NAMES[r['model']]} {r['column']} | {r['paper_images_per_s']} | "
              f"{r['ours_images_per_s']:.0f} | {common.fmt_error(r['error'])} | {r['uncalibrated_images_per_s']:.0f} |")
  markdown = "\n".join(md)
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(7, 3.2))
  labels = [f"{pt.MODEL_NAMES[r['model']][:3]} {r['column']}" for r in rows]
  x = range(len(rows))
  ax.bar([i - 0.2 for i in x], [r["paper_images_per_s"] for r in rows], 0.4, label="paper (Table 4)")
  ax.bar([i + 0.2 for i in x], [r["ours_images_per_s"] for r in rows], 0.4, label="ours, calibrated")
  ax.set_xticks(list(x), labels, rotation=30, fontsize=8)
  ax.set_ylabel("Horovod images/s")
  ax.set_title("Calibration cells (Horovod, Table 4): efficiencies " +
               ", ".join(f"{t.split()[-1]} {cal.efficiency[t]:.2f}" for t in cal.order), fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  payload = {"efficiency": cal.efficiency, "order": cal.order, "cells": rows,
             "calibration_cells": [list(c) for c in CALIBRATION_CELLS], "claims": claims, "quick": quick}
  return common.write_results(results_dir, "calibration", payload, markdown, fig)


def main(argv):
  del argv
  path = run(flags.FLAGS.results_dir, flags.FLAGS.quick)
  if flags.FLAGS.write_cluster:
    write_calibrated_cluster(flags.FLAGS.write_cluster)
    print(f"wrote {flags.FLAGS.write_cluster}")
  with open(path.replace(".json", ".md"), encoding="utf-8") as f:
    print(f.read())
  print(f"wrote {path}")


if __name__ == "__main__":  # flags only when run as a script: the other scripts import this module
  flags.DEFINE_string("results_dir", common.RESULTS_DIR, "Where to write calibration.{json,md,png}.")
  flags.DEFINE_bool("quick", False, "Fewer engine steps per cell (seconds).")
  flags.DEFINE_string("write_cluster", "", "Also write the calibrated cluster JSON here (for the CLIs' --cluster).")
  app.run(main)
