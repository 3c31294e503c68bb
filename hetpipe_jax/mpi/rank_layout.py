"""Which MPI rank runs what, on which host and GPUs: a plan's PS shards and VWs mapped onto a hostfile.

Pure: standard library only (the job's settings, :mod:`hetpipe_jax.jobs.job_config`, use it; the launcher,
:mod:`hetpipe_jax.launch`, prints and runs it).

Ranks follow the MPI job's layout (:mod:`hetpipe_jax.jobs.mpi_job`): ranks ``0..S-1`` are the parameter-server
shards (shard i on the plan's node ``i mod #nodes``, one shard per node by default, HetPipe §8.1), ranks
``S..S+N-1`` the VWs. The plan's nodes map to the hostfile's hosts in order (node i → host i); a hostfile with one
host (or none: ``localhost``) takes every node, which is how one machine runs a multi-node plan.

Without stage ranks a VW runs in one process, so its stages' nodes must map to one host (ED and HD VWs span nodes:
on a real cluster they need stage ranks; on one machine every node is localhost). With stage ranks
(``config.stage_ranks``) rank ``S + v`` is VW v's driver and runs the stages of its first group (stage 0's), and one
rank per further group follows the drivers, VW by VW (:func:`stage_groups`, :func:`stage_rank_layout`): a group is
one stage (``grouping="gpu"``: one rank per GPU) or the stages of one VW on one node (``"node"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from hetpipe_jax.planning.ps_placement import gpu_node
from hetpipe_jax.rules import methods


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


STAGE_RANK_GROUPINGS = ("gpu", "node")


def stage_groups(stage_nodes: Sequence[str], grouping: str) -> tuple[tuple[int, ...], ...]:
  """A VW's stages grouped into processes (stage ranks): group 0 holds stage 0 and runs on the VW's driver rank.

  Args:
    stage_nodes: per stage, the node of its GPU.
    grouping: ``"gpu"``: one process per stage; ``"node"``: the VW's stages on one node share a process (groups in
      order of their first stage).

  Raises:
    LaunchError: an unknown grouping.
  """
  if grouping not in STAGE_RANK_GROUPINGS:
    raise LaunchError(f"stage rank grouping {grouping!r} must be one of {list(STAGE_RANK_GROUPINGS)}")
  if grouping == "gpu":
    return tuple((s,) for s in range(len(stage_nodes)))
  groups: dict[str, list[int]] = {}
  for s, node in enumerate(stage_nodes):
    groups.setdefault(node, []).append(s)
  return tuple(tuple(g) for g in groups.values())


def stage_rank_layout(num_ps_shards: int, groups_per_vw: Sequence[Sequence[Sequence[int]]]
                      ) -> list[tuple[int, int, tuple[int, ...]]]:
  """Every VW process as ``(rank, vw, stages)``: the drivers ``S..S+N-1`` (each its group 0), then every VW's further
  groups, VW by VW, in group order (the job's and the launcher's one rule)."""
  n = len(groups_per_vw)
  out = [(num_ps_shards + v, v, tuple(groups[0])) for v, groups in enumerate(groups_per_vw)]
  rank = num_ps_shards + n
  for v, groups in enumerate(groups_per_vw):
    for group in groups[1:]:
      out.append((rank, v, tuple(group)))
      rank += 1
  return out


def stage_ranks_of_vw(num_ps_shards: int, groups_per_vw: Sequence[Sequence[Sequence[int]]], vw: int) -> list[int]:
  """Per stage of VW ``vw``, the rank that runs it (:func:`stage_rank_layout`)."""
  ranks = [0] * sum(len(g) for g in groups_per_vw[vw])
  for rank, v, stages in stage_rank_layout(num_ps_shards, groups_per_vw):
    if v == vw:
      for s in stages:
        ranks[s] = rank
  return ranks


def hostfile_slots(text: str) -> dict[str, int]:
  """Per host of an MPICH hostfile (``host`` or ``host:slots`` per line, ``#`` comments), in order of first mention,
  its process slots: ``host`` alone is 1 slot (MPICH's rule), a host on several lines has the sum of their slots.

  Raises:
    LaunchError: a line that is not ``host[:slots]``, or a slot count below 1.
  """
  slots: dict[str, int] = {}
  for number, line in enumerate(text.splitlines(), 1):
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    host, colon, count = line.partition(":")
    count = count.strip()
    if not host or " " in host or (colon and not count.isdigit()):
      raise LaunchError(f"hostfile line {number} {line!r}: expected MPICH syntax 'host' or 'host:slots'")
    if colon and int(count) < 1:
      raise LaunchError(f"hostfile line {number} {line!r}: a host needs at least 1 slot")
    slots[host] = slots.get(host, 0) + (int(count) if colon else 1)
  return slots


def read_hostfile(text: str) -> list[str]:
  """Hosts of an MPICH hostfile (:func:`hostfile_slots`), in order, once each.

  Raises:
    LaunchError: a line that is not ``host[:slots]``.
  """
  return list(hostfile_slots(text))


def check_slots(slots: Sequence[RankSlot], host_slots: Mapping[str, int], oversubscribe: bool = False) -> None:
  """Checks that no host gets more ranks than the hostfile gives it slots (MPICH would oversubscribe it silently).

  Args:
    slots: every rank with its host (:func:`map_ranks`).
    host_slots: per host its slots (:func:`hostfile_slots`); a host it does not name (no hostfile: ``localhost``)
      has no limit.
    oversubscribe: allow more ranks than slots (``launch --oversubscribe``).

  Raises:
    LaunchError: a host with more ranks than slots, naming the host, its slots and its ranks.
  """
  if oversubscribe:
    return
  ranks: dict[str, list[int]] = {}
  for s in slots:
    ranks.setdefault(s.host, []).append(s.rank)
  for host, on_host in ranks.items():
    have = host_slots.get(host)
    if have is not None and len(on_host) > have:
      raise LaunchError(f"host {host} has {have} slot{'s' if have != 1 else ''} in the hostfile but the plan puts "
                        f"{len(on_host)} ranks on it (ranks {', '.join(map(str, on_host))}): give it at least "
                        f"{len(on_host)} slots ({host}:{len(on_host)}), or pass --oversubscribe to run more ranks "
                        "than slots")


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


def map_ranks(plan: Any, nodes: Sequence[str], num_ps_shards: int, hosts: Sequence[str],
              grouping: str | None = None) -> list[RankSlot]:
  """Every rank of the job (shards, then VWs' drivers, then stage ranks) with its host and devices.

  Args:
    plan: a :class:`hetpipe_jax.planning.plan_format.Plan`.
    nodes: the plan's nodes in shard order (:func:`hetpipe_jax.jobs.job_config.plan_nodes`).
    num_ps_shards: S >= 1 for the PS methods; 0 for the all-reduce methods (no PS: VW v is rank v).
    hosts: the hostfile's hosts (:func:`read_hostfile`).
    grouping: stage ranks (``"gpu"`` or ``"node"``, :func:`stage_groups`); None: one process per VW.

  Raises:
    LaunchError: ``num_ps_shards < 1`` for a PS method or above 0 for an all-reduce one, too few hosts, or (without
      stage ranks) a VW whose stages' nodes map to different hosts.
  """
  uses_ps = methods.get_method(plan.method).uses_ps
  if uses_ps and num_ps_shards < 1:
    raise LaunchError(f"--num_ps_shards={num_ps_shards} must be >= 1")
  if not uses_ps and num_ps_shards:
    raise LaunchError(f"--num_ps_shards={num_ps_shards}: the plan's method {plan.method!r} has no parameter server "
                      "(all-reduce): leave it out")
  host_of = node_hosts(nodes, hosts)
  slots = []
  for i in range(num_ps_shards):
    node = nodes[i % len(nodes)]
    slots.append(RankSlot(i, f"ps shard {i}" + (" (lead)" if i == 0 else ""), (node,), host_of[node], ()))
  vws = sorted(plan.virtual_workers, key=lambda vw: vw.vw_id)
  stage_nodes = [[gpu_node(g) for g in vw.gpus] for vw in vws]
  groups = [stage_groups(n, grouping) if grouping is not None else (tuple(range(len(n))),) for n in stage_nodes]
  for rank, v, stages in stage_rank_layout(num_ps_shards, groups):
    vw = vws[v]
    proc_nodes = tuple(dict.fromkeys(stage_nodes[v][s] for s in stages))
    proc_hosts = sorted({host_of[n] for n in proc_nodes})
    if len(proc_hosts) > 1:
      raise LaunchError(f"VW {vw.vw_id}'s stages run on nodes {', '.join(proc_nodes)}, mapped to different hosts "
                        f"({', '.join(proc_hosts)}): a VW runs in one process unless it has stage ranks; add "
                        "--stage_ranks (one rank per GPU, or --stage_rank_grouping=node), map those nodes to one "
                        "host, or use an NP plan (one VW per node)")
    devices = tuple(vw.devices[s] for s in stages)
    if len(stages) == len(vw.gpus):
      role = f"VW {vw.vw_id}"
    else:
      role = f"VW {vw.vw_id} stage{'s' if len(stages) > 1 else ''} {','.join(map(str, stages))}"
    slots.append(RankSlot(rank, role, proc_nodes, proc_hosts[0], devices))
  return slots


def format_table(slots: Sequence[RankSlot]) -> str:
  """The mapping as a fixed-width table (rank, role, nodes, host, devices)."""
  lines = [f"{'rank':>4}  {'role':<22} {'plan nodes':<20} {'host':<20} devices"]
  for s in slots:
    lines.append(f"{s.rank:>4}  {s.role:<22} {','.join(s.nodes):<20} {s.host:<20} "
                 f"{','.join(map(str, s.devices)) or '-'}")
  return "\n".join(lines)


def machinefile(slots: Sequence[RankSlot]) -> str:
  """An MPICH machinefile placing rank r on its host: one ``host:1`` line per rank, in rank order."""
  return "".join(f"{s.host}:1\n" for s in slots)
