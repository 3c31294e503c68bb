"""Optimizers built per pipeline stage, and Muon's rule for which parameters it orthogonalizes.

Runtime layer. Each stage keeps its own optax state and applies its own transformation to its layers' params (a
list with one pytree per layer). Every optimizer here is separable by parameter (Adam, NAdam(W), Muon's Newton–Schulz
step per matrix), so the stages' updates together equal one transformation of the whole model.

Muon (``optax.contrib.muon``; Jordan 2024, modded-nanogpt) orthogonalizes the momentum of 2-D weight matrices and
leaves every other parameter to its Adam part. Which leaves are Muon's is decided for the whole model, once, by
:func:`muon_dimension_numbers`, and each stage takes its layers' slice, so a layer's parameters follow the same rule
whichever stage holds it. The rule (by shape and role):

* Muon: a 2-D leaf named ``kernel`` (a flax ``nn.Dense`` weight ``[fan_in, fan_out]``, ``x @ W``: reduction axis 0,
  output axis 1) in any layer but the model's output layer (the last layer that has parameters). Transformer blocks'
  attention and MLP matrices, an MLP's hidden layers (its first layer, fed with the input features, included: a
  matrix multiply, not a lookup) and a CNN's dense layers before its head.
* Adam (optax's ``adamw``): everything else. Embedding tables (``nn.Embed``'s ``embedding``, learned ``positions``:
  lookups), the output layer (the head's kernel and bias and, in the GPT head, its LayerNorm), biases and norm
  scales (1-D), convolution kernels (4-D ``[h, w, in, out]``) and any leaf not named ``kernel``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import optax
from optax.contrib import MuonDimensionNumbers


@dataclasses.dataclass(frozen=True)
class PerStage:
  """An optimizer whose transformation depends on the layers a stage holds (Muon: which leaves are its matrices).

  Attributes:
    build: ``(start, end) -> GradientTransformation`` for the stage of layers ``[start, end)``.
  """

  build: Callable[[int, int], optax.GradientTransformation]


def for_layers(optimizer: Any, start: int, end: int) -> optax.GradientTransformation:
  """The transformation of the stage holding layers ``[start, end)``: ``optimizer`` itself when it is a plain
  ``optax.GradientTransformation`` (the same for every stage), else its :class:`PerStage` build."""
  return optimizer.build(start, end) if isinstance(optimizer, PerStage) else optimizer


def _is_muon_leaf(path, leaf) -> bool:
  last = path[-1] if path else None
  return getattr(last, "key", None) == "kernel" and len(leaf.shape) == 2


def muon_dimension_numbers(layer_params: Sequence[Any]) -> list[Any]:
  """Muon's rule (module docstring) for a whole model.

  Args:
    layer_params: the model's params, one pytree per layer (arrays or ``jax.ShapeDtypeStruct``; only shapes count).

  Returns:
    Per layer, a pytree like its params with ``MuonDimensionNumbers(0, 1)`` at Muon's leaves and None elsewhere (what
    ``optax.contrib.muon(muon_weight_dimension_numbers=...)`` takes for a stage's slice of layers).
  """
  with_params = [i for i, p in enumerate(layer_params) if jax.tree.leaves(p)]
  output_layer = with_params[-1] if with_params else -1
  return [jax.tree_util.tree_map_with_path(
      lambda path, leaf, i=i: MuonDimensionNumbers(0, 1) if i != output_layer and _is_muon_leaf(path, leaf) else None,
      p) for i, p in enumerate(layer_params)]


def muon_leaf_names(layer_params: Sequence[Any]) -> list[str]:
  """The leaves Muon's rule gives Muon, as ``"layer:path"`` (e.g. ``"1:attn/qkv/kernel"``), in layer order."""
  names = []
  for i, dims in enumerate(muon_dimension_numbers(layer_params)):
    flat, _ = jax.tree_util.tree_flatten_with_path(dims, is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
    names += [f"{i}:" + "/".join(str(getattr(k, "key", k)) for k in path) for path, d in flat
              if isinstance(d, MuonDimensionNumbers)]
  return names
