"""Model registry: every model is an ordered list of Flax Linen layers with cut points between them.

A partition is a list of contiguous half-open layer ranges ``[(start, end), ...]`` covering ``0..len(layers)``
exactly once; stage ``s`` runs ``layers[start_s:end_s]`` (HetPipe §4, "Model Partitioning").
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model cut into layers.

  Attributes:
    name: registry name.
    layers: ordered Flax Linen modules; layer ``i`` maps the output of layer ``i-1`` to its own output.
    input_shape: one example's shape, e.g. ``(28, 28, 1)`` (height, width, channels).
    num_classes: number of output logits of the last layer.
  """

  name: str
  layers: tuple[nn.Module, ...]
  input_shape: tuple[int, ...]
  num_classes: int

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  def layer_names(self) -> list[str]:
    return [f"{i}:{type(layer).__name__}" for i, layer in enumerate(self.layers)]


_REGISTRY: dict[str, Callable[[], ModelSpec]] = {}


def register_model(name: str) -> Callable[[Callable[[], ModelSpec]], Callable[[], ModelSpec]]:
  """Decorator: registers a zero-argument factory returning a :class:`ModelSpec` under ``name``."""

  def wrap(factory: Callable[[], ModelSpec]) -> Callable[[], ModelSpec]:
    if name in _REGISTRY:
      raise ValueError(f"model {name!r} is registered twice")
    _REGISTRY[name] = factory
    return factory

  return wrap


def available_models() -> list[str]:
  """Names accepted by :func:`get_model`, sorted."""
  _import_all()
  return sorted(_REGISTRY)


def get_model(name: str) -> ModelSpec:
  """Returns the registered model ``name``.

  Raises:
    ValueError: ``name`` is not registered; the message lists the known names.
  """
  _import_all()
  if name not in _REGISTRY:
    raise ValueError(f"unknown model {name!r}: config.model must be one of {sorted(_REGISTRY)}")
  return _REGISTRY[name]()


def init_layer_params(spec: ModelSpec, rng: jax.Array, batch_size: int = 1) -> list:
  """Initialises every layer in order by shape propagation.

  Args:
    spec: the model.
    rng: PRNG key; layer ``i`` uses ``fold_in(rng, i)``.
    batch_size: batch used for shape inference only.

  Returns:
    A list with one params pytree per layer (``{}`` for parameter-free layers).
  """
  x = jnp.zeros((batch_size,) + tuple(spec.input_shape), jnp.float32)
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
  x = jax.ShapeDtypeStruct((batch_size,) + tuple(spec.input_shape), jnp.float32)
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


def _import_all() -> None:
  # Importing the modules registers their models.
  from hetpipe_jax.models import cnn, mlp, resnet  # noqa: F401
  try:
    from hetpipe_jax.models import imagenet  # noqa: F401
  except ImportError:
    pass
