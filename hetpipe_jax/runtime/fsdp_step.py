"""Fully sharded data parallelism on one host's devices with ``jax.sharding`` (method ``fsdp``, ZeRO-3).

Runtime layer. The whole model (:class:`hetpipe_jax.models.ModelSpec`) trains as one jitted SPMD step over a 1-D
mesh with axis ``"data"``: the global batch is split evenly along ``"data"`` (each device its ``batch`` examples),
and every parameter, its gradient and its optimizer state are sharded along ``"data"`` on their first axis that N
divides (:func:`leaf_sharding`; a leaf with no such axis, e.g. a scalar step count or a bias of 10, is replicated).
The step computes the mean loss over the global batch and its gradient, constrains the gradient to the parameters'
sharding and applies the optimizer shard by shard. Nothing else is written by hand: XLA's SPMD partitioner inserts
the all-gathers of the parameters where the forward and backward need them and the reduce-scatter of the
gradients, the collectives the cost model (:mod:`hetpipe_jax.costs.fsdp_cost`) counts.

Numerics: the step is one optimizer step on the mean gradient of the global batch, so a plain one-device optax loop
on the same batches (the replay oracle of ``experiments/fsdp_validate.py``, written apart) gives the same weights up
to float reassociation. Only even shards and batches (the ``even`` variant): ``jax.sharding`` splits an axis evenly.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetpipe_jax import models
from hetpipe_jax.runtime import objectives

AXIS = "data"


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
  """A 1-D mesh with axis :data:`AXIS` over ``devices``."""
  return Mesh(np.array(list(devices)), (AXIS,))


def leaf_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
  """The sharding of one parameter (gradient, optimizer-state) leaf: along :data:`AXIS` on its first axis that the
  mesh size divides, else replicated."""
  n = mesh.shape[AXIS]
  for axis, size in enumerate(shape):
    if size >= n and size % n == 0:
      return NamedSharding(mesh, PartitionSpec(*([None] * axis + [AXIS])))
  return NamedSharding(mesh, PartitionSpec())


def tree_shardings(mesh: Mesh, tree: Any) -> Any:
  """:func:`leaf_sharding` of every leaf of ``tree`` (arrays or shape structs)."""
  return jax.tree.map(lambda x: leaf_sharding(mesh, np.shape(x)), tree)


def sharded_fraction(mesh: Mesh, tree: Any) -> float:
  """Bytes of ``tree`` one device holds over the bytes of the whole tree (1/N when every leaf is sharded)."""
  total = held = 0
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(tree_shardings(mesh, tree))):
    nbytes = int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
    total += nbytes
    held += nbytes // (mesh.shape[AXIS] if s.spec else 1)
  return held / total if total else 0.0


def loss_fn(spec: models.ModelSpec) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
  """``(params, x, y) -> mean loss`` of the whole model (the objective of ``spec``)."""
  objective = objectives.get_objective(spec.objective)

  def loss(params, x, y):
    return objective.loss(models.apply_layers(spec.layers, params, x), y)

  return loss


class FsdpTrainer:
  """The sharded training step of ``spec`` with ``optimizer`` over ``devices`` (module docstring).

  Args:
    spec: the model.
    optimizer: the optax optimizer (applied to each shard of the state).
    devices: the mesh's devices (N).
    params: initial parameters (one pytree per layer), e.g. :func:`hetpipe_jax.models.init_layer_params`.

  Attributes:
    params, opt_state: the sharded state (``jax.Array``s with :func:`tree_shardings`).
  """

  def __init__(self, spec: models.ModelSpec, optimizer: optax.GradientTransformation,
               devices: Sequence[jax.Device], params: Any):
    self.mesh = make_mesh(devices)
    self.num_devices = len(devices)
    p_sh = tree_shardings(self.mesh, params)
    self.params = jax.device_put(params, p_sh)
    o_sh = tree_shardings(self.mesh, jax.eval_shape(optimizer.init, params))
    self.opt_state = jax.jit(optimizer.init, out_shardings=o_sh)(self.params)
    self.batch_sharding = NamedSharding(self.mesh, PartitionSpec(AXIS))
    loss = loss_fn(spec)

    def step(params, opt_state, x, y):
      value, grads = jax.value_and_grad(loss)(params, x, y)
      grads = jax.lax.with_sharding_constraint(grads, p_sh)  # the reduce-scatter: each device keeps its shard
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value

    replicated = NamedSharding(self.mesh, PartitionSpec())
    self._step = jax.jit(step, in_shardings=(p_sh, o_sh, self.batch_sharding, self.batch_sharding),
                         out_shardings=(p_sh, o_sh, replicated), donate_argnums=(0, 1))

  def put_batch(self, x: np.ndarray, y: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """The global batch split along :data:`AXIS` (its size must be a multiple of N).

    Raises:
      ValueError: a batch that N devices cannot split evenly.
    """
    if len(x) % self.num_devices:
      raise ValueError(f"global batch {len(x)} is not a multiple of the {self.num_devices} devices")
    return jax.device_put(x, self.batch_sharding), jax.device_put(y, self.batch_sharding)

  def step(self, x: jax.Array, y: jax.Array) -> jax.Array:
    """One training step on the global batch ``(x, y)``; returns its mean loss (replicated scalar)."""
    self.params, self.opt_state, value = self._step(self.params, self.opt_state, x, y)
    return value

  def hlo_collectives(self, x: jax.Array, y: jax.Array) -> dict[str, int]:
    """How many of each collective XLA put in the compiled step (all-gather, reduce-scatter, all-reduce)."""
    text = self._step.lower(self.params, self.opt_state, x, y).compile().as_text()
    return {op: text.count(f" {op}(") + text.count(f" {op}-start(") for op in
            ("all-gather", "reduce-scatter", "all-reduce")}

