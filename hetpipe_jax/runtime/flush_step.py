"""The flush methods' step end (GPipe, 1F1B-flush, Horovod-style data parallelism) as actions of a virtual worker.

Runtime layer. :class:`FlushStep` is a part of :class:`hetpipe_jax.runtime.virtual_worker.VirtualWorker`: at a step's
end the stages' accumulated gradients (each stage's part put on the host after its last backward of the step) and the
step's loss sum go to the ``reducer`` as one float32 buffer in layer order (MPI: ``Allreduce``; virtual time: held
until the engine's all-reduce), and :meth:`FlushStep.apply_reduced` applies the mean gradient over the N VWs' M
micro-batches on every stage: one new version per step, the same update on every replica (GPipe, Huang et al. 2019
§2.2; Megatron-LM's 1F1B with flush, Narayanan et al. 2021 §2.2). With ``grad_clip_norm`` the mean gradient is
clipped by its global norm over the whole model, computed from the reduced buffer every replica holds
(:mod:`hetpipe_jax.runtime.grad_clip`), so replicas with different partitions apply the same update.
"""

from __future__ import annotations

import numpy as np
import jax

from hetpipe_jax.runtime import grad_clip


class FlushStep:
  """The flush methods' step end of a :class:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker`
  (``method.is_flush``)."""

  def _reduce_step(self, step: int) -> bool:
    """Flush methods: the step's gradients and loss sum, as one buffer, to the reducer; applies a returned sum."""
    loss_sum = self._read_losses()
    flats, self._step_flat = self._step_flat, [None] * len(self.stages)
    buf = np.empty(self.layout.num_params + 1, np.float32)
    pos = 0
    for flat in flats:
      buf[pos:pos + flat.size] = flat
      pos += flat.size
    buf[-1] = loss_sum
    if self.corrupt_update is not None:  # fault drills only (config.debug_nan_update)
      self.corrupt_update(step, buf[:-1])
    self.grad_acc = list(self._zeros)
    self.stats.num_pushes += 1
    summed = self.reducer(step, buf)
    if summed is None:
      return False
    self.apply_reduced(step, summed)
    return True

  def apply_reduced(self, step: int, summed: np.ndarray) -> None:
    """Flush methods: applies the all-reduced step on every stage (an action: the driver advances ``sync``).

    Args:
      step: the step (0-based within the run).
      summed: float32 ``[num_params + 1]``: every VW's accumulated gradients summed, then their loss sums summed.

    Raises:
      FloatingPointError: the reduced gradients hold NaN or Inf (some VW diverged).
    """
    count = self.num_virtual_workers * self.num_inflight
    grads = np.asarray(summed[:-1], np.float32)
    if not np.isfinite(grads).all():  # the mean (sum / count, count >= 1) is finite exactly when the sum is
      raise FloatingPointError(f"[VW {self.vw_id}] the all-reduced gradients of step {step} hold NaN/Inf: training "
                               "diverged; lower config.learning_rate")
    norms = self._zero_norms
    if self.grad_clip_norm:  # the mean gradient's norm over the whole model, the same on every replica (grad_clip)
      mean = grads / np.float32(count)  # the division apply_mean makes on the devices (float32, exactly rounded)
      norms = self._placed_norms(grad_clip.global_norm([grad_clip.flat_sq_norm(mean)]))
    offsets = self.layout.layer_offsets
    # One contiguous copy per stage (a device array may alias its numpy source on the CPU backend), placed in one
    # call; each stage divides by the count and unflattens on its device.
    slices = jax.device_put([np.array(grads[offsets[st.layer_range[0]]:offsets[st.layer_range[1]]])
                             for st in self.stages], [st.device for st in self.stages])
    params, states = [], []
    for s, (st, g, d) in enumerate(zip(self.stages, slices, self._divisors)):
      p, o = st.apply_mean(self.version.params[s], self.opt_states[s], g, d, norms[s])
      params.append(p)
      states.append(o)
    self.opt_states = states
    done = self.version.local_updates + 1
    self.version = self._new_version(params, local_updates=done, vector_clock=(done,) * self.num_virtual_workers)
    self.stats.num_pulls += 1
    if self.on_step is not None:
      self.on_step(step, float(summed[-1]) / count)

