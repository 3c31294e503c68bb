"""HetPipe's update rule: every stage steps when a minibatch completes, one weight version per minibatch (§4–§5).

Runtime layer. :class:`PerMinibatchUpdate` is the ``minibatch`` rule of :mod:`hetpipe_jax.runtime.update_rules`:
minibatch p runs on the version it was injected with on every stage; its stages' gradients are kept until p
completes, then every local stage applies its optimizer step together (a new version) and adds the delta to the
wave's. At a wave end the wave's summed delta is pushed to the PS (inline, or on the PS channel thread) and kept
until pulled global weights hold it; a pull installs global weights + the own waves they lack + the current partial
wave (with sharded parameter servers, shard by shard). With stage ranks the driver's changes are sent to the ranks
(:mod:`hetpipe_jax.runtime.placement`) and a stage rank applies the same ones over its own stages
(:meth:`PerMinibatchUpdate.apply_update`, :meth:`~PerMinibatchUpdate.take_wave_delta`,
:meth:`~PerMinibatchUpdate.install_rebased`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import logging
import numpy as np

from hetpipe_jax.ps.shards import rebase_on_shards
from hetpipe_jax.rules import schedule
from hetpipe_jax.rules import weight_prediction as rules_wp
from hetpipe_jax.runtime import delay_compensation
from hetpipe_jax.runtime import weight_prediction
from hetpipe_jax.runtime.update_rules import WSPRule


class PerMinibatchUpdate(WSPRule):
  """HetPipe's per-minibatch update (module docstring). Options: ``max_held``, ``delay_compensation`` (DC-ASGD: at
  completion each stage's gradient is corrected against the version the minibatch ran on, before clipping and the
  step; :mod:`hetpipe_jax.runtime.delay_compensation`; stages in this process only), ``weight_prediction`` (minibatch
  p runs on every stage on W − s·η·d from its injection's weights and optimizer states, s the VW's minibatches in
  flight at p's injection: :func:`hetpipe_jax.rules.weight_prediction.hetpipe_lookahead`), ``delay_scaled_lr``
  (PipeMare: p's step times τ^−(1 − min(t/T, 1)), τ the VW's updates between p's injection and its completion, t the
  VW's updates before p's, counted over the whole run in this process); both with every stage in this process.

  Attributes:
    wave_delta: per stage, the current wave's summed delta (device trees; None for remote stages).
    own_flat: sharded PS or stage ranks: wave -> host copy of the own wave's flat update, until pulled.
    predictor, pipemare: the remedies' device parts (None when off).
    lookaheads: per injected minibatch in order, its s (also with prediction off).
    pipemare_steps: with ``delay_scaled_lr``, per completed minibatch in order, ``(tau, t, factor)``.
  """

  OPTIONS = ("max_held", "delay_compensation", "weight_prediction", "delay_scaled_lr")
  supports_stage_ranks = True
  supports_ps_channel = True

  def __init__(self, vw: Any, settings):
    super().__init__(vw, settings)
    self._max_held = schedule.check_max_held(settings.max_held, len(vw.stages))
    self.own_flat: dict[int, np.ndarray] = {}
    self.compensator = delay_compensation.make(settings, vw)
    if self.compensator is not None and not vw.placement.all_local:
      raise ValueError("delay_compensation='dc' runs with every stage in the VW's process, not on stage ranks")
    self.predictor = weight_prediction.make_predictor(settings)
    self.pipemare = weight_prediction.make_pipemare(settings)
    for name, part in (("weight_prediction", self.predictor), ("delay_scaled_lr", self.pipemare)):
      if part is not None and not vw.placement.all_local:
        raise ValueError(f"{name}={getattr(settings, name)!r} runs with every stage in the VW's process, not on "
                         "stage ranks")
    self.lookaheads: list[int] = []
    self.pipemare_steps: list[tuple[int, int, float]] = []
    self.total_updates = 0  # the VW's own updates in this process (PipeMare's t), carried over segments

  @property
  def max_held(self) -> list[int] | None:
    return self._max_held

  def compile(self, params) -> None:
    if self.predictor is not None:
      for s in self.vw.local_stages:
        self.predictor.compile(params[s], self.vw.opt_states[s])

  def reset(self) -> None:
    super().reset()
    self.wave_delta = list(self.vw.zeros)
    self.own_flat = {}  # a segment starts from global weights that hold every own wave
    self.injected = 0  # this segment's minibatches injected and completed (a segment starts with none in flight)
    self.completed = 0
    self._completed_at_injection: dict[int, int] = {}

  def on_inject(self, rec, version):
    """Counts p's look-ahead s; with prediction, p's version holds Ŵ (same version id and clocks as W)."""
    s = rules_wp.hetpipe_lookahead(self.injected, self.completed)
    self.injected += 1
    self.lookaheads.append(s)
    self._completed_at_injection[rec.minibatch_id] = self.completed
    if self.predictor is None or s == 0:
      return version
    vw = self.vw
    params = list(version.params)
    for k in vw.local_stages:
      params[k] = self.predictor(params[k], vw.opt_states[k], s)
    return dataclasses.replace(version, params=tuple(params))

  def on_complete(self, mb) -> None:
    vw = self.vw
    if self.compensator is not None:  # DC-ASGD: W_now is the version the step applies to, W_p the one mb ran on
      for s in vw.local_stages:
        mb.grads[s] = self.compensator(s, mb.grads[s], vw.version.params[s], mb.version.params[s])
    norm = vw.minibatch_grad_norm(mb) if vw.grad_clip_norm else None
    factor = None
    tau = self.completed - self._completed_at_injection.pop(mb.record.minibatch_id)
    if self.pipemare is not None:  # PipeMare: τ = the VW's updates since p's injection, t = its updates so far
      factor = self.pipemare.factor(tau, self.total_updates)
      self.pipemare_steps.append((tau, self.total_updates, factor))
    self.apply_update(mb, norm, factor)
    self.completed += 1
    self.total_updates += 1
    vw.placement.on_update(mb.record.minibatch_id, vw.version.version_id, norm)

  def apply_update(self, mb, norm: float | None = None, factor: float | None = None) -> None:
    """Minibatch ``mb``'s optimizer step on every local stage: a new weight version, its delta added to the wave's.

    Args:
      mb: the completed minibatch (its stages' gradients in ``mb.grads``).
      norm: with clipping (``grad_clip_norm`` > 0), the minibatch's global gradient norm over every stage
        (``VirtualWorker.minibatch_grad_norm``; a stage rank gets it from the driver); ignored without clipping.
      factor: PipeMare's factor of the step (None: the plain step).
    """
    vw = self.vw
    new_params, new_states, new_deltas = list(vw.version.params), list(vw.opt_states), list(self.wave_delta)
    norms = vw.placed_norms(norm)
    for s in vw.local_stages:
      st = vw.stages[s]
      args = (vw.version.params[s], vw.opt_states[s], mb.grads[s], self.wave_delta[s], norms[s])
      new_params[s], new_states[s], new_deltas[s] = (st.update(*args) if factor is None else
                                                     self.pipemare.update(st, *args, factor))
    vw.opt_states = new_states
    self.wave_delta = new_deltas
    vw.version = vw.new_version(new_params, local_updates=vw.version.local_updates + 1)

  def on_wave_end(self, wave_id: int) -> bool:
    """Pushes wave ``wave_id``'s summed delta and losses to the PS and keeps the delta until the PS holds it.

    Raises:
      FloatingPointError: a loss of the wave is NaN or Inf.
    """
    vw = self.vw
    if vw.ps_channel is not None and vw.ps_channel.running:  # the channel thread pushes (ps_channel module)
      vw.ps_channel.push(wave_id, self.wave_delta, vw.take_wave_losses())
    elif vw.placement.all_local and vw.ps_shards is None:
      vw.push_wave(wave_id, self.wave_delta, vw.take_wave_losses())
    else:
      loss_sum = vw.read_losses()
      # stage ranks: the ranks push their own parts to the shards (placement module)
      flat = vw.placement.wave_flat(vw, wave_id, self.wave_delta)
      self.own_flat[wave_id] = flat.copy()  # the update as computed, before a fault drill can touch it
      if vw.corrupt_update is not None:  # fault drills only (config.debug_nan_update)
        vw.corrupt_update(wave_id, flat)
      vw.ps.push(wave_id, flat, loss_sum, vw.num_inflight)
    vw.stats.num_pushes += 1
    self.own_waves[wave_id] = self.wave_delta
    self.wave_delta = list(vw.zeros)
    return False

  def on_pull(self, vector_clock, flat: np.ndarray, shard_vector_clocks) -> None:
    """Local weights := pulled global weights + own updates the global weights do not hold yet (the own waves beyond
    the vector clock's own entry, then the current partial wave; sharded PS: per shard, the own waves that shard
    lacks, on its layers only)."""
    vw = self.vw
    if shard_vector_clocks is not None:
      self._install_sharded_pull(vector_clock, flat, shard_vector_clocks)
      return
    keep = self.keep_own_waves(vector_clock)
    params = [None] * len(vw.stages)
    placed = vw.ps_channel.take_placed(flat) if vw.ps_channel is not None else None
    for s in vw.local_stages:
      st = vw.stages[s]
      p = placed[s] if placed is not None else vw.stage_params_of(s, flat)
      for c in keep:
        p = st.add(p, self.own_waves[c][s])
      params[s] = st.add(p, self.wave_delta[s])
    vw.version = vw.new_version(params, vector_clock=vector_clock)
    if not vw.placement.all_local:  # the own waves' flat copies (kept with stage ranks only)
      self.own_flat = {c: self.own_flat[c] for c in keep}
    # stage ranks: they rebase their stages on their parts of the same pull
    vw.placement.on_pull(vw.version.version_id, [vector_clock[vw.vw_id]])
    logging.log_every_n_seconds(logging.INFO, "[VW %d] pulled global clock %d, vector clock %s (local clock %d)", 10,
                                vw.vw_id, vw.version.global_clock, list(vector_clock), vw.sync.local_clock)

  def _install_sharded_pull(self, vector_clock, flat, shard_vector_clocks) -> None:
    """:meth:`on_pull` for sharded parameter servers: per shard, pulled slice + own waves it lacks."""
    vw = self.vw
    own_applied = [vc[vw.vw_id] for vc in shard_vector_clocks]
    local, self.own_flat = rebase_on_shards(flat, self.own_flat, own_applied, vw.ps_shards.index)
    self.own_waves = {c: self.own_waves[c] for c in self.own_flat}
    params = [None] * len(vw.stages)
    for s in vw.local_stages:
      params[s] = vw.stages[s].add(vw.stage_params_of(s, local), self.wave_delta[s])
    vw.version = vw.new_version(params, vector_clock=vector_clock,
                                shard_vector_clocks=tuple(tuple(int(c) for c in vc) for vc in shard_vector_clocks))
    vw.placement.on_pull(vw.version.version_id, own_applied)

  # ---------------------------------------------------------------- a stage rank's side
  def take_wave_delta(self) -> np.ndarray:
    """The local stages' wave delta, flat (their layers in stage order), and a fresh zero delta (a stage rank's side
    of a wave end)."""
    vw = self.vw
    flat = vw.flat_of(vw.local_stages, [self.wave_delta[s] for s in vw.local_stages])
    for s in vw.local_stages:
      self.wave_delta[s] = vw.zeros[s]
    return flat

  def install_rebased(self, flat: np.ndarray) -> None:
    """A stage rank's side of a pull: its stages' rebased weights (the pulled global weights plus the own waves the
    PS lacks, computed by the driver; its stages' layers in stage order) plus its current partial wave: a new
    version.

    Raises:
      ValueError: ``flat`` does not hold exactly the local stages' elements.
    """
    vw = self.vw
    params = list(vw.version.params)
    pos = 0
    offsets = vw.layout.layer_offsets
    for s in vw.local_stages:
      start, end = vw.stages[s].layer_range
      n = offsets[end] - offsets[start]
      params[s] = vw.stages[s].add(vw.stage_params_of(s, flat[pos:pos + n]), self.wave_delta[s])
      pos += n
    if pos != flat.size:
      raise ValueError(f"[VW {vw.vw_id}] rebased weights of {flat.size} floats for stages {vw.local_stages} "
                       f"holding {pos}")
    vw.version = vw.new_version(params)

