"""A rank's optimizer state in a checkpoint: its bytes on the wire, the structure the lead reads them with, and the
merge of every rank's states into each VW's state over all its layers (docs/design.md §6).

Runtime layer (jobs). Each VW rank (driver or stage rank) sends the optimizer state of its own stages, split by layer
(:meth:`hetpipe_jax.runtime.virtual_worker.VirtualWorker.opt_state_by_layer`), as one uint8 buffer of its leaves'
bytes (nothing pickled); the lead shard reads each buffer with the structure of the rank's stages
(:func:`rank_templates`) and merges them by layer (:func:`merge_states`), so a checkpoint holds every VW's state
for all its layers whichever ranks ran them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hetpipe_jax.mpi.rank_layout import stage_rank_layout
from hetpipe_jax.runtime import opt_state
from hetpipe_jax.runtime import optimizers


def state_bytes(scalars: list, per_layer: list) -> np.ndarray:
  """A rank's optimizer state by layer as one uint8 buffer (its leaves' bytes in tree order; nothing pickled)."""
  leaves = jax.tree.leaves((scalars, per_layer))
  return np.concatenate([np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8) for x in leaves] or
                        [np.zeros(0, np.uint8)])


def state_from_bytes(buffer: np.ndarray, template: tuple[list, list]) -> tuple[list, list]:
  """Inverse of :func:`state_bytes` given a state of the same structure (shapes and dtypes).

  Raises:
    ValueError: the buffer's size does not match the template's.
  """
  leaves, treedef = jax.tree.flatten(template)
  leaves = [np.asarray(leaf) for leaf in leaves]
  expected = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
  if buffer.size != expected:
    raise ValueError(f"optimizer state of {buffer.size} bytes, expected {expected}")
  out, pos = [], 0
  for leaf in leaves:
    n = leaf.size * leaf.dtype.itemsize
    out.append(buffer[pos:pos + n].view(leaf.dtype).reshape(leaf.shape).copy())
    pos += n
  return jax.tree.unflatten(treedef, out)


def rank_templates(ctx: Any) -> dict[int, tuple[int, list[int], tuple[list, list]]]:
  """Per VW rank (the VWs' ranks, then the stage ranks), ``(vw, its layers, the structure of its stages' optimizer
  state by layer)``: what :func:`state_from_bytes` reads the rank's checkpoint bytes with (the initial state
  of the job's optimizer on the start weights; only shapes and dtypes matter). ``ctx``: the job's
  :class:`~hetpipe_jax.jobs.run_context.RunContext`."""
  settings, layout = ctx.job, ctx.layout
  params0 = layout.unflatten(ctx.flat0)
  num_shards, n = settings.num_ps_shards, settings.num_virtual_workers
  if settings.stage_groups:
    owners = stage_rank_layout(num_shards, settings.stage_groups)
  else:
    owners = [(num_shards + v, v, tuple(range(len(ctx.partitions[v])))) for v in range(n)]
  out = {}
  for rank, v, stages in owners:
    tx = ctx.optimizer()
    scalars, per_layer, layers = None, [], []
    for k in stages:
      start, end = ctx.partitions[v][k]
      sc, parts = opt_state.split_by_layer(optimizers.for_layers(tx, start, end).init(list(params0[start:end])),
                                           params0[start:end])
      scalars = sc if scalars is None else scalars
      per_layer.extend(parts)
      layers.extend(range(start, end))
    out[rank] = (v, layers, (scalars, per_layer))
  return out


def merge_states(templates: dict, buffers: dict[int, np.ndarray], num_vws: int
                      ) -> dict[int, tuple[list, list]]:
  """Every VW's optimizer state over all its layers from its ranks' checkpoint bytes (``buffers``: rank -> bytes);
  the scalars are the driver's (it runs stage 0). A rank that sent nothing holds no parameters: its layers keep the
  template's (empty) parts.

  Raises:
    ValueError: a buffer that does not fit its rank's template, or a VW whose driver sent nothing.
  """
  merged: dict[int, tuple[list, list]] = {}
  for rank in sorted(templates):  # the drivers (ranks S..S+N-1) come first
    v, layers, template = templates[rank]
    state = template if rank not in buffers else state_from_bytes(np.asarray(buffers[rank], np.uint8), template)
    if v not in merged:
      if rank not in buffers:
        raise ValueError(f"VW {v}'s driver (rank {rank}) sent no optimizer state for the checkpoint")
      merged[v] = (state[0], {})
    merged[v][1].update(zip(layers, state[1]))
  if sorted(merged) != list(range(num_vws)):
    raise ValueError(f"optimizer states of VWs {sorted(merged)} for a job of {num_vws}")
  return {v: (scalars, [by_layer[k] for k in sorted(by_layer)]) for v, (scalars, by_layer) in sorted(merged.items())}
