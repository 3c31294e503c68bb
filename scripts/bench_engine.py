"""Benchmarks the discrete-event engine (timing-only mode) and prints JSON.

  .venv/bin/python scripts/bench_engine.py [--quick] [--repeats=3]

Cases (issue #10 targets, 2-core machine): the 16-GPU hetpipe_paper ED plan of ResNet-152 (batch 32, 4 VWs x 4
stages, the planner's Nm) for 1,000 waves in <= 1 s; 1,024 synthetic GPUs in 256 VWs of 4 stages (stage times
drawn uniformly in [50, 200] ms, i.e. speed ratios up to 4x; 2 ms sends, 40 ms push and pull; Nm = 4, D = 1) for
1,000 waves in <= 30 s. Times are seconds of ``engine.run``, the median of ``--repeats`` runs: ``wall_s`` (what the
targets are checked on) and ``cpu_s`` (this process's CPU time, less sensitive to other work on the machine); the
machine's load average is printed before and after. ``--quick`` (CI smoke, seconds): the same two kinds of case,
small (20 waves; 16 synthetic VWs x 10 waves), one run, no targets.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position

import numpy as np  # pylint: disable=wrong-import-position

from hetpipe_jax.planning import cluster as cluster_lib  # pylint: disable=wrong-import-position
from hetpipe_jax.planning import planner  # pylint: disable=wrong-import-position
from hetpipe_jax.planning import profile_format  # pylint: disable=wrong-import-position
from hetpipe_jax.sim import engine  # pylint: disable=wrong-import-position
from hetpipe_jax.sim import task_times  # pylint: disable=wrong-import-position


_QUICK = flags.DEFINE_bool("quick", False, "Small cases, one run, no targets (a seconds-long smoke run).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per case (the median is reported); --quick runs each once.")


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


def main(argv):
  del argv
  quick = _QUICK.value
  repeats = 1 if quick else _REPEATS.value
  load_before = os.getloadavg()
  paper = cluster_lib.load_cluster("hetpipe_paper")
  profile = profile_format.load_profile(profile_format.default_profile_path("resnet152_imagenet", 32, "cpu", False))
  plan = planner.make_plan(paper, profile, planner.PlannerConfig(policy="ED", num_vws=4))
  paper_times = task_times.task_times_from_plan(plan, profile, paper)
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
