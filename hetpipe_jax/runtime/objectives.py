"""Objectives: the loss a model trains on and the metrics it is evaluated by, named by ``ModelSpec.objective``.

Runtime layer. The last pipeline stage (:mod:`hetpipe_jax.runtime.stages`), virtual time (the same stages), the
evaluator (:mod:`hetpipe_jax.jobs.evaluation`) and the outputs all take the objective from here, so a model's loss
exists once. Losses are in nats; a byte-level language model's next-token loss in bits per byte is ``loss / ln 2``
(one token is one byte).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax


def cross_entropy_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy (nats). logits ``[b, classes]``, labels ``[b]`` int32 → scalar; also logits
  ``[b, seq, vocab]`` with labels ``[b, seq]`` (the mean over every position: the next-token loss)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _classification_per_example(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  losses = jax.vmap(cross_entropy_loss)(logits[:, None, :], labels[:, None])
  return losses, (jnp.argmax(logits, -1) == labels).astype(jnp.float32)


def _next_token_per_example(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  losses = jax.vmap(cross_entropy_loss)(logits, targets)  # mean over the sequence's positions
  return losses, jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32), axis=-1)


def _no_extra(test_loss: float) -> dict[str, float]:
  del test_loss
  return {}


def _bits_per_byte(test_loss: float) -> dict[str, float]:
  return {"test_bits_per_byte": test_loss / math.log(2.0)}


@dataclasses.dataclass(frozen=True)
class Objective:
  """A loss and its evaluation metrics.

  Attributes:
    name: the ``ModelSpec.objective`` value.
    loss: ``(logits, targets) -> scalar`` mean loss of a minibatch in nats (what the last stage differentiates).
    per_example: ``(logits, targets) -> (loss [b], correct [b])``: each example's mean loss (nats; per token for
      sequences) and its fraction of correct predictions (argmax); the evaluator sums these over the eval split.
    extra_metrics: ``test_loss (nats) -> dict`` of further reported metrics (e.g. ``test_bits_per_byte``).
    loss_unit: what ``loss`` / ``test_loss`` measure, recorded in config.json and summary.json.
    accuracy_meaning: what ``test_accuracy`` measures.
  """

  name: str
  loss: Callable[[jax.Array, jax.Array], jax.Array]
  per_example: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
  extra_metrics: Callable[[float], dict[str, float]]
  loss_unit: str
  accuracy_meaning: str


OBJECTIVES: dict[str, Objective] = {
    "classification": Objective("classification", cross_entropy_loss, _classification_per_example, _no_extra,
                                "nats per example (softmax cross-entropy)", "fraction of examples classified right"),
    "next_token": Objective("next_token", cross_entropy_loss, _next_token_per_example, _bits_per_byte,
                            "nats per token (next-token cross-entropy; bits per byte = nats / ln 2 for byte tokens)",
                            "fraction of next tokens predicted right (argmax)"),
}


def get_objective(name: str) -> Objective:
  """The objective ``name`` (``ModelSpec.objective``).

  Raises:
    ValueError: unknown name; the message lists the known ones.
  """
  if name not in OBJECTIVES:
    raise ValueError(f"unknown objective {name!r}: ModelSpec.objective must be one of {sorted(OBJECTIVES)}")
  return OBJECTIVES[name]
