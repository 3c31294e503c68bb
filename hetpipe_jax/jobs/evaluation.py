"""Test-set evaluation of a flat global weight vector on one device (runs on the PS rank)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hetpipe_jax.data import fashion_mnist
from hetpipe_jax.models import ModelSpec, apply_layers
from hetpipe_jax.runtime.objectives import get_objective
from hetpipe_jax.runtime.param_layout import ParamLayout


class Evaluator:
  """Accuracy and loss of the whole model on a fixed evaluation set, as ``spec.objective`` defines them.

  Args:
    spec: the model.
    layout: the flat weight layout.
    images: the eval inputs ``[n, *spec.input_shape]`` (float32 ``[n, 28, 28, 1]`` images, int32 ``[n, seq]``
      tokens); labels: the eval targets (int32 ``[n]`` labels, int32 ``[n, seq]`` next tokens).
    batch_size: evaluation batch (the last partial batch is padded and masked, so one compilation serves all).
    device: where to evaluate.
  """

  def __init__(self, spec: ModelSpec, layout: ParamLayout, images: np.ndarray, labels: np.ndarray,
               batch_size: int = 1000, device: jax.Device | None = None):
    self.layout = layout
    self.images, self.labels = images, labels
    self.batch_size = min(batch_size, len(labels))
    self.device = device or jax.devices()[0]
    layers = spec.layers
    self.objective = get_objective(spec.objective)
    per_example = self.objective.per_example

    def batch_stats(params, x, y, mask):
      logits = apply_layers(layers, params, x)
      losses, correct = per_example(logits, y)
      return jnp.sum(correct * mask), jnp.sum(losses * mask)

    self._batch_stats = jax.jit(batch_stats)

  def evaluate(self, flat_weights: np.ndarray) -> dict[str, float]:
    """Returns ``{"test_accuracy": fraction correct, "test_loss": mean loss (nats)}`` over all examples, plus the
    objective's extra metrics (``test_bits_per_byte`` for ``next_token``)."""
    params = jax.device_put(self.layout.unflatten(flat_weights), self.device)
    correct, loss_sum, n = 0.0, 0.0, 0
    b = self.batch_size
    for x, y in fashion_mnist.iterate_eval_batches(self.images, self.labels, b):
      m = len(y)
      mask = np.zeros(b, np.float32)
      mask[:m] = 1.0
      if m < b:
        x = np.concatenate([x, np.zeros((b - m,) + x.shape[1:], x.dtype)])
        y = np.concatenate([y, np.zeros((b - m,) + y.shape[1:], y.dtype)])
      c, l = jax.device_get(self._batch_stats(params, *jax.device_put((x, y, mask), self.device)))
      correct += float(c)
      loss_sum += float(l)
      n += m
    return {"test_accuracy": correct / n, "test_loss": loss_sum / n, **self.objective.extra_metrics(loss_sum / n)}
