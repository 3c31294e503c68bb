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
