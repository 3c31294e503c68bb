"""A tiny MLP for tests: flatten → 32 → 32 → 10 (4 layers, 3 cut points)."""

from __future__ import annotations

import flax.linen as nn

from hetpipe_jax.models.layers import Dense, Flatten
from hetpipe_jax.models.spec import ModelSpec


def mlp_tiny() -> ModelSpec:
  layers = (Flatten(), Dense(32, nn.tanh), Dense(32, nn.tanh), Dense(10))
  return ModelSpec("mlp_tiny", layers, (28, 28, 1), 10)
