"""Every virtual worker's task times for a plan file, from the cost model (HetPipe §4, §5, §7).

The plan's VWs (GPUs and layer ranges), method and PS placement turned into the engine's per-task durations
(:class:`hetpipe_jax.costs.task_times.VWTaskTimes`, seconds): compute and sends by the cost model, a wave's push
and pull as per-(node, node) transfers of each layer's parameters to its shard, the flush methods' all-reduce.
Planning layer: standard library and numpy only.
"""

from __future__ import annotations

import os

from hetpipe_jax.costs import allreduce_cost
from hetpipe_jax.costs import cost_model
from hetpipe_jax.costs import profile_format
from hetpipe_jax.costs.cluster import ClusterSpec
from hetpipe_jax.costs.profile_format import ModelProfile
from hetpipe_jax.costs.task_times import VWTaskTimes, forward_prefix_ms, vw_task_times
from hetpipe_jax.planning.plan_format import Plan
from hetpipe_jax.rules import methods
from hetpipe_jax.rules.network import Leg


def ps_transfer_bytes(plan: Plan, profile: ModelProfile, cluster: ClusterSpec, vw_index: int) -> tuple[int, int]:
  """``(bytes to shards on other nodes, bytes to shards on the same node)`` of one push (or pull) of a VW.

  Each layer's parameters go to the shard the plan's ``ps_placement["layer_to_node"]`` names (HetPipe §8.1); a
  layer crosses nodes when its shard is not on the node of the GPU that runs it.
  """
  remote = local = 0
  for (node, shard_node), b in _push_bytes_by_node_pair(plan, profile, cluster, vw_index).items():
    if node == shard_node:
      local += b
    else:
      remote += b
  return remote, local


def _push_bytes_by_node_pair(plan: Plan, profile: ModelProfile, cluster: ClusterSpec,
                             vw_index: int) -> dict[tuple[str, str], int]:
  """Bytes of one push of a VW per ``(stage node, shard node)`` pair, in order of first appearance along the VW's
  stages and layers (HetPipe §8.1: each layer's parameters go to the shard on ``ps_placement["layer_to_node"]``;
  layers without parameters or without a shard are left out)."""
  vw = plan.virtual_workers[vw_index]
  layer_to_node = plan.ps_placement["layer_to_node"]
  pair_bytes: dict[tuple[str, str], int] = {}
  for gpu_id, (i, j) in zip(vw.gpus, vw.partition):
    node = cluster.gpu(gpu_id).node
    for layer in range(i, j):
      b = profile.layers[layer].param_bytes
      if layer_to_node[layer] is None or b == 0:
        continue
      key = (node, layer_to_node[layer])
      pair_bytes[key] = pair_bytes.get(key, 0) + b
  return pair_bytes


def ps_transfer_legs(plan: Plan, profile: ModelProfile, cluster: ClusterSpec, vw_index: int) -> tuple[Leg, ...]:
  """One push of a VW as transfers ``Leg(stage node, shard node, seconds)``, one per (stage node, shard node) pair
  with bytes (in order of first appearance along the VW's stages and layers): over the inter-node link when the
  nodes differ, else the intra-node link. A pull reply is the same legs reversed in direction."""
  pair_bytes = _push_bytes_by_node_pair(plan, profile, cluster, vw_index)
  return tuple(Leg(src, dst, (cluster.inter_node_link if src != dst else cluster.intra_node_link).transfer_time_s(b))
               for (src, dst), b in pair_bytes.items())


def task_times_from_plan(plan: Plan, profile: ModelProfile, cluster: ClusterSpec,
                         config: cost_model.CostModelConfig | None = None) -> list[VWTaskTimes]:
  """Every VW's task times for ``plan`` from the cost model (HetPipe §7), for the plan's method.

  The flush methods (``plan.method`` gpipe, 1f1b_flush, horovod): tasks of one micro-batch (the profile split by
  ``plan.num_inflight`` = M), no PS transfers, and the step's all-reduce (:mod:`hetpipe_jax.costs.allreduce_cost`).

  Stage compute is ``cost_model``'s (measured or roofline) fwd+bwd time of its layers, split into forward and
  backward by the same model applied to the forward costs alone; sends use the cost model's per-cut transfer
  times over the link between the two stages' nodes. A push (and a pull) moves every parameter once, one transfer
  per (stage node, shard node) pair, one after another (:func:`ps_transfer_legs`; the inter-node ones use the NICs,
  :mod:`hetpipe_jax.rules.network`). ``stage_nodes`` are the GPUs' nodes.

  Args:
    plan: the plan (its VWs' GPUs and layer ranges).
    profile: the profile it was made with.
    cluster: the cluster it was made for.
    config: cost-model knobs; default: the plan's own ``cost_model`` entry.

  Raises:
    ValueError: the profile or cluster does not match the plan.
  """
  if profile.model != plan.model or profile.batch_size != plan.batch_size:
    raise ValueError(f"profile is for {profile.model!r} at batch {profile.batch_size}, the plan for "
                     f"{plan.model!r} at batch {plan.batch_size}")
  if profile.num_layers != plan.num_layers:
    raise ValueError(f"profile has {profile.num_layers} layers, the plan {plan.num_layers}")
  if cluster.name != plan.cluster:
    raise ValueError(f"cluster {cluster.name!r} is not the plan's cluster {plan.cluster!r}")
  if config is None:
    config = cost_model.CostModelConfig(**plan.cost_model)
  return _TASK_TIMES[methods.get_method(plan.method).sync](plan, profile, cluster, config)


def _allreduce_task_times(plan: Plan, profile: ModelProfile, cluster: ClusterSpec,
                          config: cost_model.CostModelConfig) -> list[VWTaskTimes]:
  """All-reduce BSP: tasks are micro-batches; the step's all-reduce (no PS) over the links its groups use."""
  micro = profile_format.micro_batch_profile(profile, plan.num_inflight)
  costs = cost_model.build_stage_costs(micro, cluster, config)
  fwd_prefix = forward_prefix_ms(micro, cluster, config)
  vws = [([cluster.gpu(g) for g in vw.gpus], vw.partition) for vw in plan.virtual_workers]
  t_ar = allreduce_cost.allreduce_time_s(vws, profile, cluster, shared_nic=False)
  t_nic = allreduce_cost.allreduce_time_s(vws, profile, cluster, shared_nic=True)
  return [vw_task_times(gpus, ranges, costs, fwd_prefix, cluster, allreduce_s=t_ar, allreduce_shared_nic_s=t_nic)
          for gpus, ranges in vws]


def _wsp_task_times(plan: Plan, profile: ModelProfile, cluster: ClusterSpec,
                    config: cost_model.CostModelConfig) -> list[VWTaskTimes]:
  """WSP: tasks are minibatches; every push and pull moves the parameters leg by leg (:func:`ps_transfer_legs`)."""
  costs = cost_model.build_stage_costs(profile, cluster, config)
  fwd_prefix = forward_prefix_ms(profile, cluster, config)
  out = []
  for index, vw in enumerate(plan.virtual_workers):
    push = ps_transfer_legs(plan, profile, cluster, index)
    pull = tuple(Leg(leg.dst, leg.src, leg.seconds) for leg in push)
    ps_s = sum(leg.seconds for leg in push)
    out.append(vw_task_times([cluster.gpu(g) for g in vw.gpus], vw.partition, costs, fwd_prefix, cluster,
                             push_s=ps_s, pull_s=ps_s, push_legs=push, pull_legs=pull))
  return out


# Per ``Method.sync``: how a plan's task times are read.
_TASK_TIMES = {"allreduce": _allreduce_task_times, "wsp": _wsp_task_times}


def profile_for_plan(plan: Plan, path: str | None = None) -> ModelProfile:
  """The profile ``plan`` was made with: ``path`` when given, else the saved default profile for the plan's model,
  batch size, device kind and measured flag (``profile_format.default_profile_path``).

  Raises:
    ValueError: the file is missing (the message names it) or is for another model or batch size.
  """
  if path is None:
    path = profile_format.default_profile_path(plan.model, plan.batch_size, plan.profile["device_kind"],
                                               bool(plan.profile["measured"]))
    if not os.path.isfile(path):
      raise ValueError(f"no saved profile for plan model {plan.model!r} at batch {plan.batch_size} "
                       f"({plan.profile['device_kind']}, measured={plan.profile['measured']}): expected {path}; pass "
                       "the profile the plan was made with")
  profile = profile_format.load_profile(path)
  if profile.model != plan.model or profile.batch_size != plan.batch_size:
    raise ValueError(f"profile {path} is for {profile.model!r} at batch {profile.batch_size}, the plan for "
                     f"{plan.model!r} at batch {plan.batch_size}")
  return profile
