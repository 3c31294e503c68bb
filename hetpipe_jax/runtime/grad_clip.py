"""Gradient clipping by the global norm of a whole minibatch's gradient, whatever the partition (``grad_clip_norm``).

Runtime layer. The rule is optax's ``clip_by_global_norm`` on the whole model (Pascanu et al. 2013): with ``g`` the
minibatch's gradient over every layer and ``n = ||g||_2``, each leaf ``t`` becomes ``t`` when ``n < max_norm``, else
``(t / n) * max_norm``. A stage holds only its layers' part of ``g``, so it cannot compute ``n`` alone: each stage
computes the squared norm of its part (:func:`stage_sq_norm`, one float32 scalar) and the minibatch's stages exchange
these scalars; :func:`global_norm` adds them, and every stage then clips its own part with the same ``n``
(:func:`clip`, inside the stage's jitted update, :mod:`hetpipe_jax.runtime.stages`). So the numerics do not depend on
the partition.

When each method learns ``n`` and applies the clipped update (one rule, these three helpers, for every method):

* **HetPipe** (one process, stage ranks, virtual time): a VW's weights change when a minibatch completes, every stage
  at once (:meth:`~hetpipe_jax.runtime.minibatch_update.PerMinibatchUpdate.apply_update`). Minibatch p completes with
  stage 0's backward, the last of its tasks, so by then every stage's gradient of p exists: the driver adds the stages'
  squared norms and every stage applies its clipped update of p. With stage ranks, a stage rank reports its stages'
  squared norms with its backward's completion (``REPORT``'s last field, :mod:`hetpipe_jax.mpi.stage_link`) and
  the driver sends ``n`` with p's ``UPDATE``.
* **PipeDream** (per-stage updates): without clipping a stage applies its update right after its own backward. With
  clipping that is too early for every stage but stage 0 (n needs stage 0's backward of p, which comes last), so each
  stage keeps its gradient of p and every stage applies its clipped update when p completes; a stage's forwards in
  between use its weights without p's update (one more minibatch of delay on stages > 0, only when clipping is on).
* **GPipe, 1F1B-flush, Horovod** (all-reduce): the step's update is the mean gradient over every VW's micro-batches,
  which every VW holds whole on the host after the all-reduce; ``n`` is its norm (:func:`flat_sq_norm` over the
  whole buffer, in layer order), identical on every replica whatever its partition, so the replicas stay identical.

A run without clipping (``grad_clip_norm = 0``) computes and exchanges nothing.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def stage_sq_norm(grads: Any) -> jax.Array:
  """A stage's part of the squared global norm: the sum of every leaf's squared elements (traced; float32 scalar,
  0 for a stage without parameters)."""
  leaves = jax.tree.leaves(grads)
  total = jnp.zeros((), jnp.float32)
  for leaf in leaves:
    total = total + jnp.sum(jnp.square(leaf.astype(jnp.float32)))
  return total


def flat_sq_norm(flat: np.ndarray) -> float:
  """The squared norm of a host gradient vector (float64 sum, in the vector's order)."""
  flat = np.asarray(flat, np.float64)
  return float(np.dot(flat, flat))


def global_norm(sq_norms: Sequence[float]) -> float:
  """The global norm from the squared norms of its parts (every stage's, in stage order).

  Raises:
    FloatingPointError: a part is NaN or Inf (the minibatch's gradient diverged).
  """
  total = math.fsum(float(x) for x in sq_norms)
  if not math.isfinite(total):
    raise FloatingPointError(f"the gradient's squared norm is {total} (parts {list(sq_norms)}): training diverged; "
                             "lower config.learning_rate")
  return math.sqrt(total)


def clip(grads: Any, norm: jax.Array, max_norm: float) -> Any:
  """``grads`` (a stage's part) clipped as optax's ``clip_by_global_norm(max_norm)`` clips the whole gradient whose
  global norm is ``norm`` (traced; ``norm`` a float32 scalar)."""
  norm = jnp.asarray(norm, jnp.float32)
  keep = norm < max_norm
  return jax.tree.map(lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm), grads)
