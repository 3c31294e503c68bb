"""Weight prediction at injection and PipeMare's delay-scaled steps on the stages' devices (``weight_prediction``,
``delay_scaled_lr``; the rules, formulas and their sources: :mod:`hetpipe_jax.rules.weight_prediction`).

Runtime layer. :class:`Predictor` computes a stage's predicted weights Ŵ = W − (η_c + … + η_{c+s−1}) · d with one
jitted pass on the stage's device (elementwise; for Muon's matrices plus optax's 5 Newton–Schulz steps), reading m,
v (or momentum's buffer, or Muon's momentum) and the step count c from the stage's optax state; the rates are summed
on the device for a schedule (no host read of c) and on the host for a constant rate. The update rules call it
(:mod:`hetpipe_jax.runtime.minibatch_update` at injection, every local stage with the VW's s;
:mod:`hetpipe_jax.runtime.pipedream_updates` at each stage's forward, with that stage's s).
:class:`PipeMareScale` gives the factor of a step and applies it through the stage's ``update_scaled`` (the optimizer's
update times the factor, in the same jitted step; a factor of 1 takes the plain ``update``).

Timing: prediction adds one elementwise pass over a stage's weights and optimizer state per minibatch (a few reads
and one write of its parameters, against a forward and a backward over a whole minibatch of activations); the engine
(:mod:`hetpipe_jax.sim.engine`) does not model it, nor PipeMare's multiply, which is fused into the step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers, MuonState
from optax.contrib._muon import orthogonalize_via_newton_schulz  # pylint: disable=protected-access  (pinned optax)
from optax.transforms import MaskedNode

from hetpipe_jax.rules import weight_prediction as rules_wp

WEIGHT_PREDICTION = rules_wp.WEIGHT_PREDICTION
DELAY_SCALED_LR = rules_wp.DELAY_SCALED_LR
DEFAULT_PIPEMARE_WARMUP = rules_wp.DEFAULT_PIPEMARE_WARMUP
OptimizerStep = rules_wp.OptimizerStep


def _find(state: Any, cls: type) -> Any:
  """The first ``cls`` node of an optax state, depth first (a chain's tuples, ``partition``'s and ``masked``'s states
  included), or None."""
  found = []
  jax.tree.map(lambda x: x, state, is_leaf=lambda x: isinstance(x, cls) and not found.append(x))
  return found[0] if found else None


def moments(opt: OptimizerStep, opt_state: Any) -> tuple[Any, Any, Any]:
  """``(count | None, mu, nu | None)`` of a stage's optax state: Adam's ``ScaleByAdamState`` (count, m, v), or
  momentum's ``TraceState`` buffer with the schedule's count (None for a constant rate).

  Raises:
    ValueError: the state holds no such moments (an optimizer prediction does not support).
  """
  if opt.name == "momentum":
    trace = _find(opt_state, optax.TraceState)
    if trace is None:
      raise ValueError("weight_prediction: optimizer 'momentum' without a momentum buffer in its state")
    sched = _find(opt_state, optax.ScaleByScheduleState)
    return (None if sched is None else sched.count), trace.trace, None
  adam = _find(opt_state, optax.ScaleByAdamState)
  if adam is None:
    raise ValueError(f"weight_prediction: optimizer {opt.name!r} without Adam's moments in its state")
  return adam.count, adam.mu, adam.nu


def _is_masked(x: Any) -> bool:
  return isinstance(x, MaskedNode)


def _muon_states(opt_state: Any) -> tuple[Any, Any]:
  """``(MuonState, ScaleByAdamState)`` of ``optax.contrib.muon``'s state.

  Raises:
    ValueError: either is missing.
  """
  muon, adam = _find(opt_state, MuonState), _find(opt_state, optax.ScaleByAdamState)
  if muon is None or adam is None:
    raise ValueError("weight_prediction: optimizer 'muon' without Muon's and Adam's moments in its state")
  return muon, adam


def _predict_muon(opt: OptimizerStep, params: Any, opt_state: Any, rate: jax.Array) -> Any:
  """Ŵ = W − rate · d for ``optax.contrib.muon``'s state: Muon's direction on the leaves its ``MuonState`` holds
  (the others are ``MaskedNode`` there), the Adam part's on the rest (both counts are the step count c)."""
  muon, adam = _muon_states(opt_state)

  def orthogonalize(x):  # optax's Newton-Schulz steps as ``contrib.muon`` runs them (its defaults, its coefficients)
    return orthogonalize_via_newton_schulz(x, muon.ns_coeffs, 5, "frobenius", 1e-8, MuonDimensionNumbers(0, 1))

  def leaf(w, m_muon, m_adam, v_adam):
    if _is_masked(m_muon):
      d = rules_wp.direction(opt, adam.count.astype(jnp.float32), w, m_adam, v_adam, jnp.sqrt)
    else:
      d = rules_wp.muon_direction(opt, w, m_muon, orthogonalize)
    return w - (rate * d).astype(w.dtype)

  return jax.tree.map(leaf, params, muon.mu, adam.mu, adam.nu, is_leaf=_is_masked)


def predict(opt: OptimizerStep, params: Any, opt_state: Any, s: jax.Array, back: jax.Array) -> Any:
  """Ŵ = W − (η_{c0} + … + η_{c0+s−1}) · d, leaf by leaf (traced; :class:`Predictor` jits it per stage).

  Args:
    opt: the optimizer's hyperparameters (static).
    params: the stage's weights W (per-layer params trees).
    opt_state: the stage's optax state (its current one).
    s: the look-ahead, int32 scalar.
    back: c − c0 >= 0: how many of the state's steps are newer than W (PipeDream's vertical sync; else 0).

  Returns:
    Ŵ, ``params``' structure, shapes and dtypes.
  """
  if opt.name == "muon":
    count, mu, nu = _muon_states(opt_state)[0].count, None, None
  else:
    count, mu, nu = moments(opt, opt_state)
  c = jnp.zeros((), jnp.int32) if count is None else count.astype(jnp.int32)
  c0 = c - back
  if callable(opt.learning_rate):
    rate = jax.lax.fori_loop(0, s, lambda k, acc: acc + jnp.asarray(opt.learning_rate(c0 + k), jnp.float32),
                             jnp.zeros((), jnp.float32))
  else:
    rate = s.astype(jnp.float32) * jnp.float32(opt.learning_rate)
  cf = c.astype(jnp.float32)
  if opt.name == "muon":
    return _predict_muon(opt, params, opt_state, rate)
  if nu is None:
    return jax.tree.map(lambda w, m: w - (rate * rules_wp.direction(opt, cf, w, m, None, jnp.sqrt)).astype(w.dtype),
                        params, mu)
  return jax.tree.map(lambda w, m, v: w - (rate * rules_wp.direction(opt, cf, w, m, v, jnp.sqrt)).astype(w.dtype),
                      params, mu, nu)


class Predictor:
  """A VW's weight prediction: :func:`predict` jitted once, called per stage on its device.

  Args:
    opt: the optimizer's hyperparameters (:class:`~hetpipe_jax.rules.weight_prediction.OptimizerStep`).

  Raises:
    ValueError: an optimizer without a direction (names ``weight_prediction`` and the optimizer).
  """

  def __init__(self, opt: OptimizerStep):
    rules_wp.check("optimizer", opt.name)
    self.opt = opt
    self._predict = jax.jit(lambda p, o, s, b: predict(opt, p, o, s, b))

  def __call__(self, params: Any, opt_state: Any, s: int, back: int = 0) -> Any:
    """A stage's Ŵ for look-ahead ``s`` (``params`` itself for s = 0; asynchronous, on the stage's device)."""
    leaves = jax.tree.leaves(params)
    if s == 0 or not leaves:
      return params
    placed = jax.device_put((np.int32(s), np.int32(back)), next(iter(leaves[0].devices())))
    return self._predict(params, opt_state, *placed)

  def compile(self, params: Any, opt_state: Any) -> None:
    """Compiles the pass for one stage now (not at the first prediction)."""
    jax.block_until_ready(self(params, opt_state, 1))


def make_predictor(settings: Any) -> Predictor | None:
  """The VW's :class:`Predictor` for ``settings.weight_prediction == "optimizer"``, None for ``"none"``.

  Raises:
    ValueError: an unknown mode, no ``optimizer_step`` given, or an optimizer without a direction.
  """
  mode = settings.weight_prediction
  opt = settings.optimizer_step
  if mode != "none" and opt is None:
    raise ValueError(f"weight_prediction={mode!r} needs the optimizer's hyperparameters (UpdateSettings."
                     "optimizer_step)")
  rules_wp.check(mode, opt.name if opt is not None else "")
  if mode == "none":
    return None
  return Predictor(opt)


class PipeMareScale:
  """A VW's PipeMare steps: the factor τ^−(1 − min(t/T, 1)) of a step and the scaled update on its stage.

  Args:
    warmup: T >= 1 (minibatches).

  Raises:
    ValueError: T < 1.
  """

  def __init__(self, warmup: int):
    rules_wp.check_delay_scaled_lr("pipemare", warmup)
    self.warmup = warmup

  def factor(self, tau: int, t: int) -> float:
    """The step's factor (:func:`hetpipe_jax.rules.weight_prediction.pipemare_scale`)."""
    return rules_wp.pipemare_scale(tau, t, self.warmup)

  @staticmethod
  def update(st: Any, params: Any, opt_state: Any, grads: Any, wave_delta: Any, norm: Any, factor: float):
    """Stage ``st``'s optimizer step scaled by ``factor`` (its ``update`` for a factor of 1); ``Stage.update``'s
    arguments and result."""
    if factor == 1.0:
      return st.update(params, opt_state, grads, wave_delta, norm)
    return st.update_scaled(params, opt_state, grads, wave_delta, norm,
                            jax.device_put(np.float32(factor), st.device))


def make_pipemare(settings: Any) -> PipeMareScale | None:
  """The VW's :class:`PipeMareScale` for ``settings.delay_scaled_lr == "pipemare"``, None for ``"none"``.

  Raises:
    ValueError: an unknown mode or T < 1.
  """
  rules_wp.check_delay_scaled_lr(settings.delay_scaled_lr, settings.pipemare_warmup_minibatches)
  if settings.delay_scaled_lr == "none":
    return None
  return PipeMareScale(settings.pipemare_warmup_minibatches)
