"""A model cut into layers: an ordered list of Flax Linen layers with cut points between them.

A partition is a list of contiguous half-open layer ranges ``[(start, end), ...]`` covering ``0..len(layers)``
exactly once; stage ``s`` runs ``layers[start_s:end_s]`` (HetPipe §4, "Model Partitioning").
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model cut into layers.

  Attributes:
    name: registry name.
    layers: ordered Flax Linen modules; layer ``i`` maps the output of layer ``i-1`` to its own output.
    input_shape: one example's shape, e.g. ``(28, 28, 1)`` (height, width, channels) or ``(seq_len,)`` (tokens).
    num_classes: number of output logits of the last layer (the vocabulary size of a language model).
    input_dtype: dtype of one example (``"float32"`` images, ``"int32"`` token ids).
    objective: the loss and metric, a name in :mod:`hetpipe_jax.models.objectives`: ``"classification"``
      (cross-entropy over ``[b, classes]`` logits with ``[b]`` labels; accuracy) or ``"next_token"`` (cross-entropy
      over ``[b, seq_len, vocab]`` logits with ``[b, seq_len]`` next tokens, reported in bits per byte; next-token
      accuracy). Runtime, virtual time, evaluation and outputs all use it.
  """

  name: str
  layers: tuple[nn.Module, ...]
  input_shape: tuple[int, ...]
  num_classes: int
  input_dtype: str = "float32"
  objective: str = "classification"

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  def layer_names(self) -> list[str]:
    return [f"{i}:{type(layer).__name__}" for i, layer in enumerate(self.layers)]


def init_layer_params(spec: ModelSpec, rng: jax.Array, batch_size: int = 1) -> list:
  """Initialises every layer in order by shape propagation.

  Args:
    spec: the model.
    rng: PRNG key; layer ``i`` uses ``fold_in(rng, i)``.
    batch_size: batch used for shape inference only.

  Returns:
    A list with one params pytree per layer (``{}`` for parameter-free layers).
  """
  x = jnp.zeros((batch_size,) + tuple(spec.input_shape), spec.input_dtype)
  params = []
  for i, layer in enumerate(spec.layers):
    variables = layer.init(jax.random.fold_in(rng, i), x)
    p = variables.get("params", {})
    params.append(p)
    x = layer.apply({"params": p}, x)
  return params


def activation_shapes(spec: ModelSpec, batch_size: int) -> list[tuple[int, ...]]:
  """Output shape of every layer for a batch of ``batch_size`` (abstract evaluation, nothing runs)."""
  shapes = []
  x = jax.ShapeDtypeStruct((batch_size,) + tuple(spec.input_shape), spec.input_dtype)
  for i, layer in enumerate(spec.layers):
    variables = jax.eval_shape(layer.init, jax.random.key(0), x)
    x = jax.eval_shape(lambda v, a, layer=layer: layer.apply(v, a), variables, x)
    shapes.append(tuple(x.shape))
  return shapes


def apply_layers(layers: Sequence[nn.Module], params: Sequence, x: jax.Array) -> jax.Array:
  """Runs ``layers`` in order with their ``params`` on ``x`` (pure; used inside stage functions)."""
  for layer, p in zip(layers, params):
    x = layer.apply({"params": p}, x)
  return x
