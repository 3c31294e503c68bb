"""Cost of all-reduce BSP: per reduction group a ring all-reduce over its slowest link, and the bytes crossing nodes.

Costs layer: standard library only. The groups are :func:`hetpipe_jax.rules.allreduce.reduce_segments` (the
model cut at every VW's stage boundaries; the stages when every VW has the same partition); segment k's group is the
GPU holding it in each VW. A ring all-reduce of ``b`` bytes among N members over a link of bandwidth ``B`` and
latency ``l`` takes ``2(N-1)/N * b / B + 2(N-1) * l`` (reduce-scatter then all-gather); a group whose GPUs span
nodes runs at the inter-node link (its slowest), else at the intra-node link. Groups on different GPUs run at the
same time; the segments one GPU holds are reduced one after another; the step waits for the GPU that finishes last.
Every hop of a ring carries ``2(N-1)/N * b``; a ring visiting its GPUs node by node crosses nodes once per node it
spans (when it spans two or more).

Shared network interfaces (:mod:`hetpipe_jax.rules.network`, on by default as in the engine): a ring that spans
nodes enters and leaves each of its nodes once, through the node's one NIC, so the rings crossing a node's NIC are
served one after another there, as the segments one GPU holds are: the step then waits for the GPU *or the NIC*
that finishes last. Rings inside one node use PCIe and no NIC. Example (HetPipe §8.1's cluster, GPipe with NP: four
VWs, one per node, four stages): the four stage groups each span the four nodes, so every NIC carries four rings
and the all-reduce takes four times one ring's time instead of one ring's.
"""

from __future__ import annotations

from typing import Sequence

from hetpipe_jax.costs.cluster import ClusterSpec, Gpu
from hetpipe_jax.costs.profile_format import ModelProfile
from hetpipe_jax.rules import allreduce


def ring_allreduce_s(num_bytes: float, num_members: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
  """Seconds of a ring all-reduce: ``2(N-1)/N * bytes / bandwidth + 2(N-1) * latency``; 0 for one member or no
  bytes."""
  n = num_members
  if n <= 1 or num_bytes <= 0:
    return 0.0
  return 2.0 * (n - 1) / n * num_bytes / bandwidth_bytes_per_s + 2.0 * (n - 1) * latency_s


def _groups(vws: Sequence[tuple[Sequence[Gpu], Sequence[Sequence[int]]]], profile: ModelProfile):
  """Per segment: ``(bytes, [GPU of each VW])``."""
  segments = allreduce.reduce_segments([ranges for _, ranges in vws])
  holders = [allreduce.segment_stages(ranges, segments) for _, ranges in vws]
  out = []
  for k, (i, j) in enumerate(segments):
    nbytes = sum(profile.layers[layer].param_bytes for layer in range(i, j))
    out.append((nbytes, [gpus[h[k]] for (gpus, _), h in zip(vws, holders)]))
  return out


def ring_groups_time_s(groups: Sequence[tuple[float, Sequence[Gpu]]], cluster: ClusterSpec,
                       shared_nic: bool = True) -> float:
  """Seconds until every ring all-reduce of ``groups`` is done (module docstring): per group of ``(bytes, [its
  GPUs])`` a ring over its slowest link; the rings one GPU (or, ``shared_nic``, one node's NIC) is part of run one
  after another; the result is the GPU or NIC that finishes last. 0 for no groups."""
  per_gpu: dict[str, float] = {}
  per_nic: dict[str, float] = {}
  for nbytes, gpus in groups:
    nodes = {g.node for g in gpus}
    link = cluster.inter_node_link if len(nodes) > 1 else cluster.intra_node_link
    t = ring_allreduce_s(nbytes, len(gpus), link.bandwidth_bytes_per_s * link.efficiency, link.latency_s)
    for g in gpus:
      per_gpu[g.gpu_id] = per_gpu.get(g.gpu_id, 0.0) + t
    if len(nodes) > 1:
      for node in nodes:
        per_nic[node] = per_nic.get(node, 0.0) + t
  if not shared_nic:
    per_nic = {}
  return max(max(per_gpu.values(), default=0.0), max(per_nic.values(), default=0.0))


def ring_groups_cross_node_bytes(groups: Sequence[tuple[float, Sequence[Gpu]]]) -> float:
  """Bytes the ring all-reduces of ``groups`` (``(bytes, [its GPUs])``) move between nodes (module docstring)."""
  total = 0.0
  for nbytes, gpus in groups:
    n, nodes = len(gpus), len({g.node for g in gpus})
    if n > 1 and nodes > 1:
      total += nodes * 2.0 * (n - 1) / n * nbytes
  return total


def allreduce_time_s(vws: Sequence[tuple[Sequence[Gpu], Sequence[Sequence[int]]]], profile: ModelProfile,
                     cluster: ClusterSpec, shared_nic: bool = True) -> float:
  """One step's all-reduce time in seconds (module docstring).

  Args:
    vws: per VW, its GPUs in stage order and their layer ranges.
    profile: parameter bytes per layer (the gradients have the same size).
    cluster: its links.
    shared_nic: the rings crossing one node's NIC are served one after another (:mod:`hetpipe_jax.rules.network`);
      False: every ring runs at full link speed, however many share a node.
  """
  if len(vws) <= 1:
    return 0.0
  return ring_groups_time_s(_groups(vws, profile), cluster, shared_nic)


def allreduce_cross_node_bytes(vws: Sequence[tuple[Sequence[Gpu], Sequence[Sequence[int]]]],
                               profile: ModelProfile) -> int:
  """Bytes one step's all-reduce moves between nodes (module docstring)."""
  if len(vws) <= 1:
    return 0
  return int(ring_groups_cross_node_bytes(_groups(vws, profile)))
