"""The planner: cluster + profile -> allocation, partitions, Nm, parameter placement -> :class:`plan_format.Plan`.

Ties the planning layer together (HetPipe §4, §7, §8.1) and renders a plan as a text table. Planning layer:
standard library and numpy only; getting a profile (which may need jax) is the caller's job.
"""

from __future__ import annotations

import dataclasses

from hetpipe_jax.planning import allocator
from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs import allreduce_cost
from hetpipe_jax.planning import inflight
from hetpipe_jax.planning import method_planner
from hetpipe_jax.planning import plan_format
from hetpipe_jax.planning import ps_placement
from hetpipe_jax.costs.cluster import ClusterSpec
from hetpipe_jax.costs.profile_format import ModelProfile
from hetpipe_jax.rules import methods

MIB = float(2**20)
GIB = float(2**30)


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
  """What to plan.

  Attributes:
    policy: "NP", "ED", "HD" or "auto" (HetPipe §8.1).
    num_vws: number of virtual workers.
    ps_placement: "default" or "local" parameter placement recorded as the plan's choice (both are reported).
    max_num_inflight: cap on the Nm search.
    max_vw_gpus: ``auto`` only: the largest virtual worker searched (None: the documented default,
      ``allocator.default_max_vw_gpus``); the value used is recorded in the plan's ``allocation_search``.
    cost: cost-model configuration (its ``method`` is set from ``method``).
    method: the training method (:mod:`hetpipe_jax.rules.methods`); ``horovod`` ignores ``policy`` and
      ``num_vws`` (one VW per GPU that holds the model).
    num_inflight: hetpipe (NP / ED / HD): Nm (0: the planner's choice, ``inflight.choose_system_num_inflight``);
      pipedream: Nm (0: NOAM); gpipe / 1f1b_flush / horovod: M, micro-batches per step (0: the best that fits,
      :mod:`method_planner`; Horovod: 1).
    remat: gpipe / 1f1b_flush: rematerialisation per stage (memory model).
  """

  policy: str = "ED"
  num_vws: int = 4
  ps_placement: str = "default"
  max_num_inflight: int = inflight.DEFAULT_MAX_NUM_INFLIGHT
  max_vw_gpus: int | None = None
  cost: cost_model.CostModelConfig = cost_model.CostModelConfig()
  method: str = "hetpipe"
  num_inflight: int = 0
  remat: bool = False


def allocation(cluster: ClusterSpec, policy: str, num_vws: int, costs: cost_model.StageCosts | None = None):
  """The GPUs of each VW under ``policy`` (NP / ED / HD; ``auto`` needs ``costs``: HetPipe's searched split)."""
  if policy == "auto":
    system = allocator.allocate(cluster, costs, "auto", num_vws)
    return [list(vw.partition.gpus) for vw in system.virtual_workers]
  if policy not in ("NP", "ED", "HD"):
    raise allocator.AllocationError(f"unknown policy {policy!r}: must be one of {list(allocator.POLICIES)}")
  return {"NP": allocator.allocate_np, "ED": allocator.allocate_ed, "HD": allocator.allocate_hd}[policy](
      cluster, num_vws)


def _make_method_plan(cluster: ClusterSpec, profile: ModelProfile, config: PlannerConfig) -> plan_format.Plan:
  """Plans a method other than HetPipe (:mod:`method_planner`)."""
  if methods.get_method(config.method).sharded:
    raise ValueError(f"method {config.method!r} has no plan file: it is planned by "
                     "hetpipe_jax.costs.fsdp_cost.plan_fsdp (hetpipe_jax.compare lists it)")
  cost = dataclasses.replace(config.cost, method=config.method, remat=config.remat)
  if config.method == "horovod":
    mp = method_planner.plan_horovod(cluster, profile, cost, config.num_inflight or 1)
  else:
    hetpipe_costs = cost_model.build_stage_costs(profile, cluster, config.cost) if config.policy == "auto" else None
    vws = allocation(cluster, config.policy, config.num_vws, hetpipe_costs)
    if config.method == "pipedream":
      mp = method_planner.plan_pipedream(cluster, profile, vws, config.policy, cost, config.num_inflight)
    else:
      mp = method_planner.plan_flush(cluster, profile, vws, config.policy, config.method, cost, config.num_inflight)
  system = mp.system
  parts = [vw.partition for vw in system.virtual_workers]
  if config.method == "pipedream":
    placements = [ps_placement.place(p, cluster, profile, parts, system.num_inflight) for p in ps_placement.PLACEMENTS]
    plan = plan_format.make_plan(system, cluster, profile, placements, config.ps_placement, cost, config.method,
                                 mp.notes)
  else:
    m = system.num_inflight
    vws_ranges = [(p.gpus, p.ranges) for p in parts]
    act = sum(2 * profile.layers[p.ranges[s][1] - 1].output_activation_bytes
              for p in parts for s in range(len(p.gpus) - 1) if p.gpus[s].node != p.gpus[s + 1].node)
    ar_bytes = allreduce_cost.allreduce_cross_node_bytes(vws_ranges, profile)
    ps = {"policy": "none (all-reduce)", "layer_to_node": [None] * profile.num_layers,
          "ps_bytes_crossing_nodes_per_wave": 0, "activation_bytes_crossing_nodes_per_wave": act,
          "allreduce_bytes_crossing_nodes_per_step": ar_bytes, "total_bytes_crossing_nodes_per_wave": act + ar_bytes,
          "allreduce_s": mp.allreduce_s, "alternatives": {}}
    plan = plan_format.make_plan(system, cluster, profile, [], "", cost, config.method, mp.notes, ps)
    vws_out = tuple(dataclasses.replace(
        e, predicted_minibatches_per_s=round(1.0 / method_planner.flush_step_s(e.stage_time_ms, m), 6))
        for e in plan.virtual_workers)
    plan = dataclasses.replace(plan, virtual_workers=vws_out)
  plan_format.validate_plan(plan)
  return plan


def make_plan(cluster: ClusterSpec, profile: ModelProfile, config: PlannerConfig,
              allocations: dict | None = None) -> plan_format.Plan:
  """Plans ``profile``'s model on ``cluster``.

  Args:
    allocations: hetpipe only: a dict shared by calls with this same ``cluster`` and ``profile`` (e.g. one
      ``compare``), keeping each allocation (stage costs and ``allocator.allocate``'s system plan) by its config
      less ``ps_placement``: the allocation never reads the placement (both placements are computed for every
      plan and ``ps_placement`` only names the plan's choice), so a second placement of the same config reuses the
      first one's allocation, or its AllocationError (``auto``'s search runs once), and gets the plan it would get
      alone.

  Raises:
    allocator.AllocationError: the policy does not apply or the model fits no allocation.
    ValueError: unknown parameter placement.
  """
  if config.ps_placement not in ps_placement.PLACEMENTS:
    raise ValueError(f"unknown parameter placement {config.ps_placement!r}: must be one of "
                     f"{list(ps_placement.PLACEMENTS)}")
  if config.method != "hetpipe":
    return _make_method_plan(cluster, profile, config)
  key = dataclasses.replace(config, ps_placement="default")
  if allocations is None or key not in allocations:
    costs = cost_model.build_stage_costs(profile, cluster, config.cost)
    try:
      found = costs, allocator.allocate(cluster, costs, config.policy, config.num_vws, config.max_num_inflight,
                                        config.max_vw_gpus, num_inflight=config.num_inflight)
    except allocator.AllocationError as e:
      found = e
    if allocations is not None:
      allocations[key] = found
  else:
    found = allocations[key]
  if isinstance(found, allocator.AllocationError):
    raise found
  costs, system = found
  parts = [vw.partition for vw in system.virtual_workers]
  placements = [ps_placement.place(p, cluster, profile, parts, system.num_inflight)
                for p in ps_placement.PLACEMENTS]
  plan = plan_format.make_plan(system, cluster, profile, placements, config.ps_placement, config.cost)
  plan_format.validate_plan(plan)
  return plan


def format_table(plan: plan_format.Plan) -> str:
  """A human-readable table of ``plan``: per VW and stage the GPU, layers, time and memory; totals; traffic."""
  flush = plan.method in ("gpipe", "1f1b_flush", "horovod")
  lines = [f"plan: method={plan.method} model={plan.model} batch_size={plan.batch_size} cluster={plan.cluster} "
           f"policy={plan.policy} num_vws={len(plan.virtual_workers)} "
           + (f"micro-batches per step (M)={plan.num_inflight} (stage times per micro-batch)" if flush else
              f"num_inflight(Nm)={plan.num_inflight}"),
           f"{'VW':>2} {'stage':>5}  {'GPU':<9} {'type':<17} {'layers':<10} {'time ms':>8}  "
           f"{'memory / capacity GiB':>21}"]
  for vw in plan.virtual_workers:
    for s, (gid, gtype, (i, j), t, m, c) in enumerate(zip(vw.gpus, vw.gpu_types, vw.partition, vw.stage_time_ms,
                                                          vw.stage_memory_bytes, vw.stage_capacity_bytes)):
      lines.append(f"{vw.vw_id:>2} {s:>5}  {gid:<9} {gtype:<17} {f'[{i}, {j})':<10} {t:>8.1f}  "
                   f"{m / GIB:>9.2f} / {c / GIB:>9.2f}")
    lines.append(f"   VW {vw.vw_id}: Max_m={vw.max_num_inflight} saturating Nm={vw.saturating_num_inflight} "
                 f"predicted {vw.predicted_minibatches_per_s:.2f} minibatches/s at Nm={plan.num_inflight}")
  total = plan.predicted_total_minibatches_per_s
  if flush:
    lines.append(f"total: {total:.2f} minibatches/s ({total * plan.batch_size:.0f} examples/s) = num_vws / (slowest "
                 f"VW's step + all-reduce {plan.ps_placement['allreduce_s'] * 1e3:.1f} ms) (all-reduce BSP)")
    lines.append(f" bytes crossing nodes per step: all-reduce "
                 f"{plan.ps_placement['allreduce_bytes_crossing_nodes_per_step'] / MIB:9.1f} MiB + activations "
                 f"{plan.ps_placement['activation_bytes_crossing_nodes_per_wave'] / MIB:9.1f} MiB")
    lines += list(plan.notes)
    return "\n".join(lines)
  lines.append(f"total: {total:.2f} minibatches/s ({total * plan.batch_size:.0f} examples/s) = num_vws x slowest "
               f"VW (WSP)")
  for name, p in plan.ps_placement["alternatives"].items():
    mark = "*" if name == plan.ps_placement["policy"] else " "
    lines.append(f"{mark}bytes crossing nodes per wave, {name:<7} placement: PS "
                 f"{p['ps_bytes_crossing_nodes_per_wave'] / MIB:9.1f} MiB + activations "
                 f"{p['activation_bytes_crossing_nodes_per_wave'] / MIB:9.1f} MiB = "
                 f"{p['total_bytes_crossing_nodes_per_wave'] / MIB:9.1f} MiB")
  lines += list(plan.notes)
  return "\n".join(lines)
