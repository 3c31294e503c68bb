"""Which part of the flat weight vector each parameter-server shard holds (HetPipe §8.1 "Parameter Placement").

Runtime layer (numpy). Each layer lives on one shard (:func:`hetpipe_jax.jobs.job_config.ps_layer_shards`, the
planner's placement rule); a shard's slice of the flat layer-ordered vector (:mod:`hetpipe_jax.runtime.param_layout`)
is the concatenation of its layers' ranges, in layer order. A VW pushes each shard ``gather(update, s)`` and
assembles pulled weights with ``scatter``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from hetpipe_jax.rules import wsp


@dataclasses.dataclass(frozen=True)
class ShardLayout:
  """Flat element indices of each shard.

  Attributes:
    layer_shards: per layer, its shard (None: the layer has no parameters).
    index: per shard, int64 indices into the flat ``[num_params]`` vector (layer order), possibly empty.
    num_params: the model's parameter count.
    ranges: per shard, its maximal contiguous ``(start, end)`` element ranges (gather and scatter copy slices).
  """

  layer_shards: tuple[int | None, ...]
  index: tuple[np.ndarray, ...]
  num_params: int
  ranges: tuple[tuple[tuple[int, int], ...], ...] = ()

  @staticmethod
  def build(layer_offsets: Sequence[int], layer_shards: Sequence[int | None], num_shards: int) -> "ShardLayout":
    """Shard slices from the layout's ``[num_layers + 1]`` offsets and each layer's shard.

    Raises:
      ValueError: a layer with parameters but no shard, a shard index outside ``[0, num_shards)``, or a length
        mismatch.
    """
    if len(layer_offsets) != len(layer_shards) + 1:
      raise ValueError(f"{len(layer_shards)} layer shards for {len(layer_offsets) - 1} layers")
    parts: list[list[np.ndarray]] = [[] for _ in range(num_shards)]
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(num_shards)]
    for layer, shard in enumerate(layer_shards):
      a, b = int(layer_offsets[layer]), int(layer_offsets[layer + 1])
      if shard is None:
        if b > a:
          raise ValueError(f"layer {layer} has {b - a} parameters but no PS shard")
        continue
      if not 0 <= shard < num_shards:
        raise ValueError(f"layer {layer} placed on shard {shard}; there are {num_shards}")
      parts[shard].append(np.arange(a, b, dtype=np.int64))
      if b > a:
        if ranges[shard] and ranges[shard][-1][1] == a:
          ranges[shard][-1] = (ranges[shard][-1][0], b)
        else:
          ranges[shard].append((a, b))
    index = tuple(np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts)
    return ShardLayout(tuple(layer_shards), index, int(layer_offsets[-1]), tuple(tuple(r) for r in ranges))

  @staticmethod
  def single(num_params: int, num_layers: int) -> "ShardLayout":
    """Everything on shard 0 (today's one PS)."""
    return ShardLayout((0,) * num_layers, (np.arange(num_params, dtype=np.int64),), num_params,
                       (((0, num_params),),))

  @property
  def num_shards(self) -> int:
    return len(self.index)

  def size(self, shard: int) -> int:
    """Floats shard ``shard`` holds."""
    return int(self.index[shard].size)

  def gather(self, flat: np.ndarray, shard: int) -> np.ndarray:
    """Shard ``shard``'s slice of a flat ``[num_params]`` vector (contiguous; a view when the shard holds one range,
    else a copy)."""
    if self.num_shards == 1:
      return flat
    ranges = self.ranges[shard]
    if len(ranges) == 1:
      return flat[ranges[0][0]:ranges[0][1]]
    if not ranges:
      return flat[:0]
    return np.concatenate([flat[a:b] for a, b in ranges])

  def scatter(self, out: np.ndarray, shard: int, part: np.ndarray) -> None:
    """Writes shard ``shard``'s slice ``part`` into the flat vector ``out`` in place."""
    pos = 0
    for a, b in self.ranges[shard]:
      out[a:b] = part[pos:pos + b - a]
      pos += b - a

  def params_in_range(self, shard: int, start: int, end: int) -> int:
    """How many of shard ``shard``'s floats lie in flat elements ``[start, end)`` (a stage's layers)."""
    idx = self.index[shard]
    return int(np.count_nonzero((idx >= start) & (idx < end)))


@dataclasses.dataclass(frozen=True)
class VWParts:
  """Stage ranks: which rank of one VW pushes, and receives pulled weights of, which part of each shard's slice.

  A rank's part of shard ``s`` is the elements of ``s``'s slice that lie in its stages' layers, in flat (layer)
  order. The rule, used by the stage ranks, the driver and the shards alike: shard ``s``'s **senders** are the
  VW's ranks holding some of its elements, or the driver alone (with an empty part) when none does, so every shard
  receives every wave of every VW; its **receivers** are the senders plus the driver (a pull's reply carries the
  shard's vector clock, which the driver needs to decide and record).

  Attributes:
    vw_id: the VW.
    driver: the VW's driver rank.
    flat_index: ``{(rank, shard): int64 [part size]}``: the part's indices into the flat ``[num_params]`` vector.
    shard_pos: ``{(rank, shard): int64 [part size]}``: the same elements' positions in the shard's slice.
    num_shards: S.
    shard_senders: per shard, its senders (rank order).
  """

  vw_id: int
  driver: int
  flat_index: dict
  shard_pos: dict
  num_shards: int
  shard_senders: tuple[tuple[int, ...], ...]

  @staticmethod
  def build(shards: ShardLayout, vw_id: int, stage_ranks: Sequence[int],
            stage_ranges: Sequence[tuple[int, int]]) -> "VWParts":
    """The parts of VW ``vw_id`` whose stage ``k`` runs on ``stage_ranks[k]`` and holds the flat elements
    ``stage_ranges[k] = (start, end)``; ``stage_ranks[0]`` is the driver.

    Raises:
      ValueError: ``stage_ranks`` and ``stage_ranges`` differ in length.
    """
    if len(stage_ranks) != len(stage_ranges):
      raise ValueError(f"{len(stage_ranks)} stage ranks for {len(stage_ranges)} stages")
    driver = int(stage_ranks[0])
    flat_index, shard_pos, senders = {}, {}, []
    for shard in range(shards.num_shards):
      idx = shards.index[shard]
      owner = np.full(idx.size, -1, np.int64)
      for rank, (a, b) in zip(stage_ranks, stage_ranges):
        owner[(idx >= a) & (idx < b)] = rank
      ranks = sorted({int(r) for r in owner if r >= 0}) or [driver]
      senders.append(tuple(ranks))
      for rank in ranks:
        pos = np.flatnonzero(owner == rank).astype(np.int64)
        flat_index[(rank, shard)], shard_pos[(rank, shard)] = idx[pos], pos
      if driver not in ranks:  # a receiver only: the shard's vector clock, no weights
        flat_index[(driver, shard)] = shard_pos[(driver, shard)] = np.zeros(0, np.int64)
    return VWParts(vw_id, driver, flat_index, shard_pos, shards.num_shards, tuple(senders))

  def senders(self, shard: int) -> list[int]:
    """The ranks that push their part of every wave to ``shard`` (rank order)."""
    return list(self.shard_senders[shard])

  def receivers(self, shard: int) -> list[int]:
    """The ranks a pull's reply from ``shard`` goes to: its senders and the driver (rank order)."""
    return sorted(set(self.senders(shard)) | {self.driver})

  def shards_of(self, rank: int) -> list[int]:
    """The shards ``rank`` pushes to (and receives pulled weights from, beside the driver's every shard)."""
    return [s for s in range(self.num_shards) if rank in self.shard_senders[s]]

  def part_size(self, rank: int, shard: int) -> int:
    """Floats of ``shard``'s slice that ``rank`` pushes and receives (0: none)."""
    idx = self.flat_index.get((rank, shard))
    return 0 if idx is None else int(idx.size)


class WaveAssembler:
  """A shard's side of stage ranks' pushes: a VW's wave counts as pushed once every sender's part arrived.

  Args:
    parts: per VW, its :class:`VWParts`.
    shard: this shard.
    shard_size: floats of this shard's slice.
  """

  def __init__(self, parts: Sequence[VWParts], shard: int, shard_size: int):
    self.parts = list(parts)
    self.shard = shard
    self.shard_size = shard_size
    self._got: dict[tuple[int, int], dict[int, np.ndarray]] = {}  # (vw, wave) -> rank -> part

  def add(self, vw_id: int, wave_id: int, rank: int, part: np.ndarray) -> np.ndarray | None:
    """One sender's part of VW ``vw_id``'s wave ``wave_id``; returns the whole float32 ``[shard_size]`` update when
    this was the last part missing, else None.

    Raises:
      ValueError: ``rank`` is not one of this shard's senders for the VW, sent this wave's part twice, or sent a
        part of the wrong size.
    """
    vw_parts = self.parts[vw_id]
    senders = vw_parts.senders(self.shard)
    if rank not in senders:
      raise ValueError(f"rank {rank} pushed VW {vw_id}'s wave {wave_id} to shard {self.shard}, whose senders for "
                       f"that VW are ranks {senders}")
    want = vw_parts.part_size(rank, self.shard)
    if part.size != want:
      raise ValueError(f"rank {rank} pushed {part.size} floats of VW {vw_id}'s wave {wave_id} to shard "
                       f"{self.shard}; its part holds {want}")
    got = self._got.setdefault((vw_id, wave_id), {})
    if rank in got:
      raise ValueError(f"rank {rank} pushed its part of VW {vw_id}'s wave {wave_id} to shard {self.shard} twice")
    got[rank] = part
    if len(got) < len(senders):
      return None
    del self._got[(vw_id, wave_id)]
    full = np.empty(self.shard_size, np.float32)
    for r, p in got.items():
      full[vw_parts.shard_pos[(r, self.shard)]] = p
    return full

  def incomplete(self) -> list[tuple[int, int]]:
    """``(vw, wave)`` of the waves with some part still missing."""
    return sorted(self._got)


def rebase_on_shards(flat: np.ndarray, own_flat: dict[int, np.ndarray], own_applied: Sequence[int],
                     shard_index: Sequence[np.ndarray]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
  """Pulled weights + the own pushed waves each shard's slice lacks (HetPipe §5; sharded PS, stage ranks).

  The one rebase on host copies, used by a VW's driver over sharded parameter servers (``VirtualWorker``) and by
  every stage rank (on its parts): per shard, the own waves :func:`hetpipe_jax.rules.wsp.own_waves_after_pull`
  keeps beyond the VW's entry of that shard's vector clock are added, in wave order, on that shard's elements.

  Args:
    flat: the pulled weights, float32 ``[n]``: the whole model (``n = num_params``; only the caller's elements need
      be valid) or a stage rank's own elements.
    own_flat: wave -> the VW's own pushed update of that wave, float32 ``[n]`` (the same elements as ``flat``).
    own_applied: per shard, how many of the VW's own waves its slice of the pull holds.
    shard_index: per shard, the positions of its elements in ``flat`` (the whole model:
      :attr:`hetpipe_jax.ps.shards.ShardLayout.index`).

  Returns:
    ``(rebased float32 [n], the own waves still to keep: those some shard lacks)``.
  """
  keep = wsp.own_waves_after_pull(own_flat, min(own_applied))
  local = np.array(flat, np.float32, copy=True)
  for index, applied in zip(shard_index, own_applied):
    for c in wsp.own_waves_after_pull(keep, applied):  # this shard's slice lacks these own waves
      local[index] += own_flat[c][index]
  return local, {c: own_flat[c] for c in keep}
