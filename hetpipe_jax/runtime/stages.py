"""Per-stage jitted functions built from a partition: forward, backward, last-stage forward+loss+backward, update.

Runtime layer. Each stage owns a contiguous layer range, lives on one device, and its functions are jitted once
(per stage; traces are counted in ``Stage.trace_counts`` so tests can catch recompiles). A forward returns its
output and a ``jax.tree_util.Partial`` VJP closure holding the residuals; the backward applies that closure, so it
uses exactly the weights its forward used (HetPipe §4, one weight version per minibatch).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

from hetpipe_jax.models import ModelSpec, apply_layers
from hetpipe_jax.runtime import grad_clip
from hetpipe_jax.runtime.objectives import cross_entropy_loss, get_objective  # noqa: F401  (re-exported)
from hetpipe_jax.runtime import optimizers
from hetpipe_jax.rules.partition import validate_partition

Params = Any  # list of per-layer params pytrees of one stage


@dataclasses.dataclass
class Stage:
  """One pipeline stage: its layers, device and jitted functions.

  Attributes:
    stage_id: 0-based position in the pipeline.
    layer_range: half-open ``(start, end)`` into the model's layers.
    device: the ``jax.Device`` holding this stage's weights, optimizer state and activations.
    is_first / is_last: position flags.
    grad_clip_norm: > 0: ``update`` and ``apply_mean`` clip the gradient by the minibatch's global norm over every
      stage, which they are given (:mod:`hetpipe_jax.runtime.grad_clip`); 0: no clipping.
    trace_counts: how many times each function was traced (1 each after warm-up).
  """

  stage_id: int
  layer_range: tuple[int, int]
  device: jax.Device
  is_first: bool
  is_last: bool
  forward: Any = None
  backward: Any = None
  forward_backward: Any = None
  update: Any = None
  update_scaled: Any = None
  add: Any = None
  ravel: Any = None
  apply_mean: Any = None
  unravel: Any = None
  sq_norm: Any = None
  grad_clip_norm: float = 0.0
  trace_counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def unravel_like(flat: jax.Array, like: Any) -> Any:
  """The inverse of a stage's ``ravel``: float32 ``[n]`` (leaves in ``jax.tree`` order) → a tree of ``like``'s
  structure, shapes and dtypes. Traced inside the stages' jitted functions."""
  leaves, treedef = jax.tree.flatten(like)
  out, pos = [], 0
  for leaf in leaves:
    out.append(flat[pos:pos + leaf.size].reshape(leaf.shape).astype(leaf.dtype))
    pos += leaf.size
  return jax.tree.unflatten(treedef, out)


def build_stages(spec: ModelSpec, partition: Sequence[Sequence[int]], devices: Sequence[jax.Device],
                 optimizer: Any, remat: bool = False, grad_clip_norm: float = 0.0) -> list[Stage]:
  """Builds the stages of one VW.

  Args:
    spec: the model.
    partition: one ``[start, end)`` layer range per stage.
    devices: one device per stage (explicit placement).
    optimizer: the optax transformation each stage updates its own params with, or a
      :class:`hetpipe_jax.runtime.optimizers.PerStage` (each stage's from its layer range).
    (The last stage's loss is ``spec.objective``'s, :mod:`hetpipe_jax.runtime.objectives`.)
    remat: rematerialisation (``jax.checkpoint`` of each stage's layers): a forward keeps only its input, and the
      backward recomputes the activations (GPipe's memory saving; same numerics).
    grad_clip_norm: > 0: every stage's update first clips its gradient by the minibatch's *global* norm over all
      stages (optax's ``clip_by_global_norm`` on the whole model; :mod:`hetpipe_jax.runtime.grad_clip`); 0: off.

  Returns:
    The stages, in pipeline order.

  Raises:
    ValueError: bad partition, not one device per stage, an unknown ``spec.objective``, or ``grad_clip_norm < 0``.
  """
  loss_fn = get_objective(spec.objective).loss
  ranges = validate_partition(partition, spec.num_layers)
  if len(devices) != len(ranges):
    raise ValueError(f"{len(ranges)} stages need {len(ranges)} devices, got {len(devices)}")
  if not grad_clip_norm >= 0:
    raise ValueError(f"grad_clip_norm must be >= 0 (0: no clipping), got {grad_clip_norm}")
  stages = []
  for s, (start, end) in enumerate(ranges):
    st = Stage(s, (start, end), devices[s], is_first=(s == 0), is_last=(s == len(ranges) - 1),
               grad_clip_norm=float(grad_clip_norm))
    _jit_stage(st, spec.layers[start:end], optimizers.for_layers(optimizer, start, end), loss_fn, remat)
    stages.append(st)
  return stages


def _jit_stage(st: Stage, layers: Sequence, optimizer: optax.GradientTransformation, objective_loss: Any,
               remat: bool = False) -> None:
  counts = st.trace_counts
  max_norm = st.grad_clip_norm

  def clipped(grads, norm):
    """The gradient the optimizer sees: clipped by the given global norm when clipping is on."""
    return grad_clip.clip(grads, norm, max_norm) if max_norm > 0 else grads

  def run(params: Params, x: jax.Array) -> jax.Array:
    return apply_layers(layers, params, x)

  if remat:
    run = jax.checkpoint(run)

  def forward(params, x):
    """``[b, ...in] -> ([b, ...out], vjp)``; stage 0's vjp gives only parameter gradients."""
    counts["forward"] += 1
    if st.is_first:
      out, vjp = jax.vjp(lambda p: run(p, x), params)
    else:
      out, vjp = jax.vjp(run, params, x)
    return out, vjp

  def backward(vjp, grad_out):
    """Returns ``(param_grads, input_grad)``; ``input_grad`` is None on stage 0."""
    counts["backward"] += 1
    grads = vjp(grad_out)
    return (grads[0], None) if st.is_first else (grads[0], grads[1])

  def forward_backward(params, x, labels):
    """Last stage: forward + loss + backward as one task. Returns ``(loss, param_grads, input_grad | None)``."""
    counts["forward_backward"] += 1

    def loss_fn(p, a):
      return objective_loss(run(p, a), labels)

    if st.is_first:
      loss, gp = jax.value_and_grad(loss_fn)(params, x)
      return loss, gp, None
    loss, (gp, gx) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, x)
    return loss, gp, gx

  def update(params, opt_state, grads, wave_delta, norm):
    """One optimizer step; returns ``(new_params, new_opt_state, wave_delta + delta)``. ``norm``: the minibatch's
    global gradient norm over every stage (float32 scalar; read only when clipping is on)."""
    counts["update"] += 1
    delta, opt_state = optimizer.update(clipped(grads, norm), opt_state, params)
    return optax.apply_updates(params, delta), opt_state, jax.tree.map(jnp.add, wave_delta, delta)

  def update_scaled(params, opt_state, grads, wave_delta, norm, scale):
    """:func:`update` with the optimizer's update times ``scale`` (float32 scalar): a step of ``scale`` times its
    size, weight decay included (PipeMare's delay-scaled rate, :mod:`hetpipe_jax.runtime.weight_prediction`)."""
    counts["update_scaled"] += 1
    delta, opt_state = optimizer.update(clipped(grads, norm), opt_state, params)
    delta = jax.tree.map(lambda d: (d * scale).astype(d.dtype), delta)
    return optax.apply_updates(params, delta), opt_state, jax.tree.map(jnp.add, wave_delta, delta)

  def add(a, b):
    """Elementwise ``a + b`` of two params trees (rebasing local weights on pulled global ones)."""
    counts["add"] += 1
    return jax.tree.map(jnp.add, a, b)

  def ravel(tree):
    """A params-shaped tree → float32 ``[n]``, its leaves in ``jax.tree`` order (the stage's slice of
    :class:`~hetpipe_jax.runtime.param_layout.ParamLayout`'s flat layout)."""
    counts["ravel"] += 1
    leaves = jax.tree.leaves(tree)
    if not leaves:
      return jnp.zeros((0,), jnp.float32)
    return jnp.concatenate([jnp.ravel(leaf).astype(jnp.float32) for leaf in leaves])

  def apply_mean(params, opt_state, flat_sum, count, norm):
    """One optimizer step with the mean gradient ``flat_sum / count`` (float32 ``[n]`` in :func:`ravel`'s order,
    summed over ``count`` micro-batches); returns ``(new_params, new_opt_state)``. The flush methods' step; ``norm``
    is the mean gradient's global norm over the whole model (read only when clipping is on)."""
    counts["apply_mean"] += 1
    delta, opt_state = optimizer.update(clipped(unravel_like(flat_sum / count, params), norm), opt_state, params)
    return optax.apply_updates(params, delta), opt_state

  def unravel(flat, like):
    """float32 ``[n]`` in :func:`ravel`'s order → a tree shaped like ``like`` (its values are not read): pulled
    weights placed on the device as one buffer and cut up there, instead of one transfer per leaf."""
    counts["unravel"] += 1
    return unravel_like(flat, like)

  def sq_norm(grads):
    """The squared norm of this stage's part of a gradient (float32 scalar; :func:`grad_clip.stage_sq_norm`)."""
    counts["sq_norm"] += 1
    return grad_clip.stage_sq_norm(grads)

  st.forward = jax.jit(forward)
  st.backward = jax.jit(backward)
  st.forward_backward = jax.jit(forward_backward)
  st.update = jax.jit(update)
  st.update_scaled = jax.jit(update_scaled)
  st.add = jax.jit(add)
  st.ravel = jax.jit(ravel)
  st.apply_mean = jax.jit(apply_mean)
  st.unravel = jax.jit(unravel)
  st.sq_norm = jax.jit(sq_norm)
