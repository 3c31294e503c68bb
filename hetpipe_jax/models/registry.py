"""The model registry: every built-in model by name, and a user's ``"pkg.module:factory"`` (``config.model``).

The model modules define zero-argument factories returning a :class:`~hetpipe_jax.models.spec.ModelSpec`;
:data:`FACTORIES` names them (the modules never import the registry).
"""

from __future__ import annotations

from typing import Callable

from hetpipe_jax.models import cnn, gpt, imagenet, mlp, resnet
from hetpipe_jax.models.spec import ModelSpec
from hetpipe_jax.user_code import load_factory

FACTORIES: dict[str, Callable[[], ModelSpec]] = {
    "cnn": cnn.cnn,
    "cnn_small": cnn.cnn_small,
    "mlp_tiny": mlp.mlp_tiny,
    "mlp_deep": mlp.mlp_deep,
    "resnet": resnet.resnet,
    "gpt_tiny": gpt.gpt_tiny,
    "gpt_bytes": gpt.gpt_bytes,
    "gpt2_small": gpt.gpt2_small,
    "gpt2_medium": gpt.gpt2_medium,
    "gpt2_large": gpt.gpt2_large,
    "resnet152_imagenet": imagenet.resnet152_imagenet,
    "vgg19_imagenet": imagenet.vgg19_imagenet,
}


def available_models() -> list[str]:
  """Names accepted by :func:`get_model`, sorted."""
  return sorted(FACTORIES)


def get_model(name: str) -> ModelSpec:
  """Returns the registered model ``name``.

  Raises:
    ValueError: ``name`` is not registered; the message lists the known names.
  """
  if name not in FACTORIES:
    raise ValueError(f"unknown model {name!r}: config.model must be one of {sorted(FACTORIES)}")
  return FACTORIES[name]()


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
  factory = load_factory("config.model", name, fix, ValueError)
  try:
    spec = factory()
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"config.model={name!r}: {attr}() raised {type(e).__name__}: {e}") from None
  if not isinstance(spec, ModelSpec):
    raise ValueError(f"config.model={name!r}: {attr}() returned {type(spec).__name__}, not a ModelSpec; {fix}")
  if not spec.layers:
    raise ValueError(f"config.model={name!r}: {attr}() returned a ModelSpec with no layers")
  return spec


def example_unit(model: str) -> str:
  """What one example of ``model`` is in rates: ``images`` (classification) or ``sequences`` (language models)."""
  return "sequences" if get_model(model).objective == "next_token" else "images"
