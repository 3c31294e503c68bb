"""When a virtual worker's optimizer steps land: the update rules' common interface and settings.

Runtime layer. A :class:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker` owns the weight versions (the current
:class:`~hetpipe_jax.runtime.vw_state.WeightVersion`, the optimizer states, the records) and one update rule, chosen
by the method's ``update`` field in the :mod:`hetpipe_jax.rules.methods` table (the VW's registry maps it to a class,
as ``torch.distributed.pipelining``'s ``get_schedule_class`` maps a schedule's name):

============ ================================================== ==============================================
``update``   class                                              methods
============ ================================================== ==============================================
minibatch    :class:`~hetpipe_jax.runtime.minibatch_update.     hetpipe: every stage when a minibatch
             PerMinibatchUpdate`                                 completes, one version per minibatch
stage        :class:`~hetpipe_jax.runtime.pipedream_updates.    pipedream: each stage after its own backward
             PerStageUpdate`                                     (weight stashing, optional vertical sync)
flush        :class:`~hetpipe_jax.runtime.flush_step.           gpipe, 1f1b_flush, horovod: one all-reduced
             FlushUpdate`                                        update per step of M micro-batches
============ ================================================== ==============================================

A rule owns its state and is called at fixed points of a run (:class:`UpdateRule`'s hooks, in the order a minibatch
meets them): ``on_inject`` (a new record; may choose the version the minibatch runs on), ``forward_params`` (the
weights a stage's forward uses), ``on_backward`` (a stage's parameter gradients), ``on_complete`` (the minibatch's
last task), ``on_wave_end`` (a wave's, or a step's, end), ``on_pull`` (pulled global weights) and ``reset`` (a new
WSP segment). Options of a rule are fields of :class:`UpdateSettings`; each class names the ones it takes
(``OPTIONS``) and any other set option is one error naming it. Staleness remedies are options of
this kind, with no new switch: weight prediction at injection returns the predicted version from ``on_inject``
(minibatch p then runs forward and backward on it and holds it); delay-compensated gradients (DC-ASGD) correct
``mb.grads`` in ``on_complete`` before the step, against ``mb.version`` (the version p used, already held); delay-aware
steps scale the step in ``on_complete`` (PipeMare's per-minibatch rate) or the wave's update in ``on_wave_end``
(the PS-side scaling by staleness reads the wave's vector clocks there).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from hetpipe_jax.rules import delay_compensation as delay_compensation_lib
from hetpipe_jax.rules import weight_prediction as weight_prediction_lib
from hetpipe_jax.rules import wsp


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
  """The VW's method, optimizer and its update rule's options.

  Attributes:
    optimizer: optax transformation, or a :class:`hetpipe_jax.runtime.optimizers.PerStage` (each stage keeps its own
      state on its device).
    method: the training method (:mod:`hetpipe_jax.rules.methods`); its ``update`` field picks the rule.
    vertical_sync: per-stage rule (pipedream): every stage uses, for a minibatch, its weights after as many own
      updates as stage 0 used for it (PipeDream's vertical sync); False: each stage's latest weights.
    max_held: per-minibatch rule (hetpipe): per stage, the most minibatches it may hold (the memory caps of
      :class:`hetpipe_jax.rules.schedule.PipelineRules`; a ``schedule`` plan's ``held_per_stage``); None: none.
    reducer: flush rule: ``(step, buffer) -> summed buffer | None``; ``buffer`` is float32 ``[num_params + 1]`` (the
      accumulated gradients in layer order, then the step's loss sum); a returned sum over every VW is applied at
      once (MPI), None means the caller applies it later with ``FlushUpdate.apply_reduced`` (virtual time). Required.
    on_step: flush rule: ``(step, mean loss over every VW's micro-batches) -> None`` after each applied step.
    delay_compensation: per-minibatch and per-stage rules: ``"dc"`` corrects each stage's gradient at the step by
      DC-ASGD's g + λ · g ⊙ g ⊙ (W_now − W_p) (:mod:`hetpipe_jax.runtime.delay_compensation`); ``"none"``: off.
    dc_lambda: DC-ASGD's λ ≥ 0 (used with ``delay_compensation="dc"`` only).
    weight_prediction: per-minibatch and per-stage rules: ``"optimizer"`` runs each minibatch on weights predicted
      from the optimizer's next step, W − s·η·d (:mod:`hetpipe_jax.rules.weight_prediction`); ``"none"``: off.
    optimizer_step: the optimizer's hyperparameters prediction reads (:class:`hetpipe_jax.rules.weight_prediction.
      OptimizerStep`; required with ``weight_prediction="optimizer"``, else unused).
    delay_scaled_lr: per-minibatch and per-stage rules: ``"pipemare"`` scales each step by τ^−(1 − min(t/T, 1))
      (PipeMare); ``"none"``: off.
    pipemare_warmup_minibatches: PipeMare's T >= 1 (used with ``delay_scaled_lr="pipemare"`` only).
  """

  optimizer: Any
  method: str = "hetpipe"
  vertical_sync: bool = False
  max_held: Sequence[int] | None = None
  reducer: Callable[[int, np.ndarray], np.ndarray | None] | None = None
  on_step: Callable[[int, float], None] | None = None
  delay_compensation: str = "none"
  dc_lambda: float = delay_compensation_lib.DEFAULT_DC_LAMBDA
  weight_prediction: str = "none"
  optimizer_step: Any = None
  delay_scaled_lr: str = "none"
  pipemare_warmup_minibatches: int = weight_prediction_lib.DEFAULT_PIPEMARE_WARMUP


# The options of UpdateSettings no rule takes by default (every rule takes ``optimizer`` and ``method``; ``dc_lambda``
# is a parameter of ``delay_compensation``, ``optimizer_step`` of ``weight_prediction``, ``pipemare_warmup_minibatches``
# of ``delay_scaled_lr``), and their unset values.
_OPTIONS = tuple(f.name for f in dataclasses.fields(UpdateSettings)
                 if f.name not in ("optimizer", "method", "dc_lambda", "optimizer_step", "pipemare_warmup_minibatches"))
_UNSET = (None, False, "none")


class UpdateRule:
  """An update rule of a :class:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker` (module docstring).

  A rule works on its VW's shared state (``vw.version``, ``vw.opt_states``, the stages and the PS client) through the
  VW's public helpers, and keeps its own state itself. The hooks run on the driver's thread, except
  ``forward_params`` and ``on_backward`` (the stage's executor thread; they touch only that stage's entries).

  Args:
    vw: the VW.
    settings: the method and options (only those in ``OPTIONS`` may be set).

  Attributes:
    OPTIONS: the fields of :class:`UpdateSettings` this rule takes.
    supports_stage_ranks: the rule runs with stages on other ranks (:class:`hetpipe_jax.runtime.placement.
      LinkedStages`).
    supports_ps_channel: the rule's wave pushes and pulls may run on a PS channel thread.

  Raises:
    ValueError: an option the rule does not take is set.
  """

  OPTIONS: tuple[str, ...] = ()
  supports_stage_ranks = False
  supports_ps_channel = False

  def __init__(self, vw: Any, settings: UpdateSettings):
    for name in _OPTIONS:
      value = getattr(settings, name)
      if name not in self.OPTIONS and value not in _UNSET:
        raise ValueError(f"{name} is not a setting of method {settings.method!r} ({type(self).__name__})")
    self.vw = vw
    self.settings = settings

  @property
  def max_held(self) -> list[int] | None:
    """The pipeline's per-stage caps on held minibatches (None: none)."""
    return None

  def new_sync(self, num_inflight: int, staleness_bound: int, pull_every_wave: bool):
    """A fresh synchronisation state (:class:`hetpipe_jax.rules.wsp.VWSyncState` for the PS methods).

    Raises:
      ValueError: bad Nm or D.
    """
    return wsp.VWSyncState(num_inflight, staleness_bound, pull_every_wave)

  def compile(self, params: Sequence[Any]) -> None:
    """Compiles the rule's own device programs now, not at the first step (``params``: per stage, None if remote)."""
    del params

  def reset(self) -> None:
    """The rule's state at the start of a WSP segment (after :meth:`compile`, and at a checkpoint barrier)."""

  def on_inject(self, rec: Any, version: Any) -> Any:
    """Minibatch ``rec``'s injection; returns the weight version it runs on (``version``, the VW's current one)."""
    del rec
    return version

  def forward_params(self, stage_id: int, mb: Any) -> Any:
    """The weights stage ``stage_id``'s forward of ``mb`` uses (stage executor's thread)."""
    return mb.version.params[stage_id]

  def on_backward(self, stage_id: int, mb: Any, grads: Any) -> Any:
    """Stage ``stage_id``'s parameter gradients of ``mb`` (stage executor's thread, before its input gradient
    leaves); returns a tree whose arrays are ready when the stage's backward is done."""
    mb.grads[stage_id] = grads
    return grads

  def on_complete(self, mb: Any) -> None:
    """Minibatch ``mb``'s last task has completed (before its record is marked complete)."""
    raise NotImplementedError

  def on_wave_end(self, wave_id: int) -> bool:
    """Wave ``wave_id`` ended; returns True when an all-reduced update was applied now."""
    raise NotImplementedError

  def on_pull(self, vector_clock: Sequence[int], flat: np.ndarray,
              shard_vector_clocks: Sequence[Sequence[int]] | None) -> None:
    """Installs pulled global weights (``VirtualWorker.install_pull``'s arguments, checked)."""
    raise ValueError(f"[VW {self.vw.vw_id}] method {self.settings.method!r} pulls no global weights")

  def current_params(self) -> Sequence[Any]:
    """Per stage, the weights a new minibatch would start from (device trees)."""
    return self.vw.version.params


class WSPRule(UpdateRule):
  """The parameter-server rules' common state: the own waves pushed and not yet in pulled global weights.

  Attributes:
    own_waves: wave -> per-stage delta (device trees), own waves not yet in pulled global weights.
  """

  def reset(self) -> None:
    self.own_waves: dict[int, list] = {}

  def keep_own_waves(self, vector_clock: Sequence[int]) -> list[int]:
    """Drops the own waves the pulled weights hold (:func:`hetpipe_jax.rules.wsp.own_waves_after_pull`: those beyond
    the vector clock's own entry stay); returns the kept waves in order."""
    keep = wsp.own_waves_after_pull(self.own_waves, vector_clock[self.vw.vw_id])
    self.own_waves = {c: self.own_waves[c] for c in keep}
    return keep
