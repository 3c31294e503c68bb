"""PipeDream's update rule: per-stage updates with weight stashing and optional vertical sync (PipeDream, SOSP'19
§3.3; the baselines' ``pipedream`` method).

Runtime layer. :class:`PerStageUpdate` is the ``stage`` rule of :mod:`hetpipe_jax.runtime.update_rules`: each stage
keeps its own latest weights; a forward uses them (or, with ``vertical_sync``, the stage's weights after as many own
updates as stage 0's forward of that minibatch used) and its VJP closure stashes them for the backward; right after
its backward (FB on the last stage) the stage applies its own optimizer step, adding the delta to that minibatch's
wave accumulator (with ``grad_clip_norm`` > 0 every stage applies it when the minibatch completes instead, clipped by
its global norm: :mod:`hetpipe_jax.runtime.grad_clip`). At a wave end the VW pushes every stage's wave delta, and a
pull rebases every stage (global + own waves the PS lacks + deltas not pushed yet), under a per-stage lock because
the stage executors update concurrently.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from hetpipe_jax.rules import weight_prediction as rules_wp
from hetpipe_jax.runtime import delay_compensation
from hetpipe_jax.runtime import weight_prediction
from hetpipe_jax.runtime.update_rules import WSPRule
from hetpipe_jax.runtime.vw_state import InFlightMinibatch


class PerStageUpdate(WSPRule):
  """PipeDream's per-stage update (module docstring). Options: ``vertical_sync``, ``delay_compensation`` (DC-ASGD:
  each stage corrects its gradient at its own step against the weights its forward of that minibatch stashed, W_now
  its latest weights; with clipping every stage's gradient is corrected before the norm is taken;
  :mod:`hetpipe_jax.runtime.delay_compensation`), ``weight_prediction`` (each stage's forward of p uses, and stashes,
  W − s·η·d from its weights and its current optimizer state, s its own updates that land between that forward and
  p's update on it: :func:`hetpipe_jax.rules.weight_prediction.pipedream_lookahead`), ``delay_scaled_lr`` (PipeMare:
  each stage's step times τ^−(1 − min(t/T, 1)), τ the stage's own updates since the weights its forward of p used,
  t its updates before this one).

  Attributes:
    stage_params: per stage, its latest weights.
    stage_updates: per stage, its own updates so far (carried over segments).
    stage_forwards: per stage, its forwards so far (carried over segments).
    predictor, pipemare: the remedies' device parts (None when off).
    lookaheads: per stage, per forward in order, its s (also with prediction off).
    pipemare_steps: with ``delay_scaled_lr``, per stage, per update in order, ``(tau, t, factor)``.
    stage_wave_delta: per stage, wave -> its summed delta of that wave, not pushed yet.
    stage_history: vertical sync: per stage, own-update count -> its weights after that many updates.
  """

  OPTIONS = ("vertical_sync", "delay_compensation", "weight_prediction", "delay_scaled_lr")

  def __init__(self, vw: Any, settings):
    super().__init__(vw, settings)
    self.vertical_sync = settings.vertical_sync
    self.stage_updates = [0] * len(vw.stages)
    self.stage_forwards = [0] * len(vw.stages)
    self.compensator = delay_compensation.make(settings, vw)
    self.predictor = weight_prediction.make_predictor(settings)
    self.pipemare = weight_prediction.make_pipemare(settings)
    self.lookaheads: list[list[int]] = [[] for _ in vw.stages]
    self.pipemare_steps: list[list[tuple[int, int, float]]] = [[] for _ in vw.stages]

  def compile(self, params) -> None:
    if self.predictor is not None:
      for s, p in enumerate(params):
        self.predictor.compile(p, self.vw.opt_states[s])

  def reset(self) -> None:
    """Per-stage latest weights, own-update counts (kept), per-wave deltas, version history and locks."""
    super().reset()
    vw = self.vw
    n = len(vw.stages)
    self.stage_params = list(vw.version.params)
    self.stage_wave_delta: list[dict[int, Any]] = [{} for _ in range(n)]
    self.stage_history: list[dict[int, Any]] = ([{k: p} for k, p in zip(self.stage_updates, self.stage_params)]
                                                if self.vertical_sync else [])
    self.stage_locks = [threading.Lock() for _ in range(n)]
    self._used: dict[tuple[int, int], Any] = {}  # delay compensation: (minibatch, stage) -> its forward's weights

  def on_inject(self, rec: Any, version: Any) -> Any:
    rec.stage_versions = [-1] * len(self.vw.stages)
    return version

  def forward_params(self, stage_id: int, mb: InFlightMinibatch) -> Any:
    """The weights stage ``stage_id``'s forward of ``mb`` uses (recorded in ``stage_versions``)."""
    with self.stage_locks[stage_id]:
      if self.vertical_sync and stage_id > 0:
        k = mb.record.stage_versions[0]
        params = self.stage_history[stage_id][k]
      else:
        k = self.stage_updates[stage_id]
        params = self.stage_params[stage_id]
      s = rules_wp.pipedream_lookahead(self.stage_forwards[stage_id], k)
      self.stage_forwards[stage_id] += 1
      self.lookaheads[stage_id].append(s)
      if self.predictor is not None:  # Ŵ: what the forward uses and its VJP closure stashes
        params = self.predictor(params, self.vw.opt_states[stage_id], s, self.stage_updates[stage_id] - k)
    mb.record.stage_versions[stage_id] = k
    if self.compensator is not None:  # W_p of this stage's step (the weights the VJP closure stashes)
      self._used[(mb.record.minibatch_id, stage_id)] = params
    return params

  def on_backward(self, stage_id: int, mb: InFlightMinibatch, grads: Any) -> Any:
    """The stage applies its own update at once, unless clipping needs the minibatch's global norm first (then every
    stage updates when the minibatch completes: grad_clip module docstring)."""
    if self.vw.grad_clip_norm:
      mb.grads[stage_id] = grads
    else:
      self.stage_update(stage_id, mb, grads)
    return grads

  def stage_update(self, s: int, mb: InFlightMinibatch, grads, norm: float | None = None) -> None:
    """Stage ``s`` applies its own optimizer step for ``mb`` (on its executor thread right after its backward; with
    clipping, on the driver's when ``mb`` completes, ``norm`` its global gradient norm)."""
    vw = self.vw
    st = vw.stages[s]
    wave = mb.record.wave_id  # the segment's wave (the job shifts records after the run)
    placed = vw.zero_norms[s] if norm is None else jax.device_put(np.float32(norm), st.device)
    with self.stage_locks[s]:
      if self.compensator is not None and norm is None:  # clipping corrected every stage's gradient already
        grads = self.compensator(s, grads, self.stage_params[s], self._used.pop((mb.record.minibatch_id, s)))
      acc = self.stage_wave_delta[s].get(wave, vw.zeros[s])
      if self.pipemare is None:
        p, o, d = st.update(self.stage_params[s], vw.opt_states[s], grads, acc, placed)
      else:  # PipeMare: τ = this stage's updates since the weights its forward of mb used
        tau, t = self.stage_updates[s] - mb.record.stage_versions[s], self.stage_updates[s]
        factor = self.pipemare.factor(tau, t)
        self.pipemare_steps[s].append((tau, t, factor))
        p, o, d = self.pipemare.update(st, self.stage_params[s], vw.opt_states[s], grads, acc, placed, factor)
      self.stage_params[s] = p
      vw.opt_states[s] = o
      self.stage_wave_delta[s][wave] = d
      self.stage_updates[s] += 1
      if self.vertical_sync:
        self.stage_history[s][self.stage_updates[s]] = p

  def on_complete(self, mb: InFlightMinibatch) -> None:
    """Every stage already applied its own update (or, clipping, applies it now, by the minibatch's global norm);
    the version counts it."""
    vw = self.vw
    if vw.grad_clip_norm:
      if self.compensator is not None:  # the clip sees the corrected gradient; no stage has stepped for mb yet
        for s in range(len(vw.stages)):
          with self.stage_locks[s]:
            mb.grads[s] = self.compensator(s, mb.grads[s], self.stage_params[s],
                                           self._used.pop((mb.record.minibatch_id, s)))
      norm = vw.minibatch_grad_norm(mb)
      # stage 0 last: with vertical sync a later stage's forward looks up the count stage 0's forward saw, which
      # must already be in that stage's history
      for s in reversed(range(len(vw.stages))):
        self.stage_update(s, mb, mb.grads.pop(s), norm)
    vw.version = vw.new_version(vw.version.params, local_updates=vw.version.local_updates + 1)
    if self.vertical_sync:
      self._prune_history()

  def on_wave_end(self, wave_id: int) -> bool:
    """Pushes every stage's delta of wave ``wave_id`` (each stage updated itself after its backwards)."""
    vw = self.vw
    loss_sum = vw.read_losses()
    deltas = []
    for s in range(len(vw.stages)):
      with self.stage_locks[s]:
        deltas.append(self.stage_wave_delta[s].pop(wave_id, vw.zeros[s]))
    flat = vw.flat_of(range(len(vw.stages)), deltas)
    if vw.corrupt_update is not None:
      vw.corrupt_update(wave_id, flat)
    vw.ps.push(wave_id, flat, loss_sum, vw.num_inflight)
    vw.stats.num_pushes += 1
    self.own_waves[wave_id] = deltas
    return False

  def _prune_history(self) -> None:
    """Vertical sync: drops the stage versions no minibatch can still ask for (older than stage 0's forwards of the
    minibatches in flight, and than stage 0's current count)."""
    vw = self.vw
    pending = [r.stage_versions[0] for r in vw.records[-2 * vw.num_inflight - 2:]
               if r.complete_time_s != r.complete_time_s and r.stage_versions[0] >= 0]
    keep = min(pending + [self.stage_updates[0]])
    for s in range(1, len(vw.stages)):
      with self.stage_locks[s]:
        for k in [k for k in self.stage_history[s] if k < keep]:
          del self.stage_history[s][k]

  def on_pull(self, vector_clock, flat: np.ndarray, shard_vector_clocks) -> None:
    """PipeDream's pull: every stage := global + its own pushed waves the PS lacks + its deltas not pushed yet (under
    the stage's lock; with vertical sync the kept history moves by the same correction).

    Raises:
      ValueError: sharded parameter servers (per-stage updates run with one PS).
    """
    vw = self.vw
    if shard_vector_clocks is not None:
      raise ValueError(f"[VW {vw.vw_id}] per-stage updates run with one parameter server, not shards")
    keep = self.keep_own_waves(vector_clock)
    for s, st in enumerate(vw.stages):
      p = vw.stage_params_of(s, flat)
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
    vw.version = vw.new_version(self.stage_params, vector_clock=vector_clock)

  def current_params(self):
    return self.stage_params
