"""The flat float32 layout of a model's weights, in layer order, shared by VWs and the parameter server.

Runtime layer. Every VW flattens its stages' weights (or wave updates) into one contiguous buffer laid out layer by
layer, leaves in ``jax.tree`` order, so VWs with different partitions (HetPipe §8.1, NP) exchange the same buffer
with the PS and a stage's slice is ``[layer_offsets[start], layer_offsets[end])``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """Shapes and offsets of every layer's parameter leaves.

  Attributes:
    treedefs: per layer, the pytree structure of its params.
    shapes: per layer, the shapes of its leaves.
    layer_offsets: ``[num_layers + 1]`` element offsets; layer i occupies ``[layer_offsets[i], layer_offsets[i+1])``.
  """

  treedefs: tuple
  shapes: tuple[tuple[tuple[int, ...], ...], ...]
  layer_offsets: tuple[int, ...]

  @staticmethod
  def from_layer_params(layer_params: Sequence[Any]) -> "ParamLayout":
    treedefs, shapes, offsets = [], [], [0]
    for p in layer_params:
      leaves, treedef = jax.tree.flatten(p)
      treedefs.append(treedef)
      shapes.append(tuple(tuple(int(d) for d in leaf.shape) for leaf in leaves))
      offsets.append(offsets[-1] + sum(int(np.prod(s)) for s in shapes[-1]))
    return ParamLayout(tuple(treedefs), tuple(shapes), tuple(offsets))

  @property
  def num_params(self) -> int:
    return self.layer_offsets[-1]

  def flatten(self, layer_params: Sequence[Any], start: int = 0) -> np.ndarray:
    """Host params of layers ``start..start+len-1`` → contiguous float32 vector."""
    parts = []
    for i, p in enumerate(layer_params):
      leaves = jax.tree.leaves(p)
      if len(leaves) != len(self.shapes[start + i]):
        raise ValueError(f"layer {start + i} has {len(leaves)} parameter arrays, layout expects "
                         f"{len(self.shapes[start + i])}")
      parts.extend(np.asarray(leaf, np.float32).ravel() for leaf in leaves)
    if not parts:
      return np.zeros((0,), np.float32)
    return np.concatenate(parts)

  def unflatten(self, flat: np.ndarray, start: int = 0, end: int | None = None) -> list[Any]:
    """The slice of ``flat`` (full-model or starting at layer ``start``) → per-layer numpy params trees.

    Args:
      flat: float32 vector; either the full model (size ``num_params``) or exactly layers ``start..end-1``.
      start, end: the layer range to rebuild.

    Raises:
      ValueError: ``flat`` has the wrong size.
    """
    end = len(self.treedefs) if end is None else end
    span = self.layer_offsets[end] - self.layer_offsets[start]
    if flat.size == self.num_params:
      base = self.layer_offsets[start]
    elif flat.size == span:
      base = 0
    else:
      raise ValueError(f"buffer of {flat.size} floats matches neither the model ({self.num_params}) nor layers "
                       f"{start}..{end - 1} ({span})")
    pos = base
    out = []
    for i in range(start, end):
      leaves = []
      for shape in self.shapes[i]:
        n = int(np.prod(shape))
        leaves.append(np.asarray(flat[pos:pos + n], np.float32).reshape(shape))
        pos += n
      out.append(jax.tree.unflatten(self.treedefs[i], leaves))
    return out
