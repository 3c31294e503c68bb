"""The flush methods' update rule (GPipe, 1F1B-flush, Horovod-style data parallelism): one all-reduced update per
step of M micro-batches.

Runtime layer. :class:`FlushUpdate` is the ``flush`` rule of :mod:`hetpipe_jax.runtime.update_rules`: every backward
adds its gradients to the step's accumulator on its stage's executor thread; after a stage's last backward of the
step its part goes to the host; at a step's end the stages' accumulated gradients and the step's loss sum go to the
``reducer`` as one float32 buffer in layer order (MPI: ``Allreduce``; virtual time: held until the engine's
all-reduce), and :meth:`FlushUpdate.apply_reduced` applies the mean gradient over the N VWs' M micro-batches on every
stage: one new version per step, the same update on every replica (GPipe, Huang et al. 2019 §2.2; Megatron-LM's 1F1B
with flush, Narayanan et al. 2021 §2.2). With ``grad_clip_norm`` the mean gradient is clipped by its global norm over
the whole model, computed from the reduced buffer every replica holds (:mod:`hetpipe_jax.runtime.grad_clip`), so
replicas with different partitions apply the same update. Across VWs: all-reduce BSP
(:class:`hetpipe_jax.rules.allreduce.AllReduceSyncState`), no PS.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hetpipe_jax.rules import allreduce
from hetpipe_jax.runtime import grad_clip
from hetpipe_jax.runtime.update_rules import UpdateRule


class FlushUpdate(UpdateRule):
  """The flush methods' update (module docstring). Options: ``reducer`` (required), ``on_step``.

  Attributes:
    grad_acc: per stage, the step's accumulated gradients (device trees).

  Raises:
    ValueError: no reducer.
  """

  OPTIONS = ("reducer", "on_step")

  def __init__(self, vw: Any, settings):
    super().__init__(vw, settings)
    if settings.reducer is None:
      raise ValueError(f"method {settings.method!r} needs a reducer (the all-reduce across VWs)")
    self.reducer = settings.reducer
    self.on_step = settings.on_step
    # Per stage, on its device, the micro-batches a reduced step sums (N x M: apply_mean's divisor).
    self._divisors = jax.device_put([np.float32(vw.num_virtual_workers * vw.num_inflight)] * len(vw.stages),
                                    [st.device for st in vw.stages])

  def new_sync(self, num_inflight: int, staleness_bound: int, pull_every_wave: bool):
    del pull_every_wave
    if staleness_bound < 0:
      raise ValueError(f"staleness_bound must be >= 0, got {staleness_bound}")
    return allreduce.AllReduceSyncState(num_inflight)

  def compile(self, params) -> None:
    """The flush step's ravel and mean update compile now."""
    vw = self.vw
    jax.block_until_ready([st.apply_mean(p, o, st.ravel(z), d, n)
                           for st, p, o, z, d, n in zip(vw.stages, params, vw.opt_states, vw.zeros,
                                                        self._divisors, vw.zero_norms)])

  def reset(self) -> None:
    self.grad_acc = list(self.vw.zeros)
    # Per stage, its accumulated gradients of the current step on the host, float32 [its params] (written by the
    # stage's executor after its last backward of the step; read at the flush).
    self._step_flat: list = [None] * len(self.vw.stages)

  def on_backward(self, stage_id: int, mb: Any, grads: Any) -> Any:
    """Adds a backward's parameter gradients to the step's accumulator right away, on the stage's executor thread
    (the only writer of ``grad_acc[s]`` during a step; the stage's backwards run in micro-batch order, so the sum is
    the same as adding them at each completion); returns the accumulator."""
    s = stage_id
    st = self.vw.stages[s]
    self.grad_acc[s] = st.add(self.grad_acc[s], grads)
    if (mb.record.minibatch_id + 1) % self.vw.num_inflight == 0:
      # The stage's last micro-batch of the step: its part of the step buffer goes to the host now, off the flush's
      # critical path for every stage but the one that ends the step.
      self._step_flat[s] = jax.device_get(st.ravel(self.grad_acc[s]))
    return self.grad_acc[s]

  def on_complete(self, mb: Any) -> None:
    """Nothing to apply: the micro-batch's backwards added its gradients to the step's accumulator."""
    del mb

  def on_wave_end(self, wave_id: int) -> bool:
    """The step's gradients and loss sum, as one buffer, to the reducer; applies a returned sum (then True)."""
    vw = self.vw
    step = wave_id
    loss_sum = vw.read_losses()
    flats, self._step_flat = self._step_flat, [None] * len(vw.stages)
    buf = np.empty(vw.layout.num_params + 1, np.float32)
    pos = 0
    for flat in flats:
      buf[pos:pos + flat.size] = flat
      pos += flat.size
    buf[-1] = loss_sum
    if vw.corrupt_update is not None:  # fault drills only (config.debug_nan_update)
      vw.corrupt_update(step, buf[:-1])
    self.grad_acc = list(vw.zeros)
    vw.stats.num_pushes += 1
    summed = self.reducer(step, buf)
    if summed is None:
      return False
    self.apply_reduced(step, summed)
    return True

  def apply_reduced(self, step: int, summed: np.ndarray) -> None:
    """Applies the all-reduced step on every stage (an action: the driver advances ``sync``).

    Args:
      step: the step (0-based within the run).
      summed: float32 ``[num_params + 1]``: every VW's accumulated gradients summed, then their loss sums summed.

    Raises:
      FloatingPointError: the reduced gradients hold NaN or Inf (some VW diverged).
    """
    vw = self.vw
    count = vw.num_virtual_workers * vw.num_inflight
    grads = np.asarray(summed[:-1], np.float32)
    if not np.isfinite(grads).all():  # the mean (sum / count, count >= 1) is finite exactly when the sum is
      raise FloatingPointError(f"[VW {vw.vw_id}] the all-reduced gradients of step {step} hold NaN/Inf: training "
                               "diverged; lower config.learning_rate")
    norms = vw.zero_norms
    if vw.grad_clip_norm:  # the mean gradient's norm over the whole model, the same on every replica (grad_clip)
      mean = grads / np.float32(count)  # the division apply_mean makes on the devices (float32, exactly rounded)
      norms = vw.placed_norms(grad_clip.global_norm([grad_clip.flat_sq_norm(mean)]))
    offsets = vw.layout.layer_offsets
    # One contiguous copy per stage (a device array may alias its numpy source on the CPU backend), placed in one
    # call; each stage divides by the count and unflattens on its device.
    slices = jax.device_put([np.array(grads[offsets[st.layer_range[0]]:offsets[st.layer_range[1]]])
                             for st in vw.stages], [st.device for st in vw.stages])
    params, states = [], []
    for s, (st, g, d) in enumerate(zip(vw.stages, slices, self._divisors)):
      p, o = st.apply_mean(vw.version.params[s], vw.opt_states[s], g, d, norms[s])
      params.append(p)
      states.append(o)
    vw.opt_states = states
    done = vw.version.local_updates + 1
    vw.version = vw.new_version(params, local_updates=done, vector_clock=(done,) * vw.num_virtual_workers)
    vw.stats.num_pulls += 1
    if self.on_step is not None:
      self.on_step(step, float(summed[-1]) / count)
