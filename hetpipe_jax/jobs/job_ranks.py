"""The parameter-server shards and stage ranks of an MPI job (HetPipe §8.1): the second and third steps of
:func:`hetpipe_jax.jobs.job_config.resolve_job`, and the layer placement over the shards.

Planning layer (no jax, no mpi4py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from hetpipe_jax.jobs.job import JobSettings
from hetpipe_jax.jobs.job_checks import ConfigError
from hetpipe_jax.mpi import rank_layout
from hetpipe_jax.planning.ps_placement import PLACEMENTS, assign_layers, gpu_node
from hetpipe_jax.rules import methods
from hetpipe_jax.rules.partition import Partition


def plan_nodes(plan: Any) -> list[str]:
  """The plan's nodes in shard order: its ``ps_placement["shard_nodes"]`` (the cluster's node order), or for older
  plans the nodes in order of first appearance among the VWs' GPUs."""
  names = plan.ps_placement.get("shard_nodes")
  if names:
    return list(names)
  out: list[str] = []
  for vw in plan.virtual_workers:
    for g in vw.gpus:
      if gpu_node(g) not in out:
        out.append(gpu_node(g))
  return out


def with_ps_shards(config: Any, settings: JobSettings) -> JobSettings:
  """Resolves the sharded parameter servers of an MPI job (HetPipe §8.1 "Parameter Placement").

  ``config.num_ps_shards`` (unset: one shard per node of the plan, HetPipe §8.1; 1 without a plan, today's single
  rank-0 PS) and ``config.ps_placement`` (``""``: the plan's chosen policy, ``"default"`` without a plan). Each layer
  lives on one shard: ``default`` places the parameterised layers round-robin over the shards, ``local`` on the
  shard of the node that runs the layer in most VWs (needs a plan and one shard per plan node).

  Raises:
    ConfigError: ``num_ps_shards < 1``, an unknown placement, ``local`` without a plan or with a shard count other
      than the plan's node count; with more than one shard, staleness scaling.
  """
  plan = settings.plan
  nodes = plan_nodes(plan) if plan is not None else ["host"]
  given = config.get("num_ps_shards")
  sources = dict(settings.sources)
  one_ps = not methods.get_method(settings.method).sharded_ps
  if given is None and one_ps:
    num = 1
    sources["num_ps_shards"] = f"default (1: config.method={settings.method!r} runs with one PS on rank 0)"
  elif given is None:
    num = len(nodes) if plan is not None else 1
    sources["num_ps_shards"] = "plan (one shard per node)" if plan is not None else "default (1: one PS on rank 0)"
  else:
    num = int(given)
    sources["num_ps_shards"] = "config"
    if num < 1:
      raise ConfigError(f"config.num_ps_shards={given}: must be >= 1 (1 = one PS on rank 0), or leave it unset for "
                        "one shard per node of the plan")
  if one_ps and num > 1:
    raise ConfigError(f"config.num_ps_shards={num} with config.method={settings.method!r}: per-stage updates with "
                      "sharded parameter servers are not supported yet; leave config.num_ps_shards unset (one PS) "
                      "or use --config.method=hetpipe")
  policy = config.get("ps_placement") or ""
  if policy:
    sources["ps_placement"] = "config"
  else:
    policy = plan.ps_placement.get("policy", "default") if plan is not None else "default"
    sources["ps_placement"] = "plan" if plan is not None else "default"
  if policy not in PLACEMENTS:
    raise ConfigError(f"config.ps_placement={policy!r} must be one of {list(PLACEMENTS)} (or '' for the plan's)")
  if policy == "local" and (plan is None or num != len(nodes)):
    raise ConfigError(f"config.ps_placement='local' needs a plan and one shard per plan node (config.num_ps_shards="
                      f"{num}, plan nodes: {len(nodes) if plan is not None else 'no plan'}): give a plan and leave "
                      "config.num_ps_shards unset, or use --config.ps_placement=default")
  scaling = config.get("ps_staleness_scaling", "none")
  if num > 1 and scaling != "none":
    raise ConfigError(f"config.ps_staleness_scaling={scaling!r} with {num} PS shards: the shards see the VWs' "
                      "pushes and pulls in their own orders, so they could scale one wave by different staleness; "
                      "set --config.num_ps_shards=1 or --config.ps_staleness_scaling=none")
  shard_nodes = tuple(nodes[i % len(nodes)] for i in range(num))
  if plan is not None:
    stage_nodes = tuple(tuple(gpu_node(g) for g in vw.gpus) for vw in plan.virtual_workers)
  else:
    stage_nodes = tuple(("host",) * len(v.devices) for v in settings.vws)
  return dataclasses.replace(settings, num_ps_shards=num, ps_placement=policy, shard_nodes=shard_nodes,
                             vw_stage_nodes=stage_nodes, sources=sources)


def ps_layer_shards(settings: JobSettings, partitions: Sequence[Partition], has_params: Sequence[bool]
                    ) -> list[int | None]:
  """Per layer, the index of the PS shard that holds it (None: no parameters), by the one placement rule
  (:func:`hetpipe_jax.planning.ps_placement.assign_layers`) over ``settings.shard_nodes``.

  Under ``default`` placement every shard must hold some parameters: a shard left empty (more shards than layers
  with parameters) would be a rank that serves nothing. Under ``local`` placement a node whose stages have no
  parameters keeps its (empty) shard: the placement has one shard per node.

  Raises:
    ConfigError: ``default`` placement leaves a shard without parameters (the message names the shards and the
      most that hold some).
  """
  num = settings.num_ps_shards
  per_vw = []
  for part, nodes in zip(partitions, settings.vw_stage_nodes):
    layer_nodes = [""] * len(has_params)
    for (start, end), node in zip(part, nodes):
      for layer in range(start, end):
        layer_nodes[layer] = node
    per_vw.append(layer_nodes)
  if settings.ps_placement == "local":  # one shard per node: shard i is node i
    labels = list(settings.shard_nodes)
  else:  # round-robin over the shards themselves
    labels = [str(i) for i in range(num)]
  shards = [None if a is None else labels.index(a)
            for a in assign_layers(settings.ps_placement, labels, has_params, per_vw)]
  empty = [i for i in range(num) if i not in shards]
  if empty and settings.ps_placement != "local":
    held = sum(bool(h) for h in has_params)
    raise ConfigError(f"config.num_ps_shards={num}: PS shard{'s' if len(empty) > 1 else ''} "
                      f"{', '.join(map(str, empty))} would hold no parameters (the model has {held} layers with "
                      f"parameters, placed round-robin over the shards): set --config.num_ps_shards to at most "
                      f"{held} (python -m hetpipe_jax.launch: --num_ps_shards={held})")
  return shards


def with_stage_ranks(config: Any, settings: JobSettings) -> JobSettings:
  """Resolves stage ranks (``config.stage_ranks``): a VW's stages on separate MPI ranks, grouped by
  :func:`hetpipe_jax.mpi.rank_layout.stage_groups` (``config.stage_rank_grouping``: ``"gpu"``, one rank per stage;
  ``"node"``, the VW's stages on one plan node in one rank). Call after :func:`with_ps_shards` (it sets the stages'
  nodes). Off: ``settings`` unchanged (one process per VW). Checkpoints and ``--resume`` work as without stage
  ranks: each stage rank sends its stages' optimizer state at a checkpoint barrier and takes it back on resume.
  """
  if not config.get("stage_ranks", False):
    return settings
  grouping = config.get("stage_rank_grouping", "gpu")
  groups = tuple(rank_layout.stage_groups(nodes, grouping) for nodes in settings.vw_stage_nodes)
  return dataclasses.replace(settings, stage_groups=groups)
