"""Optimizer states by layer: split a stage's optax state into per-layer parts and build it back for any partition.

Runtime layer. A stage's parameters are a list of per-layer pytrees, so every parameter-shaped part of its optax
state (Adam's ``mu`` and ``nu``, momentum's trace) is a list with one entry per layer, and the rest are shared
scalars (Adam's step ``count``). Checkpoints keep a VW's state as ``(scalars, per-layer parts)``; resuming onto
another partition rebuilds each new stage's state from its layers' parts (issue: resume onto a new plan).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
import optax


def _params_shaped(stage_params: Sequence[Any]):
  treedef = jax.tree.structure(list(stage_params))
  return lambda node: isinstance(node, list) and jax.tree.structure(node) == treedef


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
      for want, got in zip(node, parts):
        if jax.tree.structure(want) != jax.tree.structure(got) or any(
            np.shape(a) != np.shape(b) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got))):
          raise ValueError("a layer's optimizer state does not match the model's layer (another model or optimizer)")
      out.append(parts)
      k += 1
    else:
      if s >= len(scalars) or np.shape(scalars[s]) != np.shape(node):
        raise ValueError("the optimizer state's scalars do not match the optimizer (another optimizer)")
      out.append(np.asarray(scalars[s], dtype=np.asarray(node).dtype))
      s += 1
  if s != len(scalars) or any(len(layer) != k for layer in per_layer):
    raise ValueError("the optimizer state has parts this optimizer does not (another optimizer)")
  return jax.tree.unflatten(treedef, out)
