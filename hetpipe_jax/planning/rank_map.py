"""Which MPI rank runs what, on which host and GPUs: a plan's PS shards and VWs mapped onto a hostfile.

Planning layer: standard library only (the launcher, :mod:`hetpipe_jax.launch`, prints and runs it).

Ranks follow the MPI job's layout (:mod:`hetpipe_jax.jobs.mpi_job`): ranks ``0..S-1`` are the parameter-server
shards (shard i on the plan's node ``i mod #nodes``, one shard per node by default, HetPipe §8.1), ranks
``S..S+N-1`` the VWs. The plan's nodes map to the hostfile's hosts in order (node i → host i); a hostfile with one
host (or none: ``localhost``) takes every node, which is how one machine runs a multi-node plan.

A VW runs in one process, so its stages' nodes must map to one host (ED and HD VWs span nodes: on a real cluster
they need stage ranks, not implemented yet; on one machine every node is localhost).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence


class LaunchError(ValueError):
  """The plan cannot be mapped onto the hosts; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class RankSlot:
  """One MPI rank.

  Attributes:
    rank: MPI rank.
    role: ``"ps shard i"`` (``"ps shard 0 (lead)"``) or ``"VW v"``.
    nodes: the plan nodes it stands for (a shard's node; a VW's stages' nodes, stage order, deduplicated).
    host: the host it runs on.
    devices: node-local GPU indices it uses (a VW's stages' devices in stage order; none for a shard).
  """

  rank: int
  role: str
  nodes: tuple[str, ...]
  host: str
  devices: tuple[int, ...]


def read_hostfile(text: str) -> list[str]:
  """Hosts of an MPICH hostfile (``host`` or ``host:slots`` per line, ``#`` comments), in order, once each.

  Raises:
    LaunchError: a line that is not ``host[:slots]``.
  """
  hosts: list[str] = []
  for number, line in enumerate(text.splitlines(), 1):
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    host, _, slots = line.partition(":")
    if not host or " " in host or (slots and not slots.strip().isdigit()):
      raise LaunchError(f"hostfile line {number} {line!r}: expected MPICH syntax 'host' or 'host:slots'")
    if host not in hosts:
      hosts.append(host)
  return hosts


def node_hosts(nodes: Sequence[str], hosts: Sequence[str]) -> dict[str, str]:
  """Plan node → host: node i → host i; one host (or none: localhost) takes every node.

  Raises:
    LaunchError: fewer hosts than nodes (and more than one).
  """
  if len(hosts) <= 1:
    host = hosts[0] if hosts else "localhost"
    return {n: host for n in nodes}
  if len(hosts) < len(nodes):
    raise LaunchError(f"the hostfile lists {len(hosts)} hosts for a plan with {len(nodes)} nodes "
                      f"({', '.join(nodes)}): list one host per node in that order, or one host for all")
  return dict(zip(nodes, hosts))


def map_ranks(plan: Any, nodes: Sequence[str], num_ps_shards: int, hosts: Sequence[str]) -> list[RankSlot]:
  """Every rank of the job (shards, then VWs) with its host and devices.

  Args:
    plan: a :class:`hetpipe_jax.planning.plan_format.Plan`.
    nodes: the plan's nodes in shard order (:func:`hetpipe_jax.jobs.job_config.plan_nodes`).
    num_ps_shards: S >= 1.
    hosts: the hostfile's hosts (:func:`read_hostfile`).

  Raises:
    LaunchError: ``num_ps_shards < 1``, too few hosts, or a VW whose stages' nodes map to different hosts.
  """
  from hetpipe_jax.planning.ps_placement import gpu_node
  if num_ps_shards < 1:
    raise LaunchError(f"--num_ps_shards={num_ps_shards} must be >= 1")
  host_of = node_hosts(nodes, hosts)
  slots = []
  for i in range(num_ps_shards):
    node = nodes[i % len(nodes)]
    slots.append(RankSlot(i, f"ps shard {i}" + (" (lead)" if i == 0 else ""), (node,), host_of[node], ()))
  for vw in plan.virtual_workers:
    vw_nodes = tuple(dict.fromkeys(gpu_node(g) for g in vw.gpus))
    vw_hosts = sorted({host_of[n] for n in vw_nodes})
    if len(vw_hosts) > 1:
      raise LaunchError(f"VW {vw.vw_id}'s stages run on nodes {', '.join(vw_nodes)}, mapped to different hosts "
                        f"({', '.join(vw_hosts)}): a VW runs in one process (stage ranks are not implemented yet); "
                        "map those nodes to one host, or use an NP plan (one VW per node)")
    devices = tuple(d if d is not None else -1 for d in vw.devices)
    slots.append(RankSlot(num_ps_shards + vw.vw_id, f"VW {vw.vw_id}", vw_nodes, vw_hosts[0], devices))
  return slots


def format_table(slots: Sequence[RankSlot]) -> str:
  """The mapping as a fixed-width table (rank, role, nodes, host, devices)."""
  lines = [f"{'rank':>4}  {'role':<18} {'plan nodes':<20} {'host':<20} devices"]
  for s in slots:
    lines.append(f"{s.rank:>4}  {s.role:<18} {','.join(s.nodes):<20} {s.host:<20} "
                 f"{','.join(map(str, s.devices)) or '-'}")
  return "\n".join(lines)


def machinefile(slots: Sequence[RankSlot]) -> str:
  """An MPICH machinefile placing rank r on its host: one ``host:1`` line per rank, in rank order."""
  return "".join(f"{s.host}:1\n" for s in slots)
