"""Small Linen building blocks used as pipeline layers (one block = one cut-able unit)."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


@jax.custom_vjp
def relu(x: jax.Array) -> jax.Array:
  """``max(x, 0)``, elementwise; its backward keeps only the 1-byte mask ``x > 0``.

  Same values and gradients as ``flax.linen.relu`` (gradient 0 at ``x = 0``), but ``nn.relu``'s JVP rule
  ``select(x > 0, g, full_like(g, 0))`` makes ``jax.vjp`` keep the broadcast zeros as a residual: a full-size
  float32 array that a jitted forward returns (and a pipeline stage holds per in-flight minibatch) although it
  carries no data. A fused GPU framework keeps no such array (TensorFlow's ``ReluGrad`` reads the ReLU's output,
  which the next layer keeps anyway), so this is what the memory model's stash (HetPipe §4) should see.

  Args:
    x: any shape, float.

  Returns:
    Same shape and dtype as ``x``.
  """
  return jnp.maximum(x, 0)


def _relu_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  return jnp.maximum(x, 0), x > 0


def _relu_bwd(mask: jax.Array, g: jax.Array) -> tuple[jax.Array]:
  return (jnp.where(mask, g, jnp.zeros_like(g)),)


relu.defvjp(_relu_fwd, _relu_bwd)


class ConvReLU(nn.Module):
  """3×3 (by default) 'SAME' convolution followed by ReLU. ``[b, h, w, c] -> [b, h, w, features]``."""

  features: int
  kernel_size: tuple[int, int] = (3, 3)
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return relu(nn.Conv(self.features, self.kernel_size, self.strides, padding="SAME")(x))


class MaxPool(nn.Module):
  """2×2 max pooling with stride 2. ``[b, h, w, c] -> [b, h/2, w/2, c]``."""

  window: int = 2

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.max_pool(x, (self.window, self.window), strides=(self.window, self.window))


class Flatten(nn.Module):
  """``[b, ...] -> [b, prod(...)]``."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return x.reshape((x.shape[0], -1))


class GlobalAvgPool(nn.Module):
  """``[b, h, w, c] -> [b, c]``."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return jnp.mean(x, axis=(1, 2))


class Dense(nn.Module):
  """Dense layer with an optional activation. ``[b, d] -> [b, features]``."""

  features: int
  activation: Callable[[jax.Array], jax.Array] | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.Dense(self.features)(x)
    return self.activation(x) if self.activation is not None else x
