"""The plan file: the planner's output that the runtime reads (PipeDream-style; HetPipe §4, §8.1).

A versioned JSON document: model, batch size, cluster, policy, the system Nm (``num_inflight``), per virtual
worker its GPUs in stage order (ids, types, device indices on their nodes), half-open layer ranges, predicted stage
times/memory, Max_m and throughput, and the parameter-server placement with the bytes crossing nodes per wave.

Planning layer: standard library only.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from hetpipe_jax.costs.cluster import ClusterSpec, node_local_index
from hetpipe_jax.costs.cost_model import CostModelConfig
from hetpipe_jax.costs.profile_format import ModelProfile
from hetpipe_jax.paths import write_json
from hetpipe_jax.planning.ps_placement import Placement
from hetpipe_jax.planning.system_plan import SystemPlan
from hetpipe_jax.rules import methods
from hetpipe_jax.rules.partition import validate_partition

PLAN_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class VirtualWorkerEntry:
  """One virtual worker of a plan (see the module docstring); lists are per stage, stage 0 first."""

  vw_id: int
  gpus: tuple[str, ...]
  gpu_types: tuple[str, ...]
  devices: tuple[int, ...]  # per stage, the GPU's device index on its node (ClusterSpec.device_index)
  partition: tuple[tuple[int, int], ...]
  stage_time_ms: tuple[float, ...]
  stage_memory_bytes: tuple[int, ...]
  stage_capacity_bytes: tuple[int, ...]
  max_num_inflight: int
  saturating_num_inflight: int
  predicted_minibatches_per_s: float
  # Per stage, the minibatches the stage was counted to hold in stage_memory_bytes (the partitioner's
  # held_per_stage; None in plans written before it was recorded). See memory_caps.
  held_per_stage: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """A whole plan. ``ps_placement``: the chosen placement's dict plus ``"alternatives"`` for every policy."""

  model: str
  batch_size: int
  cluster: str
  policy: str
  num_inflight: int
  num_layers: int
  virtual_workers: tuple[VirtualWorkerEntry, ...]
  predicted_total_minibatches_per_s: float
  ps_placement: dict[str, Any]
  cost_model: dict[str, Any]
  profile: dict[str, Any]
  format_version: int = PLAN_FORMAT_VERSION
  allocation_search: dict[str, Any] | None = None
  # The training method the plan is for (hetpipe_jax.rules.methods); plans written before methods existed are
  # HetPipe's. For the flush methods (gpipe, 1f1b_flush, horovod) ``num_inflight`` is M, the micro-batches per
  # step, and ``stage_time_ms`` is per micro-batch.
  method: str = "hetpipe"
  notes: tuple[str, ...] = ()  # e.g. the GPUs Horovod leaves out, with their reasons


def _placement_dict(p: Placement) -> dict[str, Any]:
  return {"policy": p.policy, "layer_to_node": list(p.layer_to_node),
          "ps_bytes_crossing_nodes_per_wave": p.ps_bytes_crossing_nodes_per_wave,
          "activation_bytes_crossing_nodes_per_wave": p.activation_bytes_crossing_nodes_per_wave,
          "total_bytes_crossing_nodes_per_wave": p.total_bytes_crossing_nodes_per_wave}


def make_plan(system: SystemPlan, cluster: ClusterSpec, profile: ModelProfile, placements: Sequence[Placement],
              chosen_placement: str, config: CostModelConfig, method: str = "hetpipe",
              notes: Sequence[str] = (), ps_placement: dict[str, Any] | None = None) -> Plan:
  """Assembles a :class:`Plan` from the allocator's result and the placements (the first is not special).

  ``ps_placement``: given instead of ``placements`` by the all-reduce methods (no PS; their traffic).
  """
  vws = []
  for vw in system.virtual_workers:
    p = vw.partition
    vws.append(VirtualWorkerEntry(
        vw_id=vw.vw_id, gpus=tuple(g.gpu_id for g in p.gpus), gpu_types=tuple(g.gpu_type for g in p.gpus),
        devices=tuple(cluster.device_index(g.gpu_id) for g in p.gpus), partition=p.ranges,
        stage_time_ms=tuple(round(t, 6) for t in p.stage_time_ms),
        stage_memory_bytes=tuple(int(m) for m in p.stage_memory_bytes),
        stage_capacity_bytes=tuple(int(c) for c in p.capacity_bytes), max_num_inflight=vw.max_num_inflight,
        saturating_num_inflight=vw.saturating_num_inflight,
        predicted_minibatches_per_s=round(p.throughput_per_s, 6),
        held_per_stage=tuple(int(h) for h in p.held_per_stage) if p.held_per_stage else None))
  if ps_placement is not None:
    ps = ps_placement
  else:
    by_policy = {pl.policy: _placement_dict(pl) for pl in placements}
    if chosen_placement not in by_policy:
      raise ValueError(f"placement {chosen_placement!r} was not computed; have {sorted(by_policy)}")
    # One shard per node, in the cluster's node order (``shard_nodes``: the runtime's shard i runs on that node).
    ps = dict(by_policy[chosen_placement], num_shards=len(cluster.nodes),
              shard_nodes=[nd.name for nd in cluster.nodes], alternatives=by_policy)
  return Plan(model=profile.model, batch_size=profile.batch_size, cluster=cluster.name, policy=system.policy,
              num_inflight=system.num_inflight, num_layers=profile.num_layers, virtual_workers=tuple(vws),
              predicted_total_minibatches_per_s=round(system.predicted_total_minibatches_per_s, 6),
              ps_placement=ps, cost_model=dataclasses.asdict(config),
              profile={"device_kind": profile.device_kind, "measured": profile.measured,
                       "optimizer": profile.optimizer},
              allocation_search=system.search, method=method, notes=tuple(notes))


def memory_caps(plan: Plan, num_inflight: int) -> tuple[tuple[int, ...], ...] | None:
  """Per VW, per stage, the most minibatches a stage may hold when ``plan`` runs at Nm = ``num_inflight``: the
  plan's ``held_per_stage`` when its memory was counted with ``inflight_memory="schedule"`` (each stage's peak
  under the schedule rules at the plan's task times, below Nm; :mod:`hetpipe_jax.sim.inflight_memory`) for a
  ``hetpipe`` plan run at the plan's own Nm. Enforced by ``schedule.PipelineRules`` (runtime, engine, virtual
  time), they make that memory count hold whatever the task times and WSP waits. None otherwise: the
  conservative count (Nm on every stage) needs no cap, and caps counted at another Nm do not apply.
  """
  if (not methods.get_method(plan.method).schedule_peaks or plan.cost_model.get("inflight_memory") != "schedule"
      or num_inflight != plan.num_inflight or any(vw.held_per_stage is None for vw in plan.virtual_workers)):
    return None
  return tuple(tuple(vw.held_per_stage) for vw in plan.virtual_workers)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
  d = dataclasses.asdict(plan)
  for vw in d["virtual_workers"]:
    vw["partition"] = [list(r) for r in vw["partition"]]
  return d


def write_plan(plan: Plan, path: str) -> None:
  """Writes ``plan`` as indented JSON (creating parent folders)."""
  write_json(plan_to_dict(plan), path)


def validate_plan(plan: Plan) -> None:
  """Checks internal consistency.

  Raises:
    ValueError: naming the virtual worker and the problem (partition gaps/overlaps, list lengths, a device index
      that is not an int >= 0, Nm above a VW's Max_m, no virtual workers).
  """
  if plan.format_version != PLAN_FORMAT_VERSION:
    raise ValueError(f"plan format_version {plan.format_version} is not supported (expected "
                     f"{PLAN_FORMAT_VERSION})")
  if not plan.virtual_workers:
    raise ValueError("plan has no virtual workers")
  if plan.num_inflight < 1:
    raise ValueError(f"plan num_inflight must be >= 1, got {plan.num_inflight}")
  methods.get_method(plan.method)
  for vw in plan.virtual_workers:
    s = len(vw.partition)
    try:
      validate_partition(vw.partition, plan.num_layers)
    except ValueError as e:
      raise ValueError(f"virtual worker {vw.vw_id}: {e}") from None
    for name in ("gpus", "gpu_types", "devices", "stage_time_ms", "stage_memory_bytes", "stage_capacity_bytes"):
      if len(getattr(vw, name)) != s:
        raise ValueError(f"virtual worker {vw.vw_id}: {name} has {len(getattr(vw, name))} entries for {s} stages")
    for gpu, device in zip(vw.gpus, vw.devices):
      if not isinstance(device, int) or device < 0:
        raise ValueError(f"virtual worker {vw.vw_id}: GPU {gpu} has device index {device!r}; a device index is an "
                         "int >= 0 (default: the GPU's index within its node): fix the plan's devices, or set the "
                         "cluster file's local_devices for it and re-plan")
    if plan.num_inflight > vw.max_num_inflight:
      raise ValueError(f"virtual worker {vw.vw_id}: num_inflight {plan.num_inflight} exceeds its "
                       f"max_num_inflight {vw.max_num_inflight}")
    held = vw.held_per_stage
    if held is not None and (len(held) != s or any(not 1 <= h <= max(plan.num_inflight, 1) for h in held)):
      raise ValueError(f"virtual worker {vw.vw_id}: held_per_stage {list(held)} must have one entry per stage "
                       f"({s}), each in [1, num_inflight={plan.num_inflight}]")


def _devices(vw: dict[str, Any]) -> tuple[int, ...]:
  """A VW entry's device index per stage; ``null`` (plans written before GPUs had a default index) is the GPU's
  index within its node (:func:`hetpipe_jax.costs.cluster.node_local_index`, the planner's default)."""
  devices, gpus = list(vw["devices"]), list(vw["gpus"])
  if len(devices) != len(gpus):
    return tuple(devices)  # validate_plan names the mismatch
  try:
    return tuple(node_local_index(g) if d is None else d for g, d in zip(gpus, devices))
  except ValueError as e:
    raise ValueError(f"virtual worker {vw.get('vw_id')}: {e}") from None


def plan_from_dict(d: dict[str, Any]) -> Plan:
  """Parses and validates a plan dict.

  Raises:
    ValueError: unsupported version, missing fields, or an inconsistent plan.
  """
  if d.get("format_version") != PLAN_FORMAT_VERSION:
    raise ValueError(f"plan format_version {d.get('format_version')!r} is not supported (expected "
                     f"{PLAN_FORMAT_VERSION})")
  try:
    vws = tuple(VirtualWorkerEntry(**{**vw, "gpus": tuple(vw["gpus"]), "gpu_types": tuple(vw["gpu_types"]),
                                      "devices": _devices(vw),
                                      "partition": tuple(tuple(r) for r in vw["partition"]),
                                      "stage_time_ms": tuple(vw["stage_time_ms"]),
                                      "stage_memory_bytes": tuple(vw["stage_memory_bytes"]),
                                      "stage_capacity_bytes": tuple(vw["stage_capacity_bytes"]),
                                      "held_per_stage": (None if vw.get("held_per_stage") is None
                                                         else tuple(vw["held_per_stage"]))})
                for vw in d["virtual_workers"])
    plan = Plan(**{**d, "virtual_workers": vws, "notes": tuple(d.get("notes", ()))})
  except (KeyError, TypeError) as e:
    raise ValueError(f"malformed plan: {e}") from None
  validate_plan(plan)
  return plan


def load_plan(path: str, expected_model: str | None = None) -> Plan:
  """Reads, parses and validates a plan file.

  Args:
    path: JSON file written by :func:`write_plan`.
    expected_model: when given, the model the caller is about to train.

  Raises:
    ValueError: the plan is for another model (both names in the message), or invalid (see
      :func:`plan_from_dict`).
  """
  with open(path) as f:
    d = json.load(f)
  plan = plan_from_dict(d)
  if expected_model is not None and plan.model != expected_model:
    raise ValueError(f"plan {path} was made for model {plan.model!r}, not for model {expected_model!r}")
  return plan
