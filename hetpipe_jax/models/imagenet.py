"""ImageNet-shaped ResNet-152 and VGG-19 (224x224x3, 1000 classes), the models of HetPipe §8.1.

Meant for planning (shape propagation and XLA cost analysis); executing them on a CPU is slow. GroupNorm
replaces BatchNorm: a pipeline stage must be a pure function of (weights, input) (HetPipe §4). Dropout is
omitted for the same reason.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from hetpipe_jax.models import ModelSpec, register_model
from hetpipe_jax.models.layers import ConvReLU, Dense, Flatten, GlobalAvgPool, MaxPool

IMAGENET_SHAPE = (224, 224, 3)
IMAGENET_CLASSES = 1000


class ResNetStem(nn.Module):
  """7x7/2 conv, GroupNorm, ReLU, 3x3/2 max pool. ``[b, 224, 224, 3] -> [b, 56, 56, features]``."""

  features: int = 64

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.Conv(self.features, (7, 7), (2, 2), padding="SAME", use_bias=False)(x)
    x = nn.relu(nn.GroupNorm(num_groups=32)(x))
    return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")


class Bottleneck(nn.Module):
  """1x1 -> 3x3/stride -> 1x1 (x4) bottleneck with GroupNorm and a projection shortcut when shapes change.

  ``[b, h, w, c] -> [b, h/strides, w/strides, 4 * features]``.
  """

  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    out = 4 * self.features
    y = nn.relu(nn.GroupNorm(num_groups=32)(nn.Conv(self.features, (1, 1), use_bias=False)(x)))
    y = nn.Conv(self.features, (3, 3), (self.strides, self.strides), padding="SAME", use_bias=False)(y)
    y = nn.relu(nn.GroupNorm(num_groups=32)(y))
    y = nn.GroupNorm(num_groups=32)(nn.Conv(out, (1, 1), use_bias=False)(y))
    if x.shape[-1] != out or self.strides != 1:
      x = nn.Conv(out, (1, 1), (self.strides, self.strides), use_bias=False)(x)
      x = nn.GroupNorm(num_groups=32)(x)
    return nn.relu(x + y)


@register_model("resnet152_imagenet")
def resnet152_imagenet() -> ModelSpec:
  """Stem, 50 bottleneck blocks (3, 8, 36, 3), global average pool, dense 1000: 53 layers."""
  layers = [ResNetStem(64)]
  for stage, (blocks, features) in enumerate(zip((3, 8, 36, 3), (64, 128, 256, 512))):
    for b in range(blocks):
      layers.append(Bottleneck(features, strides=2 if (b == 0 and stage > 0) else 1))
  layers += [GlobalAvgPool(), Dense(IMAGENET_CLASSES)]
  return ModelSpec("resnet152_imagenet", tuple(layers), IMAGENET_SHAPE, IMAGENET_CLASSES)


@register_model("vgg19_imagenet")
def vgg19_imagenet() -> ModelSpec:
  """16 3x3 conv+ReLU layers, 5 max pools, flatten, dense 4096, 4096, 1000: 25 layers (~548 MiB of params)."""
  layers = []
  for features, convs in ((64, 2), (128, 2), (256, 4), (512, 4), (512, 4)):
    layers += [ConvReLU(features) for _ in range(convs)]
    layers.append(MaxPool())
  layers += [Flatten(), Dense(4096, nn.relu), Dense(4096, nn.relu), Dense(IMAGENET_CLASSES)]
  return ModelSpec("vgg19_imagenet", tuple(layers), IMAGENET_SHAPE, IMAGENET_CLASSES)
