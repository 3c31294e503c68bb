"""Model registry: every model is an ordered list of Flax Linen layers with cut points between them.

A partition is a list of contiguous half-open layer ranges ``[(start, end), ...]`` covering ``0..len(layers)``
exactly once; stage ``s`` runs ``layers[start_s:end_s]`` (HetPipe §4, "Model Partitioning").
"""

from __future__ import annotations

import dataclasses
import importlib
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


def load_model(name: str) -> ModelSpec:
  """The model ``config.model`` names: a registry name, or ``"pkg.module:factory"`` for a user's factory.

  A user factory is a zero-argument callable returning a :class:`ModelSpec`, importable from ``sys.path`` (the
  working directory included); nothing in this package needs editing.

  Raises:
    ValueError: an unknown registry name, a module that does not import, no such factory, a factory that raises or
      returns something other than a :class:`ModelSpec`; the message names ``config.model`` and the fix.
  """
  if ":" not in name:
    return get_model(name)
  module_name, _, attr = name.partition(":")
  fix = "give 'package.module:factory' where factory() returns a hetpipe_jax.models.ModelSpec"
  if not module_name or not attr:
    raise ValueError(f"config.model={name!r} is malformed: {fix}")
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # pylint: disable=broad-except  (user code: any import failure is a config error)
    raise ValueError(f"config.model={name!r}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
                     f"{fix}") from None
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise ValueError(f"config.model={name!r}: module {module_name!r} has no callable {attr!r}; {fix}")
  try:
    spec = factory()
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"config.model={name!r}: {attr}() raised {type(e).__name__}: {e}") from None
  if not isinstance(spec, ModelSpec):
    raise ValueError(f"config.model={name!r}: {attr}() returned {type(spec).__name__}, not a ModelSpec; {fix}")
  if not spec.layers:
    raise ValueError(f"config.model={name!r}: {attr}() returned a ModelSpec with no layers")
  return spec


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


def _import_all() -> None:
  # Importing the modules registers their models.
  from hetpipe_jax.models import cnn, gpt, mlp, resnet  # noqa: F401
  try:
    from hetpipe_jax.models import imagenet  # noqa: F401
  except ImportError:
    pass
