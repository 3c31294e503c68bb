"""The schedule-based in-flight memory bound of a HetPipe partition (HetPipe §4 "Partition Scheduling", §7).

``CostModelConfig.inflight_memory`` chooses how many minibatches a ``hetpipe`` stage is counted to hold (a stage
*holds* minibatch p from the dispatch of its forward of p until its backward of p ends: p's activations/stash):

* ``"conservative"`` (default): Nm on every non-last stage (``cost_model.max_inflight_per_stage``). Safe whatever the
  task times; tight over all task times (a slow stage after fast ones holds all Nm).
* ``"schedule"``: per stage, the peak the schedule rules themselves produce at the partition's own task times
  (:func:`schedule_held_per_stage`). Computed by running the one implementation of the rules
  (``rules.schedule.PipelineRules``, driven by the event engine ``sim.engine``: per GPU forwards in order, backwards
  in order, FIFO among ready tasks, the last stage's forward+backward as one task, at most Nm minibatches in flight)
  on one virtual worker for :func:`num_minibatches_for_bound` minibatches from an empty pipeline, and taking each
  stage's ``PipelineRules.peak_held``.

Why it is safe, and its limits. With deterministic task times the run is a deterministic function of the times, so
the engine run *is* what the runtime does at those times: the start-up burst (Nm minibatches injected into an empty
pipeline at once, the largest queue a stage can see) and then the steady state, which for fixed times is periodic
after a transient; the run is long enough (``4 S Nm + 4 Nm`` minibatches, tested against 4x longer runs) for the
peak to have been seen. It is a peak *observed* by the rules, so it is also reached (a lower bound: some run at the
plan's times attains it). At other times (jitter, WSP waits that pause injection and then inject a burst into a partly
drained pipeline) a stage could hold more, so the plan records the counts (``VirtualWorkerEntry.held_per_stage``) and
a run of a ``schedule`` plan at its Nm *enforces* them (``plan_format.memory_caps`` ->
``schedule.PipelineRules(max_held=...)`` in the runtime, the engine and virtual time): a forward that would exceed
its stage's count waits for a backward there, which may pass it (no deadlock: tests/test_memory_caps.py checks random
instances with jitter and WSP). At the plan's own times the caps never bind (the engine's predictions are unchanged);
at other times they cost throughput instead of memory. The planner's default stays ``"conservative"`` (no caps
needed, throughput never limited by them); the paper experiments use ``"schedule"`` (``experiments/paper/common.py``).

Weight versions are not tightened: the runtime keeps each in-flight minibatch's version of every stage until it
completes (see ``StageCosts.memory_matrix_bytes``).

The partitioner (:mod:`hetpipe_jax.planning.partitioner`, a layer above) uses the bound through
:func:`self_consistent_partition`: the partition it returns fits every GPU's memory with each stage holding its own
schedule peak. Simulation layer: standard library and numpy.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from hetpipe_jax.costs import task_times
from hetpipe_jax.costs.cluster import Gpu
from hetpipe_jax.costs.cost_model import StageCosts
from hetpipe_jax.sim import engine


def num_minibatches_for_bound(num_stages: int, num_inflight: int) -> int:
  """Minibatches of the run :func:`schedule_held_per_stage` takes its peaks from: ``4 S Nm + 4 Nm``."""
  return 4 * num_stages * num_inflight + 4 * num_inflight


def schedule_held_per_stage(costs: StageCosts, gpus: Sequence[Gpu], ranges: Sequence[Sequence[int]],
                            num_inflight: int, num_minibatches: int | None = None) -> tuple[int, ...]:
  """Per stage, the most minibatches it holds under HetPipe's schedule rules at this partition's task times.

  Args:
    costs: per-range costs (with ``forward_prefix_ms``, as ``cost_model.build_stage_costs`` builds them).
    gpus: the GPUs in stage order.
    ranges: each stage's half-open layer range.
    num_inflight: Nm >= 1.
    num_minibatches: length of the run (None: :func:`num_minibatches_for_bound`).

  Returns:
    ``[S]`` ints in ``[1, Nm]`` (the last stage's is 1), stage 0 first.

  Raises:
    ValueError: ``costs`` has no forward times (built by hand), or Nm < 1.
  """
  if costs.forward_prefix_ms is None:
    raise ValueError("inflight_memory='schedule' needs the forward/backward split of each stage: build the costs "
                     "with cost_model.build_stage_costs (StageCosts.forward_prefix_ms is None)")
  if num_inflight < 1:
    raise ValueError(f"num_inflight must be >= 1, got {num_inflight}")
  times = task_times.vw_task_times(list(gpus), ranges, costs, costs.forward_prefix_ms, None)
  return held_peaks_for_times(times, num_inflight, num_minibatches)


def held_peaks_for_times(times, num_inflight: int, num_minibatches: int | None = None) -> tuple[int, ...]:
  """Per stage, ``PipelineRules.peak_held`` of one virtual worker run by the event engine from an empty pipeline
  with these task times (``costs.task_times.VWTaskTimes``; its PS transfers are ignored: D = 0 and one VW, so no
  wave waits), for ``num_minibatches`` (None: :func:`num_minibatches_for_bound`) minibatches.

  Raises:
    ValueError: Nm < 1.
  """
  if num_inflight < 1:
    raise ValueError(f"num_inflight must be >= 1, got {num_inflight}")
  n = num_minibatches or num_minibatches_for_bound(times.num_stages, num_inflight)
  times = dataclasses.replace(times, push_s=0.0, pull_s=0.0)
  config = engine.EngineConfig(num_waves=-(-n // num_inflight), num_inflight=num_inflight, staleness_bound=0,
                               records=False)
  return tuple(int(h) for h in engine.run([times], config).vws[0].peak_inflight_per_stage)


def self_consistent_partition(solve: Callable[[tuple[int, ...]], "object | None"],
                              held_of: Callable[[object], tuple[int, ...]], num_stages: int, num_inflight: int):
  """A partition that fits memory when each stage holds its own schedule peak, or None when the search finds none.

  Fixed-point search over the per-position held counts ``h`` (``[S]``): start from ``h = 1`` on every stage; solve
  the partition problem with stage s counted to hold ``h[s]`` (``solve(h)``, optimal for that ``h``); take the
  result's own peaks ``p = held_of(partition)``; if ``p <= h`` on every stage it fits memory at its own peaks
  (memory grows with the held count) and is returned; else ``h = max(h, p)`` and repeat. ``h`` only grows and is
  at most Nm (the conservative count), so the search ends within ``S * Nm`` rounds. Every ``h`` is at most the
  conservative count, so each round relaxes the conservative problem: None means the conservative count fits no
  partition either, and the returned partition's largest stage time is at most the conservative optimum's. Not
  exhaustive: a partition with a smaller largest stage time that fits at its own peaks may exist.

  Args:
    solve: ``h`` -> the optimal partition with stage s holding ``h[s]``, or None when none fits.
    held_of: partition -> its per-stage schedule peaks (:func:`schedule_held_per_stage`).
    num_stages: S.
    num_inflight: Nm.
  """
  h = np.ones(num_stages, dtype=int)
  while True:
    part = solve(tuple(int(x) for x in h))
    if part is None:
      return None
    peaks = np.asarray(held_of(part), dtype=int)
    if np.all(peaks <= h):
      return part
    h = np.minimum(np.maximum(h, peaks), num_inflight)
