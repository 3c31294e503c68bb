"""Planning the methods other than HetPipe: PipeDream's Nm, GPipe / 1F1B-flush's M, Horovod's GPUs.

Planning layer: standard library and numpy only. Each method's memory model is the cost model's
(``CostModelConfig.method``); this module chooses what the method leaves open and returns the allocator's
:class:`~hetpipe_jax.planning.system_plan.SystemPlan`, so :func:`hetpipe_jax.planning.planner.make_plan` writes every
method's plan in one format (``Plan.method``).

* ``pipedream``: Nm defaults to PipeDream's NOAM for the VW (``ceil(#GPUs / #GPUs of the input stage)`` = S for a
  straight pipeline of one GPU per stage), lowered to the largest Nm that fits memory when NOAM does not; every VW
  uses the system's (smallest) value, as WSP needs one Nm. Partitions minimise the slowest stage (the partitioner).
* ``gpipe`` / ``1f1b_flush``: for each M dividing the minibatch (up to :data:`MAX_MICROBATCHES`) every VW is
  partitioned on the micro-batch profile with the method's memory; a step of VW v takes about
  ``sum_s t_s + (M - 1) * max_s t_s`` (fill plus steady state of M micro-batches; ``(M + S - 1) t`` on equal
  stages) and all-reduce BSP holds every VW to the slowest plus the all-reduce (:mod:`allreduce_cost`), so the
  system runs ``N * M / (max_v step_v + allreduce)`` micro-batches per second. The M with the highest rate wins
  (smallest on ties); ``num_microbatches`` fixes it instead.
* ``horovod``: every GPU whose memory holds the whole model (weights, gradients, optimizer state, one minibatch's
  activations) is a one-stage VW; the others are left out, each with its reason (``notes``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from hetpipe_jax.costs import allreduce_cost
from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs.cluster import ClusterSpec, Gpu
from hetpipe_jax.costs.profile_format import ModelProfile, micro_batch_profile
from hetpipe_jax.planning import inflight
from hetpipe_jax.planning.partitioner import InfeasiblePartitionError, PartitionProblem, partition_dp
from hetpipe_jax.planning.system_plan import AllocationError, SystemPlan, VirtualWorkerPlan
from hetpipe_jax.rules import methods

MAX_MICROBATCHES = 32
GIB = float(2**30)


def microbatch_candidates(batch_size: int, limit: int = MAX_MICROBATCHES) -> list[int]:
  """Every M that divides ``batch_size``, up to ``limit``, ascending."""
  return [m for m in range(1, min(batch_size, limit) + 1) if batch_size % m == 0]


def noam(gpus_per_stage: Sequence[int]) -> int:
  """PipeDream's NOAM: ``ceil(#GPUs / #GPUs of the input stage)`` (S for one GPU per stage)."""
  return math.ceil(sum(gpus_per_stage) / gpus_per_stage[0])


def flush_step_s(stage_time_ms: Sequence[float], num_microbatches: int) -> float:
  """Seconds of one step of M micro-batches through stages of these per-micro-batch times (ms): ``sum_s t_s +
  (M - 1) * max_s t_s``."""
  return (sum(stage_time_ms) + (num_microbatches - 1) * max(stage_time_ms)) / 1e3


@dataclasses.dataclass(frozen=True)
class MethodSystemPlan:
  """A method's system plan plus what the plan file records beyond the allocator's.

  Attributes:
    system: allocation, partitions, Nm or M, predicted minibatches/s (whole minibatches of ``batch_size``).
    costs: the stage costs the partitions were made with (the micro-batch profile's for the flush methods).
    allreduce_s: one step's all-reduce (all-reduce methods; 0 otherwise).
    notes: e.g. the GPUs Horovod leaves out, with their reasons.
  """

  system: SystemPlan
  costs: cost_model.StageCosts
  allreduce_s: float = 0.0
  notes: tuple[str, ...] = ()


def _class_cached_partition(cache: dict, costs, gpus: Sequence[Gpu], n: int):
  key = (tuple(sorted(g.gpu_class for g in gpus)), n)
  if key not in cache:
    try:
      cache[key] = partition_dp(PartitionProblem(costs, tuple(gpus), n))
    except InfeasiblePartitionError as e:
      cache[key] = e
  part = cache[key]
  if isinstance(part, InfeasiblePartitionError):
    return part
  pool: dict = {}
  for g in sorted(gpus, key=lambda g: g.gpu_id):
    pool.setdefault(g.gpu_class, []).append(g)
  return dataclasses.replace(part, gpus=tuple(pool[g.gpu_class].pop(0) for g in part.gpus))


def plan_pipedream(cluster: ClusterSpec, profile: ModelProfile, vws: Sequence[Sequence[Gpu]], policy: str,
                   config: cost_model.CostModelConfig, num_inflight: int = 0) -> MethodSystemPlan:
  """PipeDream on the given allocation: Nm = NOAM (or ``num_inflight``) within memory, WSP across VWs.

  Raises:
    AllocationError: a VW fits no partition even with Nm = 1.
  """
  costs = cost_model.build_stage_costs(profile, cluster, dataclasses.replace(config, method="pipedream"))
  planners = [inflight.VwPlanner(costs, gpus) for gpus in vws]
  for v, p in enumerate(planners):
    if p.max_num_inflight() == 0:
      raise AllocationError(f"pipedream: virtual worker {v} fits no partition even with num_inflight=1: "
                            f"{p.infeasibility(1)}")
  want = num_inflight or min(noam([1] * len(gpus)) for gpus in vws)
  nm = min(want, min(p.max_num_inflight() for p in planners))
  out = []
  for v, (gpus, p) in enumerate(zip(vws, planners)):
    out.append(VirtualWorkerPlan(v, p.partition(nm), p.max_num_inflight(), nm))
  # PipeDream's steady state is its slowest stage (1F1B keeps every stage busy once Nm >= NOAM); WSP holds the
  # system to the slowest VW.
  total = len(vws) * min(o.partition.throughput_per_s for o in out)
  notes = () if nm == want else (f"pipedream: Nm lowered from NOAM={want} to {nm} (memory)",)
  return MethodSystemPlan(SystemPlan(policy, nm, tuple(out), total), costs, 0.0, notes)


def plan_flush(cluster: ClusterSpec, profile: ModelProfile, vws: Sequence[Sequence[Gpu]], policy: str, method: str,
               config: cost_model.CostModelConfig, num_microbatches: int = 0) -> MethodSystemPlan:
  """GPipe / 1F1B-flush / Horovod (one-stage VWs) with all-reduce BSP on the given allocation (module docstring).

  Raises:
    AllocationError: no M fits every VW's memory.
  """
  spec = methods.get_method(method)
  if not spec.is_flush:
    raise ValueError(f"method {method!r} has no flush")
  cfg = dataclasses.replace(config, method=method)
  candidates = [num_microbatches] if num_microbatches else microbatch_candidates(profile.batch_size)
  best, feasible, errors = None, [], []
  for m in candidates:
    costs = cost_model.build_stage_costs(micro_batch_profile(profile, m), cluster, cfg)
    cache: dict = {}
    parts = [_class_cached_partition(cache, costs, gpus, m) for gpus in vws]
    bad = [(v, p) for v, p in enumerate(parts) if isinstance(p, InfeasiblePartitionError)]
    if bad:
      errors.append(f"M={m}: virtual worker {bad[0][0]}: {bad[0][1]}")
      continue
    feasible.append(m)
    t_ar = allreduce_cost.allreduce_time_s([(p.gpus, p.ranges) for p in parts], profile, cluster)
    steps = [flush_step_s(p.stage_time_ms, m) for p in parts]
    step = max(steps) + t_ar
    total_mb = len(vws) / step  # whole minibatches (M micro-batches) per second, all VWs
    if best is None or total_mb > best[0] * (1 + 1e-9):
      best = (total_mb, m, parts, costs, t_ar, steps)
  if best is None:
    raise AllocationError(f"{method}: no number of micro-batches fits memory; {errors[0] if errors else ''}")
  total_mb, m, parts, costs, t_ar, steps = best
  out = tuple(VirtualWorkerPlan(v, p, max(feasible), m) for v, p in enumerate(parts))
  system = SystemPlan(policy, m, out, total_mb)
  del steps
  return MethodSystemPlan(system, costs, t_ar)


def horovod_gpus(cluster: ClusterSpec, profile: ModelProfile,
                 config: cost_model.CostModelConfig) -> tuple[list[Gpu], list[str]]:
  """The GPUs that hold the whole model for Horovod (one minibatch), and a reason for each GPU left out."""
  costs = cost_model.build_stage_costs(profile, cluster, dataclasses.replace(config, method="horovod"))
  need = costs.stage_memory_bytes(0, profile.num_layers, True, 1, 1)
  used, notes = [], []
  for g in cluster.gpus():
    cap = costs.capacity_bytes[g.gpu_type]
    if need <= cap:
      used.append(g)
    else:
      notes.append(f"horovod leaves out {g.gpu_id} ({g.gpu_type}): the whole model at batch {profile.batch_size} "
                   f"needs {need / GIB:.2f} GiB > {cap / GIB:.2f} GiB usable")
  return used, notes


def plan_horovod(cluster: ClusterSpec, profile: ModelProfile, config: cost_model.CostModelConfig,
                 num_microbatches: int = 1) -> MethodSystemPlan:
  """Horovod: one-stage VWs on every GPU that holds the model (:func:`horovod_gpus`), all-reduce BSP.

  Raises:
    AllocationError: no GPU holds the model.
  """
  used, notes = horovod_gpus(cluster, profile, config)
  if not used:
    raise AllocationError("horovod: no GPU holds the whole model; " + "; ".join(notes))
  plan = plan_flush(cluster, profile, [[g] for g in used], "horovod", "horovod", config, num_microbatches or 1)
  return dataclasses.replace(plan, notes=tuple(notes))
