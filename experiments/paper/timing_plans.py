"""Paper-scale timing plans for virtual-time runs: the calibrated ``hetpipe_paper`` clusters, Horovod on the paper's
GPUs, and the VGG-19 plans of ``experiments/staleness_study.py``.

Shared by ``experiments/paper/convergence.py`` (HetPipe §8.4, Figures 5 and 6) and the staleness study: the *timing*
of a run comes from a paper-scale model's plan on ``hetpipe_paper`` (the planner + cost model + event engine), its
numerics from a small proxy model (``config.timing_plan``). Defines no flags.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

from hetpipe_jax.paths import REPO_ROOT

# The GPUs (nodes) of the paper's Horovod runs: ResNet-152 does not fit the G node's RTX 2060s (HetPipe §8.3).
PAPER_HOROVOD_NODES = {"resnet152_imagenet": ("V", "R", "Q"), "vgg19_imagenet": ("V", "R", "G", "Q")}


def horovod_plan(cluster, profile, nodes: tuple[str, ...], by: str = "experiments/paper/convergence.py"):
  """The planner's Horovod plan extended to every GPU of ``nodes`` (the paper's GPUs), memory not checked.

  ``by`` names the script in the plan's note.

  Returns:
    ``(plan, our_gpus, notes)``: the plan to time, the GPUs our memory model admits, and the planner's notes.
  """
  from hetpipe_jax.costs import cost_model, profile_format
  from hetpipe_jax.planning import planner, plan_format
  base = planner.make_plan(cluster, profile, planner.PlannerConfig(method="horovod"))
  ours = [vw.gpus[0] for vw in base.virtual_workers]
  cfg = cost_model.CostModelConfig(**{**base.cost_model, "method": "horovod"})
  costs = cost_model.build_stage_costs(profile_format.micro_batch_profile(profile, base.num_inflight), cluster, cfg)
  need = int(costs.stage_memory_bytes(0, profile.num_layers, True, 1, 1))
  vws = []
  for g in (g for g in cluster.gpus() if g.node in nodes):
    ms = float(costs.compute_ms(g.gpu_type, 0, profile.num_layers))
    vws.append(plan_format.VirtualWorkerEntry(
        vw_id=len(vws), gpus=(g.gpu_id,), gpu_types=(g.gpu_type,), devices=(cluster.device_index(g.gpu_id),),
        partition=((0, profile.num_layers),), stage_time_ms=(round(ms, 6),), stage_memory_bytes=(need,),
        stage_capacity_bytes=(int(costs.capacity_bytes[g.gpu_type]),), max_num_inflight=1,
        saturating_num_inflight=1, predicted_minibatches_per_s=round(1e3 / ms, 6)))
  note = (f"{by}: Horovod on the paper's GPUs (nodes {', '.join(nodes)}; HetPipe §8.3), "
          f"memory not checked; our memory model admits {len(ours)} of them: {', '.join(ours)}")
  plan = dataclasses.replace(base, virtual_workers=tuple(vws), notes=(note,) + tuple(base.notes),
                             predicted_total_minibatches_per_s=0.0)
  plan_format.validate_plan(plan)
  return plan, ours, list(base.notes)


CALIBRATIONS = ("horovod", "hetpipe")  # the fits a timing cluster can use (module docstring)


def timing_clusters(out_dir: pathlib.Path, calibrated: bool, names: Sequence[str],
                    calibration: str = "horovod") -> tuple[dict[str, str], dict[str, float] | None]:
  """The timing clusters as files under ``out_dir/plans`` (a plan names its cluster, which the job loads): per
  cluster name of ``names`` (``hetpipe_paper``, ``hetpipe_paper_vrq``) the file's absolute path (also its ``name``), and the fitted efficiencies.

  ``calibrated``: every GPU type's ``roofline_efficiency`` as fitted on the paper's Table 4 (``calibration``:
  ``"horovod"``, :mod:`experiments.paper.calibration` on its Horovod cells, as the throughput experiments use;
  ``"hetpipe"``, :mod:`experiments.paper.calibration_hetpipe` on VGG-19's HetPipe cells); else the cost model's
  defaults. ``hetpipe_paper_vrq`` is ``hetpipe_paper`` without node G (its four RTX 2060s), Figure 5's 12 GPUs.

  Raises:
    ValueError: an unknown ``calibration``.
  """
  from hetpipe_jax.costs import cluster as cluster_lib
  if calibration not in CALIBRATIONS:
    raise ValueError(f"calibration={calibration!r}: one of {', '.join(CALIBRATIONS)}")
  efficiency = None
  if calibrated and calibration == "hetpipe":
    from experiments.paper import calibration_hetpipe  # pylint: disable=g-import-not-at-top
    efficiency = dict(calibration_hetpipe.calibrated_cluster(refit=False)[1].efficiency)  # the saved fit
  elif calibrated:
    from experiments.paper import calibration as calibration_lib  # pylint: disable=g-import-not-at-top
    efficiency = dict(calibration_lib.calibrate()[1].efficiency)
  out = {}
  for name in names:
    d = json.loads((pathlib.Path(cluster_lib.CLUSTER_DIR) / "hetpipe_paper.json").read_text())
    if name == "hetpipe_paper_vrq":
      d["nodes"] = [n for n in d["nodes"] if n["name"] != "G"]
    if efficiency:
      for t in d["gpu_types"]:
        t["roofline_efficiency"] = efficiency[t["name"]]
    suffix = ("_calibrated" if calibration == "horovod" else "_hetpipe_fit") if calibrated else ""
    path = (out_dir / "plans" / f"{name}{suffix}.json").resolve()
    # A path is loaded as it is (cluster.load_cluster): relative to the repository root when run from it, so the
    # committed plans name no machine's paths.
    d["name"] = str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) and \
        pathlib.Path.cwd().resolve() == REPO_ROOT.resolve() else str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=1) + "\n")
    cluster_lib.load_cluster(str(path))  # validates
    out[name] = str(path)
  return out, efficiency


def plan_info(plan, path: pathlib.Path, profile, cluster) -> dict:
  """What a study records about a timing plan: its file (relative to the repository root when inside it), its layout
  (VWs, stages per VW, Nm), GPUs and the largest PS push and all-reduce times."""
  from hetpipe_jax.planning import plan_times  # pylint: disable=g-import-not-at-top
  times = plan_times.task_times_from_plan(plan, profile, cluster)
  try:
    shown = str(path.resolve().relative_to(REPO_ROOT))
  except ValueError:
    shown = str(path)
  return {"path": shown, "method": plan.method, "num_vws": len(plan.virtual_workers),
          "num_stages": [len(vw.partition) for vw in plan.virtual_workers], "num_inflight": plan.num_inflight,
          "gpus": sum(len(vw.gpus) for vw in plan.virtual_workers),
          "vw_gpus": ["".join(gid.split("/")[0] for gid in vw.gpus) for vw in plan.virtual_workers],
          "predicted_minibatches_per_s": plan.predicted_total_minibatches_per_s,
          "push_s": max(t.push_s for t in times), "allreduce_s": max(t.allreduce_s for t in times)}


def vgg19_study_plans(out_dir: pathlib.Path, which: Sequence[str], calibrated: bool = True,
                      calibration: str = "horovod") -> dict[str, dict]:
  """VGG-19 (batch 32) timing plans on ``hetpipe_paper`` (calibrated on the paper's ``calibration`` cells:
  :func:`timing_clusters`), written to ``out_dir``: ``hetpipe`` (ED, 4 VWs, ``local`` placement, the planner's Nm:
  §8.4's "HetPipe with ED-local"), ``horovod`` (the paper's 16 GPUs, :func:`horovod_plan`) and ``1f1b_flush`` (ED, 4
  pipelines, the planner's M, as ``python -m hetpipe_jax.compare`` plans it).

  Returns:
    Per name in ``which``: :func:`plan_info` of its plan.

  Raises:
    ValueError: an unknown name in ``which``.
  """
  from hetpipe_jax import profiles  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.costs import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.planning import planner, plan_format  # pylint: disable=g-import-not-at-top
  unknown = sorted(set(which) - {"hetpipe", "horovod", "1f1b_flush"})
  if unknown:
    raise ValueError(f"unknown timing plans {unknown}; known: hetpipe, horovod, 1f1b_flush")
  clusters, _ = timing_clusters(out_dir.parent, calibrated, ["hetpipe_paper"], calibration)
  cluster = cluster_lib.load_cluster(clusters["hetpipe_paper"])
  profile = profiles.get_profile("vgg19_imagenet", 32, cluster, None)
  out = {}
  for name in which:
    if name == "horovod":
      plan, _, _ = horovod_plan(cluster, profile, PAPER_HOROVOD_NODES["vgg19_imagenet"],
                                by="experiments/staleness_study.py")
    elif name == "hetpipe":
      plan = planner.make_plan(cluster, profile, planner.PlannerConfig(policy="ED", num_vws=4, ps_placement="local"))
    else:
      plan = planner.make_plan(cluster, profile, planner.PlannerConfig(method="1f1b_flush", policy="ED", num_vws=4))
    path = out_dir / f"{name}_vgg19_imagenet_hetpipe_paper.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    plan_format.write_plan(plan, str(path))
    out[name] = plan_info(plan, path, profile, cluster)
  return out
