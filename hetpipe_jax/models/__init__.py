"""Models as ordered lists of Flax Linen layers with cut points between them (HetPipe §4, "Model Partitioning").

:mod:`~hetpipe_jax.models.spec` (the :class:`ModelSpec` and its jax helpers) and
:mod:`~hetpipe_jax.models.registry` (the built-in models by name, a user's factory) are the package's interface;
the model modules (``cnn``, ``mlp``, ``resnet``, ``gpt``, ``imagenet``) import only ``spec`` and ``layers``.
"""

from hetpipe_jax.models.registry import FACTORIES, available_models, example_unit, get_model, load_model
from hetpipe_jax.models.spec import ModelSpec, activation_shapes, apply_layers, init_layer_params

__all__ = ["FACTORIES", "ModelSpec", "activation_shapes", "apply_layers", "available_models", "example_unit",
           "get_model", "init_layer_params", "load_model"]
