"""The planner: cluster + profile -> allocation, partitions, Nm, parameter placement -> :class:`plan_format.Plan`.

Ties the planning layer together (HetPipe §4, §7, §8.1) and renders a plan as a text table. Planning layer:
standard library and numpy only; getting a profile (which may need jax) is the caller's job.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

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

  @property
  def recipe(self) -> "Recipe":
    """The planner recipe of ``method`` (:func:`recipe`)."""
    return recipe(self.method)


def allocation(cluster: ClusterSpec, policy: str, num_vws: int, costs: cost_model.StageCosts | None = None):
  """The GPUs of each VW under ``policy`` (NP / ED / HD; ``auto`` needs ``costs``: HetPipe's searched split)."""
  if policy == "auto":
    system = allocator.allocate(cluster, costs, "auto", num_vws)
    return [list(vw.partition.gpus) for vw in system.virtual_workers]
  if policy not in ("NP", "ED", "HD"):
    raise allocator.AllocationError(f"unknown policy {policy!r}: must be one of {list(allocator.POLICIES)}")
  return {"NP": allocator.allocate_np, "ED": allocator.allocate_ed, "HD": allocator.allocate_hd}[policy](
      cluster, num_vws)


def _method_cost(config: PlannerConfig) -> cost_model.CostModelConfig:
  return dataclasses.replace(config.cost, method=config.method, remat=config.remat)


def _method_allocation(cluster: ClusterSpec, profile: ModelProfile, config: PlannerConfig):
  hetpipe_costs = cost_model.build_stage_costs(profile, cluster, config.cost) if config.policy == "auto" else None
  return allocation(cluster, config.policy, config.num_vws, hetpipe_costs)


def _ps_plan(mp: method_planner.MethodSystemPlan, cluster: ClusterSpec, profile: ModelProfile, config: PlannerConfig,
             cost: cost_model.CostModelConfig) -> plan_format.Plan:
  """A WSP method's plan file: both parameter placements, ``config.ps_placement`` chosen."""
  system = mp.system
  parts = [vw.partition for vw in system.virtual_workers]
  placements = [ps_placement.place(p, cluster, profile, parts, system.num_inflight) for p in ps_placement.PLACEMENTS]
  return plan_format.make_plan(system, cluster, profile, placements, config.ps_placement, cost, config.method,
                               mp.notes)


def _allreduce_plan(mp: method_planner.MethodSystemPlan, profile: ModelProfile, cluster: ClusterSpec,
                    config: PlannerConfig, cost: cost_model.CostModelConfig) -> plan_format.Plan:
  """An all-reduce method's plan file: no PS, the step's cross-node bytes, each VW's rate read from its flush step
  (:func:`method_planner.flush_step_s`)."""
  system = mp.system
  parts = [vw.partition for vw in system.virtual_workers]
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
  return dataclasses.replace(plan, virtual_workers=vws_out)


def _plan_hetpipe(cluster: ClusterSpec, profile: ModelProfile, config: PlannerConfig,
                  allocations: dict | None = None) -> plan_format.Plan:
  """HetPipe: the allocation policy, Nm and partitions (:mod:`allocator`), both parameter placements.

  ``allocations``: see :func:`make_plan`; the allocation never reads ``ps_placement`` (both placements are computed
  for every plan and ``ps_placement`` only names the plan's choice), so a config that differs only in it reuses the
  kept allocation, or its AllocationError (``auto``'s search runs once), and gets the plan it would get alone.
  """
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
  return plan_format.make_plan(system, cluster, profile, placements, config.ps_placement, config.cost)


def _plan_pipedream(cluster: ClusterSpec, profile: ModelProfile, config: PlannerConfig,
                    allocations: dict | None = None) -> plan_format.Plan:  # pylint: disable=unused-argument
  """PipeDream: NOAM within memory on the policy's allocation (:func:`method_planner.plan_pipedream`)."""
  cost = _method_cost(config)
  vws = _method_allocation(cluster, profile, config)
  mp = method_planner.plan_pipedream(cluster, profile, vws, config.policy, cost, config.num_inflight)
  return _ps_plan(mp, cluster, profile, config, cost)


def _plan_flush(cluster: ClusterSpec, profile: ModelProfile, config: PlannerConfig,
                allocations: dict | None = None) -> plan_format.Plan:  # pylint: disable=unused-argument
  """GPipe / 1F1B-flush: the best M on the policy's allocation (:func:`method_planner.plan_flush`)."""
  cost = _method_cost(config)
  vws = _method_allocation(cluster, profile, config)
  mp = method_planner.plan_flush(cluster, profile, vws, config.policy, config.method, cost, config.num_inflight)
  return _allreduce_plan(mp, profile, cluster, config, cost)


def _plan_horovod(cluster: ClusterSpec, profile: ModelProfile, config: PlannerConfig,
                  allocations: dict | None = None) -> plan_format.Plan:  # pylint: disable=unused-argument
  """Horovod: every GPU that holds the model (:func:`method_planner.plan_horovod`); ignores policy and num_vws."""
  cost = _method_cost(config)
  mp = method_planner.plan_horovod(cluster, profile, cost, config.num_inflight or 1)
  return _allreduce_plan(mp, profile, cluster, config, cost)


def _plan_sharded(cluster: ClusterSpec, profile: ModelProfile, config: PlannerConfig,
                  allocations: dict | None = None) -> plan_format.Plan:  # pylint: disable=unused-argument
  raise ValueError(f"method {config.method!r} has no plan file: it is planned by "
                   "hetpipe_jax.costs.fsdp_cost.plan_fsdp (hetpipe_jax.compare lists it)")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How the planner plans the methods whose ``Method.planner`` names it.

  Attributes:
    plan: ``(cluster, profile, config, allocations) -> Plan`` (not yet validated; ``allocations``: see
      :func:`make_plan`).
    ps_placements: the plan records the parameter placements (WSP); else ``ps_placement`` is the all-reduce's
      record.
    num_inflight_by_engine: Nm may be chosen by running the engine on every candidate
      (``compare.choose_num_inflight_by_engine``: the allocator's Max_m per VW, NP / ED / HD).
  """

  plan: Callable[[ClusterSpec, ModelProfile, PlannerConfig, dict | None], plan_format.Plan]
  ps_placements: bool
  num_inflight_by_engine: bool = False


RECIPES = {
    "hetpipe": Recipe(_plan_hetpipe, ps_placements=True, num_inflight_by_engine=True),
    "pipedream": Recipe(_plan_pipedream, ps_placements=True),
    "flush": Recipe(_plan_flush, ps_placements=False),
    "horovod": Recipe(_plan_horovod, ps_placements=False),
    "sharded": Recipe(_plan_sharded, ps_placements=False),
}


def recipe(method: str) -> Recipe:
  """The planner recipe of ``method`` (``Method.planner``).

  Raises:
    ValueError: unknown method.
  """
  return RECIPES[methods.get_method(method).planner]


def make_plan(cluster: ClusterSpec, profile: ModelProfile, config: PlannerConfig,
              allocations: dict | None = None) -> plan_format.Plan:
  """Plans ``profile``'s model on ``cluster`` with the method's recipe (:data:`RECIPES`).

  Args:
    allocations: a dict shared by calls with this same ``cluster`` and ``profile`` (e.g. one ``compare``): the
      hetpipe recipe keeps each allocation (stage costs and ``allocator.allocate``'s system plan) there by its config
      less ``ps_placement`` and reuses it; the other recipes ignore it.

  Raises:
    allocator.AllocationError: the policy does not apply or the model fits no allocation.
    ValueError: unknown parameter placement, or a method without a plan file (fsdp).
  """
  if config.ps_placement not in ps_placement.PLACEMENTS:
    raise ValueError(f"unknown parameter placement {config.ps_placement!r}: must be one of "
                     f"{list(ps_placement.PLACEMENTS)}")
  plan = config.recipe.plan(cluster, profile, config, allocations)
  plan_format.validate_plan(plan)
  return plan


def format_table(plan: plan_format.Plan) -> str:
  """A human-readable table of ``plan``: per VW and stage the GPU, layers, time and memory; totals; traffic."""
  method = methods.get_method(plan.method)
  lines = [f"plan: method={plan.method} model={plan.model} batch_size={plan.batch_size} cluster={plan.cluster} "
           f"policy={plan.policy} num_vws={len(plan.virtual_workers)} "
           + _INFLIGHT_TEXT[method.inflight_name].format(plan.num_inflight),
           f"{'VW':>2} {'stage':>5}  {'GPU':<9} {'type':<17} {'layers':<10} {'time ms':>8}  "
           f"{'memory / capacity GiB':>21}"]
  for vw in plan.virtual_workers:
    for s, (gid, gtype, (i, j), t, m, c) in enumerate(zip(vw.gpus, vw.gpu_types, vw.partition, vw.stage_time_ms,
                                                          vw.stage_memory_bytes, vw.stage_capacity_bytes)):
      lines.append(f"{vw.vw_id:>2} {s:>5}  {gid:<9} {gtype:<17} {f'[{i}, {j})':<10} {t:>8.1f}  "
                   f"{m / GIB:>9.2f} / {c / GIB:>9.2f}")
    lines.append(f"   VW {vw.vw_id}: Max_m={vw.max_num_inflight} saturating Nm={vw.saturating_num_inflight} "
                 f"predicted {vw.predicted_minibatches_per_s:.2f} minibatches/s at Nm={plan.num_inflight}")
  lines += _TOTALS[method.sync](plan)
  lines += list(plan.notes)
  return "\n".join(lines)


def _allreduce_totals(plan: plan_format.Plan) -> list[str]:
  total = plan.predicted_total_minibatches_per_s
  return [f"total: {total:.2f} minibatches/s ({total * plan.batch_size:.0f} examples/s) = num_vws / (slowest "
          f"VW's step + all-reduce {plan.ps_placement['allreduce_s'] * 1e3:.1f} ms) (all-reduce BSP)",
          f" bytes crossing nodes per step: all-reduce "
          f"{plan.ps_placement['allreduce_bytes_crossing_nodes_per_step'] / MIB:9.1f} MiB + activations "
          f"{plan.ps_placement['activation_bytes_crossing_nodes_per_wave'] / MIB:9.1f} MiB"]


def _wsp_totals(plan: plan_format.Plan) -> list[str]:
  total = plan.predicted_total_minibatches_per_s
  lines = [f"total: {total:.2f} minibatches/s ({total * plan.batch_size:.0f} examples/s) = num_vws x slowest "
           f"VW (WSP)"]
  for name, p in plan.ps_placement["alternatives"].items():
    mark = "*" if name == plan.ps_placement["policy"] else " "
    lines.append(f"{mark}bytes crossing nodes per wave, {name:<7} placement: PS "
                 f"{p['ps_bytes_crossing_nodes_per_wave'] / MIB:9.1f} MiB + activations "
                 f"{p['activation_bytes_crossing_nodes_per_wave'] / MIB:9.1f} MiB = "
                 f"{p['total_bytes_crossing_nodes_per_wave'] / MIB:9.1f} MiB")
  return lines


# Per ``Method.inflight_name``: the table header's num_inflight; per ``Method.sync``: its totals and traffic lines.
_INFLIGHT_TEXT = {"M": "micro-batches per step (M)={} (stage times per micro-batch)", "Nm": "num_inflight(Nm)={}"}
_TOTALS = {"allreduce": _allreduce_totals, "wsp": _wsp_totals}
