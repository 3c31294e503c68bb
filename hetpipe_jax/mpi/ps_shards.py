"""The sharded parameter server's ranks in an MPI job: which rank moves which part of each shard (stage ranks), a
non-lead shard's run, the lead's gathering of every shard's slice and log at the end, and the run's PS traffic per
rank pair and across nodes (HetPipe §8.1's parameter placement).

Runtime layer; used by :mod:`hetpipe_jax.jobs.mpi_job`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetpipe_jax.mpi import ps_client
from hetpipe_jax.mpi import wire
from hetpipe_jax.mpi.ps_server import ParameterServerService
from hetpipe_jax.mpi.rank_layout import stage_rank_layout, stage_ranks_of_vw
from hetpipe_jax.mpi.wire import TAG_SHARD_FINAL
from hetpipe_jax.ps.param_server import ParameterServer
from hetpipe_jax.ps.shards import VWParts


def ps_byte_matrix(comm) -> np.ndarray | None:
  """Every rank's PS payload bytes summed on rank 0: int64 ``[world, world]``, bytes sent from rank i to rank j
  (wave updates and pulled weights; :data:`hetpipe_jax.mpi.ps_client.PS_BYTES`). A collective: every rank calls it
  once, at its end."""
  from mpi4py import MPI
  rank, world = comm.Get_rank(), comm.Get_size()
  row = ps_client.PS_BYTES.matrix_row(rank, world)
  total = np.zeros_like(row) if rank == 0 else None
  wire.idle_collective(comm.Ireduce(row, total, op=MPI.SUM, root=0))  # the others wait while rank 0 evaluates
  return total


def vw_parts(settings, shards, partitions, layer_offsets) -> list | None:
  """Stage ranks: per VW, which of its ranks pushes and receives which part of each shard
  (:class:`hetpipe_jax.ps.shards.VWParts`); None without stage ranks (a VW's rank moves all of its bytes)."""
  if not settings.stage_groups:
    return None
  return [VWParts.build(shards, v, stage_ranks_of_vw(settings.num_ps_shards, settings.stage_groups, v),
                        [(int(layer_offsets[a]), int(layer_offsets[b])) for a, b in partitions[v]])
          for v in range(settings.num_virtual_workers)]


def run_shard(settings, ps_apply: str, flat0, shards, rank, comm, partitions, offsets,
              segments: list[tuple[int, int]] | None = None, eval_every_waves: int = 0) -> None:
  """A non-lead PS shard (rank 1..S-1): applies its slice of every wave update on receipt (its own order) and answers
  pulls with its slice, segment by segment (``segments``: the ``(first, end)`` global clocks of the run's checkpoint
  segments, :func:`hetpipe_jax.jobs.resume.segments`; None: one). It sends rank 0 a copy of its slice whenever its
  global clock reaches a multiple of ``eval_every_waves`` (> 0; the lead evaluates the assembled weights). At each
  segment's end (a checkpoint barrier, every VW's SEGMENT received and every part of their waves applied) it sends
  rank 0 its cut (:func:`send_cut`: the segment's application log and its slice) and answers every VW's barrier
  pull; at the run's end, the same for the last segment."""
  segments = segments or [(0, 0)]
  server = ParameterServer(shards.gather(flat0, rank), settings.num_virtual_workers, ps_apply)
  service = ParameterServerService(comm, server, num_minibatches_per_vw=0, num_inflight=settings.num_inflight,
                                   evaluate=None, eval_every_waves=eval_every_waves, log_every_waves=1,
                                   log_metrics=lambda line: None, progress=False,
                                   first_vw_rank=settings.num_ps_shards, lead=False,
                                   parts=vw_parts(settings, shards, partitions, offsets), shard=rank)
  for i, (first, _) in enumerate(segments):
    if i:
      server.state = server.state.fresh()
    service.clock_offset = first
    service.run()
    send_cut(comm, server)
    if i + 1 < len(segments):
      service.release_barrier()
  ps_byte_matrix(comm)


def send_cut(comm, server: ParameterServer) -> None:
  """A non-lead shard's cut, to rank 0: the segment's ``(wave, vw)`` application log (waves numbered within the
  segment) and the slice of global weights it holds now (:func:`gather_shards` receives it)."""
  log = np.array(server.state.applied, np.int64).reshape(-1, 2)
  comm.Send(np.array([log.shape[0]], np.int64), dest=0, tag=TAG_SHARD_FINAL)
  comm.Send(log, dest=0, tag=TAG_SHARD_FINAL)
  comm.Send(server.weights, dest=0, tag=TAG_SHARD_FINAL)


def gather_shards(comm, shards, flat0: np.ndarray, lead_weights: np.ndarray,
                   lead_log: list) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
  """Rank 0: the global weights assembled from every shard's slice, and every shard's application log (the lead's
  ``lead_log`` first), at a segment's end or the run's (every other shard's :func:`send_cut`)."""
  if shards.num_shards == 1:
    return lead_weights, [list(lead_log)]
  flat = np.array(flat0, np.float32, copy=True)
  shards.scatter(flat, 0, lead_weights)
  logs = [list(lead_log)]
  for shard in range(1, shards.num_shards):
    count = np.empty(1, np.int64)
    comm.Recv(count, source=shard, tag=TAG_SHARD_FINAL)
    log = np.empty((int(count[0]), 2), np.int64)
    comm.Recv(log, source=shard, tag=TAG_SHARD_FINAL)
    part = np.empty(shards.size(shard), np.float32)
    comm.Recv(part, source=shard, tag=TAG_SHARD_FINAL)
    shards.scatter(flat, shard, part)
    logs.append([(int(w), int(v)) for w, v in log])
  return flat, logs


def rank_nodes(settings) -> dict[int, str]:
  """Stage ranks: every PS and VW rank's (plan) node: a shard's from ``shard_nodes``, a VW rank's the node of its
  stage group (a group's stages share a node: ``gpu`` grouping holds one stage, ``node`` grouping one node's)."""
  nodes = {s: settings.shard_nodes[s] for s in range(settings.num_ps_shards)}
  for rank, v, stages in stage_rank_layout(settings.num_ps_shards, settings.stage_groups):
    nodes[rank] = settings.vw_stage_nodes[v][stages[0]]
  return nodes


def ps_bytes_summary(matrix: np.ndarray, settings, partitions, layer_offsets, shards,
                     num_waves: int, parts: list | None = None) -> dict[str, Any]:
  """The run's PS traffic, counted by the transport per rank pair, and the part of it that crosses (mapped) nodes.

  Stage ranks (``parts``, :func:`vw_parts`): each rank pushes and pulls its own stages' parts, so the cross-node
  bytes are the matrix's entries between ranks on different nodes (:func:`rank_nodes`; ``attribution: "ranks"``).
  Without them a VW's rank holds all its stages, so its bytes to and from shard s are attributed to its stages by
  the floats of s's slice each stage's layers hold (``attribution: "stages"``, the planner's model). Cross-node
  bytes are those between a stage's node and its shard's node (HetPipe §8.1). ``crossing_nodes_per_wave``
  normalises each VW's cross-node bytes to one push and one pull per wave (the planner's model, ``ps_placement``):
  ``push / waves + pull / pulls`` summed over VWs.

  Args:
    matrix: int64 ``[world, world]``: payload bytes (wave updates, pulled weights) sent from rank i to rank j.
    settings, partitions, layer_offsets, shards: the job's.
    num_waves: waves each VW pushed.
    parts: stage ranks: per VW its :class:`hetpipe_jax.ps.shards.VWParts`; None without.

  Returns:
    ``by_rank_pair`` (``"i->j"``: bytes), ``total``, ``attribution``, ``crossing_nodes`` (push + pull bytes over the
    run), ``crossing_nodes_per_wave``, ``pulls_per_vw`` and, when the plan predicts this placement,
    ``predicted_crossing_nodes_per_wave``; with stage ranks also ``crossing_nodes_by_rank_pair``.
  """
  num_shards, n = settings.num_ps_shards, settings.num_virtual_workers
  cross_total, per_wave, pulls = 0, 0.0, []
  out: dict[str, Any] = {}
  if parts is not None:
    nodes = rank_nodes(settings)
    crossing = {}
    for v in range(n):
      push_cross = pull_cross = 0
      num_pulls = 0
      for (rank, s), idx in sorted(parts[v].flat_index.items()):
        num_pulls = max(num_pulls, int(matrix[s, rank]) // (4 * idx.size) if idx.size else 0)
        if nodes[rank] != nodes[s]:
          push_cross += int(matrix[rank, s])
          pull_cross += int(matrix[s, rank])
          for i, j in ((rank, s), (s, rank)):
            if matrix[i, j]:
              crossing[f"{i}->{j}"] = int(matrix[i, j])
      pulls.append(num_pulls)
      cross_total += push_cross + pull_cross
      per_wave += push_cross / max(num_waves, 1) + (pull_cross / num_pulls if num_pulls else 0.0)
    out["attribution"] = "ranks"
    out["crossing_nodes_by_rank_pair"] = crossing
    out["rank_nodes"] = {str(r): node for r, node in sorted(nodes.items())}
  else:
    out["attribution"] = "stages"
    for v in range(n):
      rank = num_shards + v
      push_cross = pull_cross = 0
      num_pulls = 0
      for s in range(num_shards):
        slice_bytes = 4 * shards.size(s)
        if not slice_bytes:
          continue
        n_push, n_pull = int(matrix[rank, s]) // slice_bytes, int(matrix[s, rank]) // slice_bytes
        num_pulls = max(num_pulls, n_pull)
        for k, (a, b) in enumerate(partitions[v]):
          if settings.vw_stage_nodes[v][k] != settings.shard_nodes[s]:
            part = 4 * shards.params_in_range(s, layer_offsets[a], layer_offsets[b])
            push_cross += n_push * part
            pull_cross += n_pull * part
      pulls.append(num_pulls)
      cross_total += push_cross + pull_cross
      per_wave += push_cross / max(num_waves, 1) + (pull_cross / num_pulls if num_pulls else 0.0)
  out.update({
      "by_rank_pair": {f"{i}->{j}": int(matrix[i, j]) for i, j in zip(*np.nonzero(matrix))},
      "total": int(matrix.sum()), "crossing_nodes": int(cross_total), "crossing_nodes_per_wave": per_wave,
      "pulls_per_vw": pulls})
  plan = settings.plan
  if plan is not None and list(settings.shard_nodes) == list(dict.fromkeys(settings.shard_nodes)):
    predicted = plan.ps_placement.get("alternatives", {}).get(settings.ps_placement)
    if predicted is not None and len(plan.ps_placement.get("shard_nodes", settings.shard_nodes)) == num_shards:
      out["predicted_crossing_nodes_per_wave"] = predicted["ps_bytes_crossing_nodes_per_wave"]
  return out
