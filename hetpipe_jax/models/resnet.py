"""A deeper ResNet-style CNN for 28×28×1: stem, 6 residual blocks, head (9 layers, 8 cut points).

GroupNorm instead of BatchNorm: a pipeline stage must be a pure function of (weights, input), and batch
statistics would be mutable state outside the weight versions that HetPipe tracks (§4).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from hetpipe_jax.models.layers import Dense, GlobalAvgPool
from hetpipe_jax.models.spec import ModelSpec


class ResidualBlock(nn.Module):
  """Two 3×3 convs with GroupNorm and an identity (or 1×1 projection) shortcut. ``[b,h,w,c] -> [b,h/s,w/s,f]``."""

  features: int
  strides: int = 1
  groups: int = 8

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = nn.Conv(self.features, (3, 3), (self.strides, self.strides), padding="SAME")(x)
    y = nn.relu(nn.GroupNorm(num_groups=self.groups)(y))
    y = nn.Conv(self.features, (3, 3), padding="SAME")(y)
    y = nn.GroupNorm(num_groups=self.groups)(y)
    if x.shape[-1] != self.features or self.strides != 1:
      x = nn.Conv(self.features, (1, 1), (self.strides, self.strides))(x)
    return nn.relu(x + y)


class Stem(nn.Module):
  features: int = 32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.relu(nn.GroupNorm(num_groups=8)(nn.Conv(self.features, (3, 3), padding="SAME")(x)))


def resnet() -> ModelSpec:
  layers = (
      Stem(32),
      ResidualBlock(32),
      ResidualBlock(32),
      ResidualBlock(64, strides=2),
      ResidualBlock(64),
      ResidualBlock(128, strides=2),
      ResidualBlock(128),
      GlobalAvgPool(),
      Dense(10),
  )
  return ModelSpec("resnet", layers, (28, 28, 1), 10)
