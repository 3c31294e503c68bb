"""Parameter-server placement and the bytes that cross nodes per wave (HetPipe §8.1 "Parameter Placement").

One parameter-server shard runs on every node. ``default``: the model's parameterised layers are placed
round-robin over the shards (as TensorFlow does). ``local`` (ED-local): each layer's shard is on the node of the
GPU that runs it; when virtual workers disagree, the node holding it in most VWs (lowest node index on ties).

Per wave (Nm minibatches, one WSP clock) each VW pushes its aggregated update and pulls the global weights of
every layer (HetPipe §5): ``2 * param_bytes`` per layer, crossing nodes when the layer's GPU and shard differ.
Activations and gradients cross nodes at every inter-node cut of every VW: ``2 * cut_bytes * Nm`` per wave.

Planning layer: standard library only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from hetpipe_jax.costs.cluster import ClusterSpec
from hetpipe_jax.costs.profile_format import ModelProfile
from hetpipe_jax.planning.partitioner import Partition

PLACEMENTS = ("default", "local")


@dataclasses.dataclass(frozen=True)
class Placement:
  """A parameter-server placement and its predicted cross-node traffic.

  Attributes:
    policy: "default" or "local".
    layer_to_node: node name of the shard holding each layer's parameters (None for parameter-free layers).
    ps_bytes_crossing_nodes_per_wave: push + pull bytes between GPUs and shards on other nodes, all VWs.
    activation_bytes_crossing_nodes_per_wave: activation + gradient bytes over inter-node cuts, all VWs.
  """

  policy: str
  layer_to_node: tuple[str | None, ...]
  ps_bytes_crossing_nodes_per_wave: int
  activation_bytes_crossing_nodes_per_wave: int

  @property
  def total_bytes_crossing_nodes_per_wave(self) -> int:
    return self.ps_bytes_crossing_nodes_per_wave + self.activation_bytes_crossing_nodes_per_wave


def _layer_nodes(partition: Partition, num_layers: int) -> list[str]:
  nodes = [""] * num_layers
  for g, (i, j) in zip(partition.gpus, partition.ranges):
    for layer in range(i, j):
      nodes[layer] = g.node
  return nodes


def gpu_node(gpu_id: str) -> str:
  """The node of a GPU id ``"<node>/<index>"`` (as plans record their GPUs)."""
  return gpu_id.rsplit("/", 1)[0]


def assign_layers(policy: str, node_names: Sequence[str], has_params: Sequence[bool],
                  per_vw_layer_nodes: Sequence[Sequence[str]]) -> list[str | None]:
  """The placement rule (HetPipe §8.1): the shard (named by its node) that holds each layer's parameters.

  The one implementation the planner's prediction (:func:`place`) and the runtime's sharded parameter servers
  (:mod:`hetpipe_jax.ps.shards`) both call.

  Args:
    policy: ``"default"``: parameterised layers round-robin over ``node_names`` in order (TensorFlow's placement);
      ``"local"``: each layer on the node that runs it in most VWs (lowest node index on ties).
    node_names: one shard per node, in shard order.
    has_params: per layer, whether it has parameters (parameter-free layers get None).
    per_vw_layer_nodes: per VW, per layer, the node of the GPU that runs the layer (used by ``"local"``).

  Returns:
    Per layer, its shard's node name, or None for a parameter-free layer.

  Raises:
    ValueError: unknown policy, or no nodes.
  """
  if policy not in PLACEMENTS:
    raise ValueError(f"unknown parameter placement {policy!r}: must be one of {list(PLACEMENTS)}")
  if not node_names:
    raise ValueError("parameter placement needs at least one shard node")
  node_names = list(node_names)
  out: list[str | None] = []
  k = 0
  for layer, params in enumerate(has_params):
    if not params:
      out.append(None)
    elif policy == "default":
      out.append(node_names[k % len(node_names)])
      k += 1
    else:
      votes = [nodes[layer] for nodes in per_vw_layer_nodes]
      out.append(max(node_names, key=lambda nd: (votes.count(nd), -node_names.index(nd))))
  return out


def place(policy: str, cluster: ClusterSpec, profile: ModelProfile, partitions: Sequence[Partition],
          num_inflight: int) -> Placement:
  """Places the parameter-server shards and counts the bytes crossing nodes per wave.

  Args:
    policy: "default" or "local".
    cluster: the cluster (one shard per node).
    profile: the model's profile (parameter and activation bytes per layer).
    partitions: every VW's partition (GPUs in stage order).
    num_inflight: Nm, minibatches per wave.

  Raises:
    ValueError: unknown policy.
  """
  if policy not in PLACEMENTS:
    raise ValueError(f"unknown parameter placement {policy!r}: must be one of {list(PLACEMENTS)}")
  n = profile.num_layers
  node_names = [nd.name for nd in cluster.nodes]
  per_vw = [_layer_nodes(p, n) for p in partitions]
  layer_to_node = assign_layers(policy, node_names, [layer.param_bytes > 0 for layer in profile.layers], per_vw)
  ps_bytes = 0
  for nodes in per_vw:
    for layer in range(n):
      if layer_to_node[layer] is not None and layer_to_node[layer] != nodes[layer]:
        ps_bytes += 2 * profile.layers[layer].param_bytes
  act_bytes = 0
  for p in partitions:
    for s in range(len(p.gpus) - 1):
      if p.gpus[s].node != p.gpus[s + 1].node:
        act_bytes += 2 * profile.layers[p.ranges[s][1] - 1].output_activation_bytes * num_inflight
  return Placement(policy, tuple(layer_to_node), ps_bytes, act_bytes)
