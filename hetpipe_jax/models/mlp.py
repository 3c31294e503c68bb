"""Tiny MLPs for tests and load runs: ``mlp_tiny`` flatten → 32 → 32 → 10 (4 layers, 3 with parameters);
``mlp_deep`` flatten → 32 → 32 → 32 → 10 (5 layers, 4 with parameters: 4 PS shards can each hold one)."""

from __future__ import annotations

import flax.linen as nn

from hetpipe_jax.models.layers import Dense, Flatten
from hetpipe_jax.models.spec import ModelSpec


def mlp_tiny() -> ModelSpec:
  layers = (Flatten(), Dense(32, nn.tanh), Dense(32, nn.tanh), Dense(10))
  return ModelSpec("mlp_tiny", layers, (28, 28, 1), 10)


def mlp_deep() -> ModelSpec:
  layers = (Flatten(), Dense(32, nn.tanh), Dense(32, nn.tanh), Dense(32, nn.tanh), Dense(10))
  return ModelSpec("mlp_deep", layers, (28, 28, 1), 10)
