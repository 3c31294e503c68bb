"""ImageNet-shaped ResNet-152 and VGG-19 (224x224x3, 1000 classes), the models of HetPipe §8.1.

Meant for planning (shape propagation and XLA cost analysis); executing them on a CPU is slow. GroupNorm
replaces BatchNorm: a pipeline stage must be a pure function of (weights, input) (HetPipe §4). Dropout is
omitted for the same reason. Each GroupNorm (with the ReLU after it) is rematerialised: its backward keeps
only its input and recomputes the normalisation, as cuDNN's fused batch norm keeps only ``x`` and the per-channel
mean and inverse deviation (``cudnnBatchNormalizationBackward``; TensorFlow's ``FusedBatchNormGrad``) where
autodiff of GroupNorm would keep two input-sized arrays (``2 x`` from the square and ``x - mean``).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from hetpipe_jax.models.layers import ConvReLU, Dense, Flatten, GlobalAvgPool, MaxPool, relu
from hetpipe_jax.models.spec import ModelSpec

IMAGENET_SHAPE = (224, 224, 3)
IMAGENET_CLASSES = 1000


class NormReLU(nn.Module):
  """GroupNorm (32 groups), then ReLU when ``activation``. ``[b, h, w, c] -> [b, h, w, c]``.

  Used rematerialised (``nn.remat``): the backward keeps only the input (module docstring).
  """

  activation: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.GroupNorm(num_groups=32)(x)
    return relu(x) if self.activation else x


class NormAddReLU(nn.Module):
  """A bottleneck's tail: ``relu(norm(y) + shortcut)``, the shortcut normalised when ``project``.

  ``y``, ``shortcut``: ``[b, h, w, c]`` -> ``[b, h, w, c]``. Used rematerialised: keeps only its inputs.
  """

  project: bool

  @nn.compact
  def __call__(self, y: jax.Array, shortcut: jax.Array) -> jax.Array:
    y = nn.GroupNorm(num_groups=32)(y)
    if self.project:
      shortcut = nn.GroupNorm(num_groups=32)(shortcut)
    return relu(shortcut + y)


class ResNetStem(nn.Module):
  """7x7/2 conv, GroupNorm, ReLU, 3x3/2 max pool. ``[b, 224, 224, 3] -> [b, 56, 56, features]``."""

  features: int = 64

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.Conv(self.features, (7, 7), (2, 2), padding="SAME", use_bias=False)(x)
    x = nn.remat(NormReLU)()(x)
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
    y = nn.remat(NormReLU)()(nn.Conv(self.features, (1, 1), use_bias=False)(x))
    y = nn.Conv(self.features, (3, 3), (self.strides, self.strides), padding="SAME", use_bias=False)(y)
    y = nn.remat(NormReLU)()(y)
    y = nn.Conv(out, (1, 1), use_bias=False)(y)
    project = x.shape[-1] != out or self.strides != 1
    if project:
      x = nn.Conv(out, (1, 1), (self.strides, self.strides), use_bias=False)(x)
    return nn.remat(NormAddReLU)(project)(y, x)


def resnet152_imagenet() -> ModelSpec:
  """Stem, 50 bottleneck blocks (3, 8, 36, 3), global average pool, dense 1000: 53 layers."""
  layers = [ResNetStem(64)]
  for stage, (blocks, features) in enumerate(zip((3, 8, 36, 3), (64, 128, 256, 512))):
    for b in range(blocks):
      layers.append(Bottleneck(features, strides=2 if (b == 0 and stage > 0) else 1))
  layers += [GlobalAvgPool(), Dense(IMAGENET_CLASSES)]
  return ModelSpec("resnet152_imagenet", tuple(layers), IMAGENET_SHAPE, IMAGENET_CLASSES)


def vgg19_imagenet() -> ModelSpec:
  """16 3x3 conv+ReLU layers, 5 max pools, flatten, dense 4096, 4096, 1000: 25 layers (~548 MiB of params)."""
  layers = []
  for features, convs in ((64, 2), (128, 2), (256, 4), (512, 4), (512, 4)):
    layers += [ConvReLU(features) for _ in range(convs)]
    layers.append(MaxPool())
  layers += [Flatten(), Dense(4096, relu), Dense(4096, relu), Dense(IMAGENET_CLASSES)]
  return ModelSpec("vgg19_imagenet", tuple(layers), IMAGENET_SHAPE, IMAGENET_CLASSES)
