"""PipeDream's per-stage updates (weight stashing, optional vertical sync) as actions of a virtual worker
(PipeDream, SOSP'19 §3.3; the baselines' ``pipedream`` method).

Runtime layer. :class:`PerStageUpdates` is a part of :class:`hetpipe_jax.runtime.virtual_worker.VirtualWorker` (it
uses the VW's stages, layout, versions and PS client): each stage keeps its own latest weights; a forward uses them
(or, with ``vertical_sync``, the stage's weights after as many own updates as stage 0's forward of that minibatch used)
and its VJP closure stashes them for the backward; right after its backward (FB on the last stage) the stage applies
its own optimizer step, adding the delta to that minibatch's wave accumulator (with ``grad_clip_norm`` > 0 every stage
applies it when the minibatch completes instead, clipped by its global norm: :mod:`hetpipe_jax.runtime.grad_clip`).
At a wave end the VW pushes every stage's wave delta, and a pull rebases every stage (global + own waves the PS lacks
+ deltas not pushed yet), under a per-stage lock because the stage executors update concurrently.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from hetpipe_jax.runtime.vw_state import InFlightMinibatch


class PerStageUpdates:
  """PipeDream's state and actions of a :class:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker`
  (``method.update == "stage"``)."""

  def _init_stage_state(self, updates: list[int] | None = None) -> None:
    """PipeDream: per-stage latest weights, own-update counts, per-wave deltas, version history and locks."""
    n = len(self.stages)
    self.stage_params = list(self.version.params)
    self.stage_updates = list(updates) if updates is not None else [0] * n
    self.stage_wave_delta: list[dict[int, Any]] = [{} for _ in range(n)]
    self.stage_history: list[dict[int, Any]] = ([{k: p} for k, p in zip(self.stage_updates, self.stage_params)]
                                                if self.vertical_sync else [])
    self.stage_locks = [threading.Lock() for _ in range(n)]

  def _stage_update(self, s: int, mb: InFlightMinibatch, grads, norm: float | None = None) -> None:
    """PipeDream: stage ``s`` applies its own optimizer step for ``mb`` (on its executor thread right after its
    backward; with clipping, on the driver's when ``mb`` completes, ``norm`` its global gradient norm)."""
    st = self.stages[s]
    wave = mb.record.wave_id  # the segment's wave (the job shifts records after the run)
    placed = self._zero_norms[s] if norm is None else jax.device_put(np.float32(norm), st.device)
    with self.stage_locks[s]:
      acc = self.stage_wave_delta[s].get(wave, self._zeros[s])
      p, o, d = st.update(self.stage_params[s], self.opt_states[s], grads, acc, placed)
      self.stage_params[s] = p
      self.opt_states[s] = o
      self.stage_wave_delta[s][wave] = d
      self.stage_updates[s] += 1
      if self.vertical_sync:
        self.stage_history[s][self.stage_updates[s]] = p

  def _stage_forward_params(self, s: int, mb: InFlightMinibatch):
    """PipeDream: the weights stage ``s``'s forward of ``mb`` uses (recorded in ``stage_versions``)."""
    with self.stage_locks[s]:
      if self.vertical_sync and s > 0:
        k = mb.record.stage_versions[0]
        params = self.stage_history[s][k]
      else:
        k = self.stage_updates[s]
        params = self.stage_params[s]
    mb.record.stage_versions[s] = k
    return params

  def _push_stage_waves(self, wave_id: int) -> bool:
    """PipeDream: pushes every stage's delta of wave ``wave_id`` (each stage updated itself after its backwards)."""
    loss_sum = self._read_losses()
    deltas = []
    for s in range(len(self.stages)):
      with self.stage_locks[s]:
        deltas.append(self.stage_wave_delta[s].pop(wave_id, self._zeros[s]))
    flat = self._flat_of(range(len(self.stages)), deltas)
    if self.corrupt_update is not None:
      self.corrupt_update(wave_id, flat)
    self.ps.push(wave_id, flat, loss_sum, self.num_inflight)
    self.stats.num_pushes += 1
    self.own_waves[wave_id] = deltas
    return False

  def _prune_history(self) -> None:
    """Vertical sync: drops the stage versions no minibatch can still ask for (older than stage 0's forwards of the
    minibatches in flight, and than stage 0's current count)."""
    pending = [r.stage_versions[0] for r in self.records[-2 * self.num_inflight - 2:]
               if r.complete_time_s != r.complete_time_s and r.stage_versions[0] >= 0]
    keep = min(pending + [self.stage_updates[0]])
    for s in range(1, len(self.stages)):
      with self.stage_locks[s]:
        for k in [k for k in self.stage_history[s] if k < keep]:
          del self.stage_history[s][k]

  def _install_pull_per_stage(self, vector_clock, flat: np.ndarray, keep: list[int]) -> None:
    """PipeDream's pull: every stage := global + its own pushed waves the PS lacks + its deltas not pushed yet (under
    the stage's lock; with vertical sync the kept history moves by the same correction)."""
    for s, st in enumerate(self.stages):
      p = self._stage_params_of(s, flat)
      for c in keep:
        p = st.add(p, self.own_waves[c][s])
      with self.stage_locks[s]:
        for _, d in sorted(self.stage_wave_delta[s].items()):
          p = st.add(p, d)
        if self.vertical_sync:
          correction = jax.tree.map(lambda a, b: a - b, p, self.stage_params[s])
          for k in self.stage_history[s]:
            self.stage_history[s][k] = st.add(self.stage_history[s][k], correction)
        self.stage_params[s] = p
    self.version = self._new_version(self.stage_params, vector_clock=vector_clock)

