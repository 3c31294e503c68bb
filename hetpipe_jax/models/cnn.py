"""The default CNN for 28×28×1 images (Fashion-MNIST): 7 layers, 6 cut points."""

from __future__ import annotations

from hetpipe_jax.models.layers import ConvReLU, Dense, Flatten, MaxPool, relu
from hetpipe_jax.models.spec import ModelSpec


def _two_conv(name: str, width: int) -> ModelSpec:
  """conv(width) → pool → conv(2 width) → pool → flatten → dense(8 width) → dense10 on 28×28×1 images."""
  layers = (
      ConvReLU(width),
      MaxPool(),
      ConvReLU(2 * width),
      MaxPool(),
      Flatten(),
      Dense(8 * width, relu),
      Dense(10),
  )
  return ModelSpec(name, layers, (28, 28, 1), 10)


def cnn() -> ModelSpec:
  """conv32 → pool → conv64 → pool → flatten → dense256 → dense10 (the 2-conv benchmark family)."""
  return _two_conv("cnn", 32)


def cnn_small() -> ModelSpec:
  """A narrower variant of ``cnn`` (16/32 channels) for quick runs."""
  return _two_conv("cnn_small", 16)
