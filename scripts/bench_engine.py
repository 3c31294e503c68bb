"""Benchmarks the discrete-event engine (timing-only mode) and prints JSON.

  .venv/bin/python scripts/bench_engine.py [--quick] [--repeats=3]

Cases (issue #10 targets, 2-core machine): the 16-GPU hetpipe_paper ED plan of ResNet-152 (batch 32, 4 VWs x 4
stages, the planner's Nm) for 1,000 waves in <= 1 s; 1,024 synthetic GPUs in 256 VWs of 4 stages (stage times
drawn uniformly in [50, 200] ms, i.e. speed ratios up to 4x; 2 ms sends, 40 ms push and pull; Nm = 4, D = 1) for
1,000 waves in <= 30 s. Times are seconds of ``engine.run``, the median of ``--repeats`` runs: ``wall_s`` (what the
targets are checked on) and ``cpu_s`` (this process's CPU time, less sensitive to other work on the machine); the
machine's load average is printed before and after. ``--quick`` (CI smoke, seconds): the same two kinds of case,
small (20 waves; 16 synthetic VWs x 10 waves), one run, no targets.

``--compare_with=DIR`` (another checkout of the repository, e.g. ``git worktree add /tmp/base <commit>`` with its
``.venv``): ``--repeats`` rounds, each one run of DIR's ``scripts/bench_engine.py --repeats=1`` and one of this
checkout's, alternating (so both see the same machine load), in fresh processes; prints both versions' medians per
case and the ratio this / DIR of ``wall_s`` and ``cpu_s`` (below 1: this checkout is faster).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position
from hetpipe_jax import flag_checks  # pylint: disable=wrong-import-position

import numpy as np  # pylint: disable=wrong-import-position

from hetpipe_jax.costs import cluster as cluster_lib  # pylint: disable=wrong-import-position
from hetpipe_jax.costs import profile_format  # pylint: disable=wrong-import-position
from hetpipe_jax.costs import task_times  # pylint: disable=wrong-import-position
from hetpipe_jax.planning import plan_times  # pylint: disable=wrong-import-position
from hetpipe_jax.planning import planner  # pylint: disable=wrong-import-position
from hetpipe_jax.sim import engine  # pylint: disable=wrong-import-position


_QUICK = flags.DEFINE_bool("quick", False, "Small cases, one run, no targets (a seconds-long smoke run).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per case (the median is reported); --quick runs each once.")
_COMPARE_WITH = flags.DEFINE_string("compare_with", None, "Another checkout of the repository: run its benchmark "
                                    "and this one alternately, --repeats rounds, and print the ratio (docstring).")


def case(name, times, config, target_s, repeats):
  """Times ``engine.run(times, config)`` ``repeats`` times; ``target_s`` None: no target (quick mode)."""
  walls, cpus, report = [], [], None
  for _ in range(repeats):
    cpu0, wall0 = time.process_time(), time.perf_counter()
    report = engine.run(times, config)
    walls.append(time.perf_counter() - wall0)
    cpus.append(time.process_time() - cpu0)
  wall, cpu = statistics.median(walls), statistics.median(cpus)
  num_tasks = sum(g.num_tasks for g in report.gpus)
  return {"case": name, "num_vws": len(times), "num_gpus": len(report.gpus), "num_waves": config.num_waves,
          "num_inflight": config.num_inflight, "staleness_bound": config.staleness_bound, "wall_s": round(wall, 3),
          "cpu_s": round(cpu, 3), "wall_s_each": [round(w, 3) for w in walls], "target_s": target_s,
          "meets_target": None if target_s is None else wall <= target_s, "num_events": report.num_events,
          "num_tasks": num_tasks, "us_per_event": round(1e6 * wall / report.num_events, 3),
          "us_per_task": round(1e6 * wall / num_tasks, 2),
          "simulated_minibatches_per_s": round(report.total_minibatches_per_s, 3),
          "simulated_makespan_s": round(report.makespan_s, 3), "max_clock_distance": report.max_clock_distance}


def _run_checkout(root: str, quick: bool) -> dict:
  """One run of ``root``'s ``scripts/bench_engine.py --repeats=1`` in a fresh process; its JSON."""
  python = os.path.join(root, ".venv", "bin", "python")
  cmd = [python if os.path.exists(python) else sys.executable, os.path.join(root, "scripts", "bench_engine.py"),
         "--repeats=1"] + (["--quick"] if quick else [])
  proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
  return json.loads(proc.stdout)


def compare(other: str, quick: bool, repeats: int) -> dict:
  """This checkout vs ``other``, alternating runs in fresh processes (module docstring)."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  runs = {"other": [], "this": []}
  load_before = os.getloadavg()
  for _ in range(repeats):
    runs["other"].append(_run_checkout(other, quick))
    runs["this"].append(_run_checkout(here, quick))
  cases = []
  for i, case_this in enumerate(runs["this"][0]["cases"]):
    row = {"case": case_this["case"]}
    for who in ("other", "this"):
      for key in ("wall_s", "cpu_s"):
        row[f"{key}_{who}"] = round(statistics.median(r["cases"][i][key] for r in runs[who]), 3)
      row[f"wall_s_each_{who}"] = [r["cases"][i]["wall_s"] for r in runs[who]]
    for key in ("wall_s", "cpu_s"):
      row[f"{key}_ratio_this_over_other"] = round(row[f"{key}_this"] / row[f"{key}_other"], 3)
    row["target_s"] = None if quick else case_this["target_s"]
    row["meets_target_this"] = None if quick else row["wall_s_this"] <= case_this["target_s"]
    same = all(r["cases"][i][k] == case_this[k] for r in runs["other"] + runs["this"]
               for k in ("num_events", "simulated_makespan_s"))
    row["same_results"] = same  # event count and simulated makespan agree between the versions
    cases.append(row)
  return {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                      "load_average_before": [round(x, 2) for x in load_before],
                      "load_average_after": [round(x, 2) for x in os.getloadavg()]},
          "this": here, "other": os.path.abspath(other), "quick": quick, "rounds": repeats, "cases": cases}


def main(argv):
  del argv
  if _QUICK.value:  # one run per case
    flag_checks.refuse_replaced("--quick", ["repeats"])
  if _COMPARE_WITH.value:
    print(json.dumps(compare(_COMPARE_WITH.value, _QUICK.value, 1 if _QUICK.value else _REPEATS.value), indent=1))
    return
  quick = _QUICK.value
  repeats = 1 if quick else _REPEATS.value
  load_before = os.getloadavg()
  paper = cluster_lib.load_cluster("hetpipe_paper")
  profile = profile_format.load_profile(profile_format.default_profile_path("resnet152_imagenet", 32, "cpu", False))
  plan = planner.make_plan(paper, profile, planner.PlannerConfig(policy="ED", num_vws=4))
  paper_times = plan_times.task_times_from_plan(plan, profile, paper)
  rng = np.random.default_rng(0)
  big_times = [task_times.uniform_task_times(list(rng.uniform(50.0, 200.0, size=4)), send_ms=2.0, push_ms=40.0,
                                             pull_ms=40.0) for _ in range(16 if quick else 256)]
  paper_waves, big_waves = (20, 10) if quick else (1000, 1000)
  cases = [
      case("hetpipe_paper resnet152 ED, 16 GPUs", paper_times,
           engine.EngineConfig(num_waves=paper_waves, num_inflight=plan.num_inflight, staleness_bound=1,
                               records=False), None if quick else 1.0, repeats),
      case(f"synthetic {4 * len(big_times)} GPUs, {len(big_times)} VWs x 4 stages", big_times,
           engine.EngineConfig(num_waves=big_waves, num_inflight=4, staleness_bound=1, records=False),
           None if quick else 30.0, repeats),
  ]
  results = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                         "load_average_before": [round(x, 2) for x in load_before],
                         "load_average_after": [round(x, 2) for x in os.getloadavg()]},
             "quick": quick, "repeats": repeats, "cases": cases}
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  app.run(main)
