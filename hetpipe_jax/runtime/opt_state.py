"""Optimizer states by layer: split a stage's optax state into per-layer parts and build it back for any partition.

Runtime layer. A stage's parameters are a list of per-layer pytrees, so every parameter-shaped part of its optax
state (Adam's ``mu`` and ``nu``, momentum's trace) is a list with one entry per layer, and the rest are shared
scalars (Adam's step ``count``). A partition of transformations (Muon's: its matrices and Adam's other leaves)
holds such lists with ``optax.MaskedNode`` where the other part owns a leaf; the rule that decides it is per layer
(:mod:`hetpipe_jax.runtime.optimizers`), so a layer's parts fit whichever stage holds it. Checkpoints keep a VW's state as ``(scalars, per-layer parts)``; resuming onto
another partition rebuilds each new stage's state from its layers' parts (issue: resume onto a new plan).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
import optax


def _is_masked(node: Any) -> bool:
  return isinstance(node, optax.MaskedNode)


def _params_shaped(stage_params: Sequence[Any]):
  """A test for the parameter-shaped parts of a stage's state: one entry per layer, each shaped like its layer
  (an ``optax.MaskedNode`` standing for a leaf)."""
  layers = [jax.tree.structure(p) for p in stage_params]
  return lambda node: isinstance(node, list) and len(node) == len(layers) and all(
      jax.tree.structure(part, is_leaf=_is_masked) == want for part, want in zip(node, layers))


def _leaf_shapes(tree: Any) -> list[tuple[str, tuple[int, ...]]]:
  """``(path, shape)`` of every leaf; a masked leaf (``optax.MaskedNode``, or the empty node a checkpoint restores in
  its place) has none."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path), np.shape(leaf)) for path, leaf in flat]


def split_by_layer(opt_state: Any, stage_params: Sequence[Any]) -> tuple[list[np.ndarray], list[list[Any]]]:
  """Splits one stage's optimizer state.

  Args:
    opt_state: the stage's optax state (host or device arrays).
    stage_params: the stage's params, a list of per-layer pytrees.

  Returns:
    ``(scalars, per_layer)``: the state's leaves outside parameter-shaped parts, in tree order (numpy), and per layer
    of the stage, its parameter-shaped parts in tree order (numpy pytrees).
  """
  is_params = _params_shaped(stage_params)
  nodes = jax.tree.leaves(opt_state, is_leaf=is_params)
  scalars, per_layer = [], [[] for _ in stage_params]
  for node in nodes:
    if is_params(node):
      for i, part in enumerate(node):
        per_layer[i].append(jax.tree.map(np.asarray, part))
    else:
      scalars.append(np.asarray(node))
  return scalars, per_layer


def join_layers(optimizer: optax.GradientTransformation, stage_params: Sequence[Any], scalars: Sequence[Any],
                per_layer: Sequence[Sequence[Any]]) -> Any:
  """Builds a stage's optimizer state from :func:`split_by_layer` parts (of any partition's stages).

  Args:
    optimizer: the optax transformation (its ``init`` gives the state's structure).
    stage_params: the new stage's params (list of per-layer pytrees).
    scalars: the shared leaves, as :func:`split_by_layer` returns them.
    per_layer: per layer of the new stage, its parts.

  Raises:
    ValueError: the parts do not fit the optimizer's state for these layers (another optimizer or model).
  """
  is_params = _params_shaped(stage_params)
  template = optimizer.init(list(stage_params))
  nodes, treedef = jax.tree.flatten(template, is_leaf=is_params)
  if len(per_layer) != len(stage_params):
    raise ValueError(f"{len(per_layer)} layers of optimizer state for a stage of {len(stage_params)} layers")
  out, k, s = [], 0, 0
  for node in nodes:
    if is_params(node):
      parts = [layer[k] for layer in per_layer]
      joined = []
      for want, got in zip(node, parts):
        if _leaf_shapes(want) != _leaf_shapes(got):
          raise ValueError("a layer's optimizer state does not match the model's layer (another model or optimizer)")
        joined.append(jax.tree.unflatten(jax.tree.structure(want), jax.tree.leaves(got)))
      out.append(joined)
      k += 1
    else:
      if s >= len(scalars) or np.shape(scalars[s]) != np.shape(node):
        raise ValueError("the optimizer state's scalars do not match the optimizer (another optimizer)")
      out.append(np.asarray(scalars[s], dtype=np.asarray(node).dtype))
      s += 1
  if s != len(scalars) or any(len(layer) != k for layer in per_layer):
    raise ValueError("the optimizer state has parts this optimizer does not (another optimizer)")
  return jax.tree.unflatten(treedef, out)
