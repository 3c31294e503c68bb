"""Benchmarks the exact DP partitioner on the paper's setting and prints JSON.

  .venv/bin/python scripts/bench_partitioner.py [--quick]

Cases: ResNet-152 (53 layers: stem, 50 bottleneck blocks, pool, dense; batch 32) on one virtual worker of four
different GPUs (TITAN V, TITAN RTX, RTX 2060, P4000; the DP covers all 24 orderings), and on one virtual worker of
all 16 hetpipe_paper GPUs; VGG-19 likewise; and full NP/ED/HD/auto plans. Times are wall-clock seconds (median
of repeats). Targets (issue #3): 4 GPUs <= 1 s, 16 GPUs <= 10 s. Issue 10, target 3: ``auto`` on
hetpipe_paper_x4 (64 GPUs, 4 types, 16 nodes) with 16 VWs in <= 30 s (wall and CPU seconds reported). Not in
``--quick``: HD's node pairing on hetpipe_paper_x4, every pairing against the class-skipping one. ``--quick``
(CI smoke, seconds): the same 16-GPU cases, one repeat each, and the 64-GPU case for ResNet-152 only.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position
from bench_util import timed  # pylint: disable=wrong-import-position

from hetpipe_jax.costs import cluster as cluster_lib  # pylint: disable=wrong-import-position
from hetpipe_jax.costs import cost_model  # pylint: disable=wrong-import-position
from hetpipe_jax.costs import profile_format  # pylint: disable=wrong-import-position
from hetpipe_jax.planning import partitioner  # pylint: disable=wrong-import-position
from hetpipe_jax.planning import planner  # pylint: disable=wrong-import-position


_QUICK = flags.DEFINE_bool("quick", False, "One repeat per case (a seconds-long smoke run; timings are noisier).")
_X4_COMPARE = flags.DEFINE_string("x4_compare", None, "Only this: compare's planning of MODEL on hetpipe_paper_x4 "
                                  "(16 VWs, batch as fsdp_compare) before and after issue 26's speed-ups, one "
                                  "process, same load, rows checked equal; and HD's pairing alone.")


def _plan_x4(model, queue):
  x4 = cluster_lib.load_cluster("hetpipe_paper_x4")
  prof = profile_format.load_profile(profile_format.default_profile_path(model, 32, "cpu", False))
  cpu0, wall0 = time.process_time(), time.perf_counter()
  plan = planner.make_plan(x4, prof, planner.PlannerConfig(policy="auto", num_vws=16))
  queue.put({"plan_seconds": round(time.perf_counter() - wall0, 3),
             "plan_cpu_seconds": round(time.process_time() - cpu0, 3), "num_inflight": plan.num_inflight,
             "predicted_total_minibatches_per_s": plan.predicted_total_minibatches_per_s,
             "vw_sizes": sorted(len(vw.gpus) for vw in plan.virtual_workers),
             "vw_types": sorted("".join(sorted(t[6] if t.startswith("TITAN") else t[0] for t in vw.gpu_types))
                                for vw in plan.virtual_workers),
             "allocation_search": plan.allocation_search})


def _x4_case(model, limit_s):
  """``auto`` on hetpipe_paper_x4 with 16 VWs in a child process, stopped after ``limit_s`` (reported)."""
  queue = multiprocessing.Queue()
  proc = multiprocessing.Process(target=_plan_x4, args=(model, queue))
  proc.start()
  try:
    out = queue.get(timeout=limit_s)
  except Exception:  # pylint: disable=broad-except  # queue.Empty: over the limit
    out = {"plan_seconds": None, "error": f"not finished after {limit_s} s (stopped)"}
  proc.terminate()
  proc.join()
  return {"model": model, "case": "full plan auto, hetpipe_paper_x4 (64 GPUs, 16 nodes), 16 VWs",
          "target_seconds": 30.0, "target_met": out.get("plan_seconds") is not None and out["plan_seconds"] <= 30.0,
          **out}


def _hd_pairing_x4():
  """HD's node pairing on hetpipe_paper_x4 (16 nodes): every pairing (the path before the class skipping) against
  the class-skipping enumeration, one run each, same process and load; both must give the same pairs."""
  from hetpipe_jax.planning import allocator  # pylint: disable=import-outside-toplevel
  x4 = cluster_lib.load_cluster("hetpipe_paper_x4")
  t_all, every = timed(lambda: allocator.hd_node_pairs(x4, exhaustive=True), 1)
  t_skip, skipping = timed(lambda: allocator.hd_node_pairs(x4), 1)
  return {"case": "HD node pairing, hetpipe_paper_x4 (16 nodes, 4 node classes)",
          "exhaustive_seconds": round(t_all, 3), "class_skipping_seconds": round(t_skip, 4),
          "same_pairs": every == skipping, "pairs": ["+".join(p) for p in skipping]}


def _x4_compare(model):
  """``compare`` on hetpipe_paper_x4 for ``model``: the path before issue 26's speed-ups (HD's pairing over every
  pairing; each placement's allocation planned anew; auto without the placement bound) against the current one, in
  one process; the rows (every method's rate, allocation, bottleneck) must be equal. GPT-2 large's path before
  does not end in reasonable time (auto's search at Nm = 1)."""
  import functools  # pylint: disable=import-outside-toplevel
  from hetpipe_jax.planning import allocator  # pylint: disable=import-outside-toplevel
  from hetpipe_jax.planning import compare as compare_lib  # pylint: disable=import-outside-toplevel
  x4 = cluster_lib.load_cluster("hetpipe_paper_x4")
  batch = 2 if model.startswith("gpt2") else 32
  prof = profile_format.load_profile(profile_format.default_profile_path(model, batch, "cpu", False))
  config = compare_lib.CompareConfig(num_vws=16, staleness_bound=0, pull_every_wave=False, num_waves=20)
  from hetpipe_jax.planning import auto_allocation  # pylint: disable=import-outside-toplevel
  fast_pairs, make_plan, init = allocator.hd_node_pairs, planner.make_plan, auto_allocation.AutoSearch.__init__
  out = {"case": f"compare {model} (batch {batch}) on hetpipe_paper_x4, 16 VWs: every method planned and run",
         "load_average_before": list(os.getloadavg())}
  for name in ("before", "after"):
    if name == "before":
      allocator.hd_node_pairs = functools.partial(fast_pairs, exhaustive=True)
      planner.make_plan = lambda c, p, cfg, allocations=None: make_plan(c, p, cfg)
      auto_allocation.AutoSearch.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "placement_bound": False})
    cpu0, wall0 = time.process_time(), time.perf_counter()
    table, _ = compare_lib.compare(x4, prof, config)
    out[f"{name}_seconds"] = round(time.perf_counter() - wall0, 3)
    out[f"{name}_cpu_seconds"] = round(time.process_time() - cpu0, 3)
    out[f"{name}_rows"] = [(r.method, r.allocation, r.placement, r.images_per_s, r.bottleneck) for r in table]
    allocator.hd_node_pairs, planner.make_plan, auto_allocation.AutoSearch.__init__ = fast_pairs, make_plan, init
  out["rows_equal"] = out["before_rows"] == out["after_rows"]
  out["load_average_after"] = list(os.getloadavg())
  return out


def main(argv):
  del argv
  quick = _QUICK.value
  if _X4_COMPARE.value:
    print(json.dumps({"machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
                      "cases": [_hd_pairing_x4(), _x4_compare(_X4_COMPARE.value)]}, indent=1))
    return
  paper = cluster_lib.load_cluster("hetpipe_paper")
  gpus = paper.gpus()
  one_each = tuple(gpus[i] for i in (0, 4, 8, 12))
  results = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count()}, "quick": quick, "cases": []}
  for model in ("resnet152_imagenet", "vgg19_imagenet"):
    prof = profile_format.load_profile(profile_format.default_profile_path(model, 32, "cpu", False))
    t_costs, costs = timed(lambda prof=prof: cost_model.build_stage_costs(prof, paper), 1 if quick else 3)
    for name, vw, repeats in (("4 different GPUs (VRGQ), all orderings", one_each, 5),
                              ("16 GPUs (4 types x 4 nodes), exact", tuple(gpus), 3)):
      for nm in (1, 4):
        problem = partitioner.PartitionProblem(costs, vw, nm)
        t, part = timed(lambda problem=problem: partitioner.partition_dp(problem), 1 if quick else repeats)
        results["cases"].append({
            "model": model, "num_layers": prof.num_layers, "case": name, "num_inflight": nm,
            "dp_seconds": round(t, 4), "build_costs_seconds": round(t_costs, 4),
            "max_stage_time_ms": round(part.max_stage_time_ms, 3),
            "order": [g.gpu_id for g in part.gpus] if len(vw) <= 4 else None})
    for policy in ("NP", "ED", "HD", "auto"):
      cfg = planner.PlannerConfig(policy=policy, num_vws=4)
      t, plan = timed(lambda cfg=cfg, prof=prof: planner.make_plan(paper, prof, cfg), 1)
      results["cases"].append({"model": model, "case": f"full plan {policy}, 4 VWs", "plan_seconds": round(t, 3),
                               "num_inflight": plan.num_inflight,
                               "predicted_total_minibatches_per_s": plan.predicted_total_minibatches_per_s})
  for model in ("resnet152_imagenet",) if quick else ("resnet152_imagenet", "vgg19_imagenet"):
    results["cases"].append(_x4_case(model, limit_s=60 if quick else 120))
  if not quick:
    results["cases"].append(_hd_pairing_x4())
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  app.run(main)
