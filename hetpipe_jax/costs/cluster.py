"""Cluster spec: GPU types, nodes, intra-/inter-node links, and the local JAX device map (HetPipe §8.1).

A cluster is loaded from JSON, by name from ``experiments/clusters/<name>.json`` or from a path. Every GPU gets
an id ``"<node>/<index>"`` (e.g. ``"V/0"``); a GPU's *class* is ``(gpu_type, node)``: GPUs of one class are
interchangeable for the partitioner (same speed, memory and links). A GPU's device index on its node is its index
there (``"V/2"``: device 2, CUDA's order), unless the cluster file's ``local_devices`` maps it to another
(:func:`node_local_index`, :meth:`ClusterSpec.device_index`).

Costs layer: standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

from hetpipe_jax.paths import REPO_ROOT

CLUSTER_DIR = str(REPO_ROOT / "experiments" / "clusters")


@dataclasses.dataclass(frozen=True)
class GpuType:
  """One kind of accelerator (HetPipe Table 1).

  Attributes:
    name: e.g. ``"TITAN V"``.
    peak_fp32_flops_per_s: peak FP32 FLOP/s (CUDA cores x boost clock x 2).
    peak_fp16_flops_per_s: peak FP16 FLOP/s (tensor cores where present).
    memory_bytes: device memory capacity in bytes.
    memory_bandwidth_bytes_per_s: peak device-memory bandwidth in bytes/s.
    reserved_bytes: memory not available to the model (runtime context, allocator slack), bytes.
    measured_device_kind: JAX ``device_kind``-style tag (e.g. ``"cpu"``); a profile measured on this kind gives
      this type's layer times directly instead of the roofline estimate (see ``cost_model``).
    roofline_efficiency: achieved / peak (FLOP/s and memory bandwidth alike) of this type in the roofline estimate,
      in (0, 1]; None: the cost model's ``compute_efficiency`` / ``memory_efficiency``. Set by a calibration
      (``experiments/paper/calibration.py`` fits one per type on the paper's Horovod throughputs, HetPipe Table 4).
  """

  name: str
  peak_fp32_flops_per_s: float
  peak_fp16_flops_per_s: float
  memory_bytes: int
  memory_bandwidth_bytes_per_s: float
  reserved_bytes: int = 0
  measured_device_kind: str | None = None
  roofline_efficiency: float | None = None


@dataclasses.dataclass(frozen=True)
class LinkSpec:
  """A communication link; transfer time = ``latency_s + bytes / (bandwidth_bytes_per_s * efficiency)``.

  Attributes:
    name: e.g. ``"PCIe 3.0 x16"``.
    bandwidth_bytes_per_s: peak bandwidth in bytes/s (PCIe 3.0 x16: 15.75e9; InfiniBand 56 Gb/s: 7e9).
    efficiency: the scale-down constant in (0, 1] (HetPipe §7, as in Paleo): achieved / peak bandwidth.
    latency_s: fixed cost per transfer in seconds (the intercept of a linear fit to measured transfers).
  """

  name: str
  bandwidth_bytes_per_s: float
  efficiency: float = 1.0
  latency_s: float = 0.0

  def transfer_time_s(self, num_bytes: float) -> float:
    """Seconds to move ``num_bytes`` over this link (0 for 0 bytes)."""
    if num_bytes <= 0:
      return 0.0
    return self.latency_s + num_bytes / (self.bandwidth_bytes_per_s * self.efficiency)


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU of the cluster: ``gpu_id`` = ``"<node>/<index>"``, its type name and node name."""

  gpu_id: str
  gpu_type: str
  node: str

  @property
  def gpu_class(self) -> tuple[str, str]:
    """``(gpu_type, node)``: GPUs of one class are interchangeable for partitioning."""
    return (self.gpu_type, self.node)


@dataclasses.dataclass(frozen=True)
class NodeSpec:
  """A machine: ``name`` and the type name of each of its GPUs (index order)."""

  name: str
  gpu_types: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """A heterogeneous GPU cluster (HetPipe §3, Figure 2; §8.1).

  Attributes:
    name: cluster name.
    gpu_types: type name -> :class:`GpuType`.
    nodes: the machines, in order.
    intra_node_link: link between two GPUs of one node (PCIe).
    inter_node_link: network between nodes (InfiniBand).
    local_devices: gpu id -> the device index that runs it, overriding its index within its node
      (:meth:`device_index`; e.g. a local CPU device standing in for it; may be empty).
  """

  name: str
  gpu_types: Mapping[str, GpuType]
  nodes: tuple[NodeSpec, ...]
  intra_node_link: LinkSpec
  inter_node_link: LinkSpec
  local_devices: Mapping[str, int] = dataclasses.field(default_factory=dict)

  def gpus(self) -> list[Gpu]:
    """Every GPU, node by node, index order."""
    return [Gpu(f"{n.name}/{i}", t, n.name) for n in self.nodes for i, t in enumerate(n.gpu_types)]

  def gpu(self, gpu_id: str) -> Gpu:
    """The GPU with id ``gpu_id``.

    Raises:
      ValueError: no such GPU in this cluster.
    """
    for g in self.gpus():
      if g.gpu_id == gpu_id:
        return g
    raise ValueError(f"unknown GPU id {gpu_id!r} in cluster {self.name!r}")

  def device_index(self, gpu_id: str) -> int:
    """The device index that runs GPU ``gpu_id`` on its node: ``local_devices[gpu_id]`` when the cluster file
    gives one, else its index within its node (:func:`node_local_index`)."""
    return self.local_devices.get(gpu_id, node_local_index(gpu_id))

  def link(self, node_a: str, node_b: str) -> LinkSpec:
    """The link between GPUs on ``node_a`` and ``node_b`` (intra-node when equal)."""
    return self.intra_node_link if node_a == node_b else self.inter_node_link

  def validate(self) -> None:
    """Checks names, positivity and references.

    Raises:
      ValueError: naming the offending GPU type, node, link or device.
    """
    if not self.nodes:
      raise ValueError(f"cluster {self.name!r} has no nodes")
    for tname, t in self.gpu_types.items():
      if tname != t.name:
        raise ValueError(f"GPU type key {tname!r} differs from its name {t.name!r}")
      for field in ("peak_fp32_flops_per_s", "peak_fp16_flops_per_s", "memory_bytes",
                    "memory_bandwidth_bytes_per_s"):
        if not getattr(t, field) > 0:
          raise ValueError(f"GPU type {tname!r}: {field} must be positive, got {getattr(t, field)}")
      if not 0 <= t.reserved_bytes < t.memory_bytes:
        raise ValueError(f"GPU type {tname!r}: reserved_bytes must be in [0, memory_bytes)")
      if t.roofline_efficiency is not None and not 0 < t.roofline_efficiency <= 1:
        raise ValueError(f"GPU type {tname!r}: roofline_efficiency must be in (0, 1] or absent, got "
                         f"{t.roofline_efficiency}")
    names = [n.name for n in self.nodes]
    if len(set(names)) != len(names):
      raise ValueError(f"cluster {self.name!r}: duplicate node names {names}")
    for n in self.nodes:
      if "/" in n.name:
        raise ValueError(f"node name {n.name!r} must not contain '/'")
      if not n.gpu_types:
        raise ValueError(f"node {n.name!r} has no GPUs")
      for t in n.gpu_types:
        if t not in self.gpu_types:
          raise ValueError(f"node {n.name!r}: unknown GPU type {t!r}; known types: {sorted(self.gpu_types)}")
    for link in (self.intra_node_link, self.inter_node_link):
      if not link.bandwidth_bytes_per_s > 0:
        raise ValueError(f"link {link.name!r}: bandwidth_bytes_per_s must be positive, "
                         f"got {link.bandwidth_bytes_per_s}")
      if not 0 < link.efficiency <= 1:
        raise ValueError(f"link {link.name!r}: efficiency must be in (0, 1], got {link.efficiency}")
      if link.latency_s < 0:
        raise ValueError(f"link {link.name!r}: latency_s must be >= 0, got {link.latency_s}")
    ids = {g.gpu_id for g in self.gpus()}
    for gid, dev in self.local_devices.items():
      if gid not in ids:
        raise ValueError(f"local_devices: unknown GPU id {gid!r}; GPU ids are {sorted(ids)}")
      if not isinstance(dev, int) or dev < 0:
        raise ValueError(f"local_devices[{gid!r}] must be a non-negative int, got {dev!r}")


def node_local_index(gpu_id: str) -> int:
  """A GPU's index within its node, from its id ``"<node>/<index>"`` (``"V/2"`` -> 2): the default device index of
  the GPU on its node (CUDA's device order there).

  Raises:
    ValueError: an id without a non-negative integer index after its last ``/``.
  """
  _, _, index = gpu_id.rpartition("/")
  if not index.isdigit():
    raise ValueError(f"GPU id {gpu_id!r} is not '<node>/<index>': it has no index within its node; name the GPUs "
                     "'<node>/<index>' or give their device indices (a cluster file's local_devices, a plan's "
                     "devices)")
  return int(index)


def _link_from_dict(d: Mapping[str, Any], what: str) -> LinkSpec:
  try:
    return LinkSpec(name=str(d["name"]), bandwidth_bytes_per_s=float(d["bandwidth_bytes_per_s"]),
                    efficiency=float(d.get("efficiency", 1.0)), latency_s=float(d.get("latency_s", 0.0)))
  except KeyError as e:
    raise ValueError(f"{what}: missing field {e.args[0]!r}") from None


def cluster_from_dict(d: Mapping[str, Any]) -> ClusterSpec:
  """Builds and validates a :class:`ClusterSpec` from its JSON dict (format: ``experiments/clusters/*.json``).

  Raises:
    ValueError: a missing field or an invalid value, named.
  """
  try:
    types = {}
    for t in d["gpu_types"]:
      types[t["name"]] = GpuType(
          name=t["name"], peak_fp32_flops_per_s=float(t["peak_fp32_flops_per_s"]),
          peak_fp16_flops_per_s=float(t["peak_fp16_flops_per_s"]), memory_bytes=int(t["memory_bytes"]),
          memory_bandwidth_bytes_per_s=float(t["memory_bandwidth_bytes_per_s"]),
          reserved_bytes=int(t.get("reserved_bytes", 0)), measured_device_kind=t.get("measured_device_kind"),
          roofline_efficiency=(None if t.get("roofline_efficiency") is None else float(t["roofline_efficiency"])))
    nodes = tuple(NodeSpec(n["name"], tuple(n["gpus"])) for n in d["nodes"])
    spec = ClusterSpec(
        name=d["name"], gpu_types=types, nodes=nodes,
        intra_node_link=_link_from_dict(d["intra_node_link"], "intra_node_link"),
        inter_node_link=_link_from_dict(d["inter_node_link"], "inter_node_link"),
        local_devices={k: v for k, v in d.get("local_devices", {}).items()})
  except KeyError as e:
    raise ValueError(f"cluster spec: missing field {e.args[0]!r}") from None
  spec.validate()
  return spec


def sub_cluster(cluster: ClusterSpec, nodes: Sequence[str]) -> ClusterSpec:
  """``cluster`` restricted to ``nodes`` (in the cluster's order, each keeping its ``local_devices``), named
  ``<name>_<nodes>`` (e.g. ``_VR``); ``cluster`` itself when ``nodes`` are all of its nodes.

  Raises:
    ValueError: a node name the cluster does not have, or no node.
  """
  names = [n.name for n in cluster.nodes]
  for n in nodes:
    if n not in names:
      raise ValueError(f"unknown node {n!r}: cluster {cluster.name!r} has nodes {names}")
  if set(nodes) == set(names):
    return cluster
  keep = tuple(n for n in cluster.nodes if n.name in nodes)
  prefixes = tuple(f"{n.name}/" for n in keep)
  out = dataclasses.replace(cluster, name=f"{cluster.name}_{''.join(n.name for n in keep)}", nodes=keep,
                            local_devices={g: d for g, d in cluster.local_devices.items() if g.startswith(prefixes)})
  out.validate()
  return out


def without_nodes(cluster: ClusterSpec, names: Sequence[str]) -> ClusterSpec:
  """``cluster`` less the nodes ``names`` (a node lost to a failure): :func:`sub_cluster` of the others.

  Raises:
    ValueError: a name that is not a node of the cluster, or no node left.
  """
  known = [n.name for n in cluster.nodes]
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"cluster {cluster.name!r} has no node {', '.join(unknown)} (nodes: {', '.join(known)})")
  rest = [n for n in known if n not in names]
  if not rest:
    raise ValueError(f"no node of cluster {cluster.name!r} is left without {', '.join(names)}")
  return sub_cluster(cluster, rest)


def available_clusters() -> list[str]:
  """Names of the clusters shipped in ``experiments/clusters``."""
  if not os.path.isdir(CLUSTER_DIR):
    return []
  return sorted(f[:-5] for f in os.listdir(CLUSTER_DIR) if f.endswith(".json"))


def load_cluster(name_or_path: str) -> ClusterSpec:
  """Loads a cluster by name (``experiments/clusters/<name>.json``) or from a JSON file path.

  Raises:
    ValueError: unknown name (the message lists the known ones) or an invalid spec.
  """
  if os.path.isfile(name_or_path):
    path = name_or_path
  else:
    path = os.path.join(CLUSTER_DIR, name_or_path + ".json")
    if not os.path.isfile(path):
      raise ValueError(f"unknown cluster {name_or_path!r}: not a file and not one of {available_clusters()}")
  with open(path) as f:
    return cluster_from_dict(json.load(f))
