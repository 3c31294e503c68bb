"""Staleness remedies inside a virtual worker: weight prediction at injection (SpecTrain arXiv 1809.02839, PipeOptim
arXiv 2312.00839) and PipeMare's delay-scaled learning rate (arXiv 1910.05124, §3.1): the settings, the look-ahead
count s, the predicted step's direction d and PipeMare's scale.

Rules layer (pure: no jax), so the job's settings check (:mod:`hetpipe_jax.jobs.job_config`) runs before jax starts.
:func:`direction` and :func:`lookahead_rate` are written over plain arithmetic (and a ``sqrt`` passed in), so the
runtime jits the same formulas on each stage's device (:mod:`hetpipe_jax.runtime.weight_prediction`) and the tests
evaluate them in numpy.

**Weight prediction** (``weight_prediction = "optimizer"``). Minibatch p runs forward and backward, on every stage, on

  Ŵ = W − (η_c + η_{c+1} + … + η_{c+s−1}) · d      (= W − s·η·d for a constant rate η)

where W is the weights p would run on (HetPipe: the VW's current version at p's injection; PipeDream: the stage's
weights its forward of p uses), c the optimizer's step count in the state that W goes with (optax's ``count``: the
updates applied so far), s the updates that land on those weights before p's own (:func:`hetpipe_lookahead`,
:func:`pipedream_lookahead`), η_k the learning rate (the schedule's value) of step k, and d the direction of the
optimizer's next step from its current state, *with its moments held where they are* (the gradient that leaves
them unchanged: g = m, g² = v for Adam; g = (1 − μ)·buf for momentum): exactly the update optax would apply at step
c + 1 with that gradient, divided by −η:

* ``adam``: d = m̂ / (√v̂ + ε), m̂ = m / (1 − β1^(c+1)), v̂ = v / (1 − β2^(c+1)) (bias correction at the next
  step's count c + 1; optax's ``scale_by_adam``, ``eps_root`` = 0).
* ``nadam``: d = (β1 · m / (1 − β1^(c+2)) + (1 − β1) · m / (1 − β1^(c+1))) / (√v̂ + ε): optax's Nesterov form
  (``scale_by_adam(nesterov=True)``) with the next gradient estimated by m.
* ``nadamw``: NAdam's d + λ_wd · W (optax's ``add_decayed_weights`` after the Adam scaling, on every leaf, both
  times η).
* ``momentum``: d = buf (optax's ``trace``, ``buf ← g + μ·buf``, no dampening, not Nesterov: with g = (1 − μ)·buf
  the buffer, and so the step, stays buf).
* ``muon`` (optax's ``contrib.muon`` as :mod:`hetpipe_jax.jobs.training_setup` builds it), on its matrices
  (:func:`muon_direction`): d = σ · NS(μ) + λ_wd · W, with μ its momentum, NS optax's Newton–Schulz
  orthogonalisation (passed in: not elementwise) and σ its shape scale (:func:`muon_shape_scale`). Muon orthogonalises
  its bias-corrected Nesterov momentum μ̂ = β · μ' / (1 − β^(c+2)) + (1 − β) · g / (1 − β^(c+1)); with the gradient
  that leaves μ in place (g = μ, μ' = β·μ + (1 − β)·μ = μ) μ̂ is a positive multiple of μ, and NS starts by dividing
  by the Frobenius norm, so NS(μ̂) = NS(μ). On every other leaf: the ``nadamw`` direction above (Muon's Adam part is
  optax's adamw with Nesterov momentum, ``adam_b1``/``adam_b2``, the same ``weight_decay``).
* ``sgd`` has no direction of its own (its next step is the next gradient): :func:`check` refuses it.

With s = 0 (nothing lands before p's update) Ŵ = W and nothing is computed. p's gradient, taken at Ŵ, updates the
current weights when p completes (HetPipe) or after its backward (PipeDream), as without prediction. Ŵ is the version
p holds (and PipeDream's stage stashes for the backward) in place of W, so no memory is added.

**PipeMare's rate** (``delay_scaled_lr = "pipemare"``). Each minibatch's step (the optimizer's update, weight decay
included) is scaled by τ^−(1 − min(t/T, 1)) (:func:`pipemare_scale`): τ the step's real delay (the updates applied, on
that stage (PipeDream) or the VW (HetPipe), since the weights the minibatch used; τ = 0: scale 1), t the step's index
(the updates before it), T = ``pipemare_warmup_minibatches``. Early steps of a stale minibatch are shrunk by 1/τ, and
the shrinking fades out linearly in the exponent over T steps (PipeMare's learning-rate rescheduling, p_k = 1 −
min(k/K, 1), with τ the measured delay instead of the pipeline's nominal one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

WEIGHT_PREDICTION = ("none", "optimizer")  # "none": off (bit-identical to runs without the setting)
# The optimizers weight prediction has a direction for (``config.optimizer`` names).
PREDICTABLE_OPTIMIZERS = ("adam", "nadam", "nadamw", "momentum", "muon")
DELAY_SCALED_LR = ("none", "pipemare")  # "none": off (bit-identical to runs without the setting)
DEFAULT_PIPEMARE_WARMUP = 500  # T, minibatches (steps) until PipeMare's scale reaches 1


@dataclasses.dataclass(frozen=True)
class OptimizerStep:
  """The hyperparameters of the optimizer a stage applies that prediction needs and its optax state does not hold.

  Attributes:
    name: ``config.optimizer`` (one of :data:`PREDICTABLE_OPTIMIZERS` to predict).
    learning_rate: η, a float, or a schedule ``step count -> rate`` (optax's, traceable: the runtime evaluates it on
      the device).
    b1, b2, eps: Adam's (``adam``, ``nadam``, ``nadamw``; optax's ``eps`` default 1e-8).
    weight_decay: ``nadamw``'s and ``muon``'s decoupled weight decay (times η, as optax applies it).
    momentum: ``momentum``'s μ (its buffer is the direction; μ itself is not read).
    muon_consistent_rms: ``muon``'s consistent RMS (> 0), or 0 for optax's width scaling (:func:`muon_shape_scale`).
  """

  name: str
  learning_rate: float | Callable[[Any], Any]
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  momentum: float = 0.0
  muon_consistent_rms: float = 0.0


def check(mode: str, optimizer: str) -> None:
  """Checks a weight-prediction mode against the optimizer.

  Raises:
    ValueError: ``mode`` not in :data:`WEIGHT_PREDICTION`, or ``"optimizer"`` with an optimizer that has no
      direction (``sgd``); the message names ``weight_prediction`` and the optimizer.
  """
  if mode not in WEIGHT_PREDICTION:
    raise ValueError(f"weight_prediction={mode!r} must be one of {', '.join(map(repr, WEIGHT_PREDICTION))}")
  if mode != "none" and optimizer not in PREDICTABLE_OPTIMIZERS:
    raise ValueError(f"weight_prediction={mode!r} predicts from the optimizer's own next step, which optimizer="
                     f"{optimizer!r} does not have (no momentum to extrapolate): use one of "
                     f"{', '.join(map(repr, PREDICTABLE_OPTIMIZERS))}, or weight_prediction='none'")


def check_delay_scaled_lr(mode: str, warmup: int) -> None:
  """Checks PipeMare's setting and its warm-up length T.

  Raises:
    ValueError: ``mode`` not in :data:`DELAY_SCALED_LR`, or T not an integer >= 1.
  """
  if mode not in DELAY_SCALED_LR:
    raise ValueError(f"delay_scaled_lr={mode!r} must be one of {', '.join(map(repr, DELAY_SCALED_LR))}")
  if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
    raise ValueError(f"pipemare_warmup_minibatches={warmup!r} must be an integer >= 1 (T: the steps over which "
                     "PipeMare's scale tau^-(1 - t/T) rises to 1)")


def hetpipe_lookahead(injected_before: int, completed: int) -> int:
  """HetPipe's s for minibatch p at its injection: the VW's minibatches injected before p and not complete.

  HetPipe's minibatches complete in order (forwards and backwards in order on every stage, the update at the last
  one), so exactly these land their updates on the VW's weights before p's: Nm − 1 in steady state, fewer at the
  start and after a wave the staleness bound held back. Pulls do not add to s: the other VWs' waves a pull may bring
  are not this optimizer's steps, and whether one lands before p completes depends on timing.

  Args:
    injected_before: the VW's minibatches injected before p (in this segment: its id p).
    completed: the VW's minibatches completed (their updates applied) when p is injected.

  Raises:
    ValueError: more completed than injected.
  """
  if completed > injected_before:
    raise ValueError(f"{completed} minibatches completed of {injected_before} injected")
  return injected_before - completed


def pipedream_lookahead(forwarded_before: int, used_updates: int) -> int:
  """PipeDream's s for stage k's forward of minibatch p: stage k's own updates between the weights that forward uses
  and p's update on stage k.

  A stage's forwards and its updates (after its backwards, or at completion with clipping) are both in minibatch
  order, so p's update is the stage's update number ``forwarded_before`` (0-based) and the weights hold
  ``used_updates`` of them (its latest count; with vertical sync, stage 0's count for p). 0 on the last stage, whose
  forward and backward are one task; up to the stage's in-flight minibatches on the others.

  Args:
    forwarded_before: stage k's forwards before p's (its minibatches in minibatch order).
    used_updates: the stage's own updates in the weights its forward of p uses (``stage_versions[k]``).

  Raises:
    ValueError: the weights hold more updates than the forwards before p.
  """
  if used_updates > forwarded_before:
    raise ValueError(f"weights after {used_updates} updates for the forward of the stage's minibatch "
                     f"{forwarded_before}")
  return forwarded_before - used_updates


def direction(opt: OptimizerStep, count: Any, w: Any, mu: Any, nu: Any, sqrt: Callable[[Any], Any]) -> Any:
  """d of one leaf (module docstring), elementwise in any array module; for ``muon`` the leaves its Adam part takes
  (its matrices: :func:`muon_direction`).

  Args:
    opt: the optimizer (its ``name`` picks the formula).
    count: c, the optimizer's step count (scalar; float or integer array).
    w: the leaf's weights W (read by ``nadamw``'s weight decay).
    mu: Adam's first moment m, or momentum's buffer.
    nu: Adam's second moment v (None for momentum).
    sqrt: the array module's square root.

  Returns:
    d, ``w``'s shape.

  Raises:
    ValueError: an optimizer without a direction.
  """
  if opt.name == "momentum":
    return mu
  if opt.name not in ("adam", "nadam", "nadamw", "muon"):
    raise ValueError(f"weight_prediction has no direction for optimizer={opt.name!r}")
  b1, b2 = opt.b1, opt.b2
  c1 = count + 1.0
  v_hat = nu / (1.0 - b2 ** c1)
  m_hat = mu / (1.0 - b1 ** c1) if opt.name == "adam" else _nesterov_hat(mu, count, b1)
  d = m_hat / (sqrt(v_hat) + opt.eps)
  if opt.name in ("nadamw", "muon"):
    d = d + opt.weight_decay * w
  return d


def _nesterov_hat(mu: Any, count: Any, beta: float) -> Any:
  """β · μ / (1 − β^(c+2)) + (1 − β) · μ / (1 − β^(c+1)): optax's bias-corrected Nesterov momentum at step c + 1
  when the next gradient is μ itself."""
  c1 = count + 1.0
  return beta * mu / (1.0 - beta ** (c1 + 1.0)) + (1.0 - beta) * mu / (1.0 - beta ** c1)


def muon_shape_scale(fan_in: int, fan_out: int, consistent_rms: float) -> float:
  """σ, Muon's scale of an orthogonalised ``[fan_in, fan_out]`` update (optax's ``scale_by_shape``):
  √max(fan_in, fan_out) · rms for a consistent RMS > 0 (Liu et al. 2025, arXiv 2502.16982), else
  √max(1, fan_out / fan_in) (Jordan's width scaling)."""
  if consistent_rms:
    return math.sqrt(max(fan_in, fan_out)) * consistent_rms
  return math.sqrt(max(1.0, fan_out / fan_in))


def muon_direction(opt: OptimizerStep, w: Any, mu: Any, orthogonalize: Callable[[Any], Any]) -> Any:
  """d of one of Muon's matrices (module docstring): σ · NS(μ) + λ_wd · W.

  Args:
    opt: the optimizer (``muon``: its ``muon_consistent_rms`` and ``weight_decay``).
    w: the matrix W, ``[fan_in, fan_out]``.
    mu: Muon's momentum μ, ``w``'s shape.
    orthogonalize: NS, a matrix -> the orthogonalised matrix of its shape (the runtime passes optax's Newton–Schulz
      iteration with Muon's coefficients).

  Raises:
    ValueError: ``w`` not 2-D, or ``opt`` not ``muon``.
  """
  if opt.name != "muon" or len(w.shape) != 2:
    raise ValueError(f"muon_direction: a 2-D matrix of optimizer 'muon', got {opt.name!r} and shape {w.shape}")
  sigma = muon_shape_scale(w.shape[0], w.shape[1], opt.muon_consistent_rms)
  return sigma * orthogonalize(mu) + opt.weight_decay * w


def lookahead_rate(learning_rate: float | Callable[[Any], Any], count: int, s: int) -> float:
  """η_c + … + η_{c+s−1}: the rates of the s steps that land before p's (s·η for a constant rate; 0 for s = 0).

  Args:
    learning_rate: η, or a schedule ``count -> rate``.
    count: c, the optimizer's step count.
    s: the look-ahead (>= 0).
  """
  if not callable(learning_rate):
    return s * float(learning_rate)
  return sum(float(learning_rate(count + k)) for k in range(s))


def pipemare_scale(tau: int, t: int, warmup: int) -> float:
  """PipeMare's step scale τ^−(1 − min(t/T, 1)) (module docstring); 1 for τ = 0.

  Args:
    tau: the step's delay (>= 0 updates).
    t: the step's index (updates before it, >= 0).
    warmup: T >= 1.

  Raises:
    ValueError: ``tau`` < 0.
  """
  if tau < 0:
    raise ValueError(f"a delay of {tau} updates")
  if tau == 0:
    return 1.0
  return float(tau) ** -(1.0 - min(t / warmup, 1.0))
