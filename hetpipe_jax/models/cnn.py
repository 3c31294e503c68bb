"""The default CNN for 28×28×1 images (Fashion-MNIST): 7 layers, 6 cut points."""

from __future__ import annotations

from hetpipe_jax.models.layers import ConvReLU, Dense, Flatten, MaxPool, relu
from hetpipe_jax.models.spec import ModelSpec


def cnn() -> ModelSpec:
  """conv32 → pool → conv64 → pool → flatten → dense256 → dense10 (the 2-conv benchmark family)."""
  layers = (
      ConvReLU(32),
      MaxPool(),
      ConvReLU(64),
      MaxPool(),
      Flatten(),
      Dense(256, relu),
      Dense(10),
  )
  return ModelSpec("cnn", layers, (28, 28, 1), 10)


def cnn_small() -> ModelSpec:
  """A narrower variant of ``cnn`` (16/32 channels) for quick runs."""
  layers = (
      ConvReLU(16),
      MaxPool(),
      ConvReLU(32),
      MaxPool(),
      Flatten(),
      Dense(128, relu),
      Dense(10),
  )
  return ModelSpec("cnn_small", layers, (28, 28, 1), 10)
