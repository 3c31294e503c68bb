"""Delay-compensated gradients (DC-ASGD, Zheng et al., ICML'17, arXiv 1609.08326): a stale gradient corrected by a
diagonal first-order Taylor term before the optimizer step (``delay_compensation = "dc"``, ``dc_lambda``).

Runtime layer. Minibatch p's gradient g was taken at the weights W_p it ran on, but the step lands on the current
weights W_now (up to Nm − 1 local updates later inside a VW, plus pulled global weights). DC-ASGD approximates the
gradient at W_now by g̃ = g + λ · g ⊙ g ⊙ (W_now − W_p) (the outer product g gᵀ as a cheap approximation of the
Hessian, kept to its diagonal; the paper's Eq. 5 with λ₀ constant, "DC-ASGD-c", λ = 0.04 in its CIFAR-10 runs).
Each stage corrects its own part of the gradient with one jitted elementwise pass on the stage's device
(:func:`compensate`, applied by the update rules: :mod:`hetpipe_jax.runtime.minibatch_update` with W_p = the
version p was injected with, :mod:`hetpipe_jax.runtime.pipedream_updates` with W_p = the weights that stage's forward
of p stashed). With clipping by the global norm (``grad_clip_norm`` > 0) the correction comes first: the clip sees
(and its norm is taken over) the corrected gradient. ``"none"`` computes nothing: the runs are bit-identical to
runs without the setting.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hetpipe_jax.rules import delay_compensation as rules_dc

DELAY_COMPENSATION = rules_dc.DELAY_COMPENSATION
DEFAULT_DC_LAMBDA = rules_dc.DEFAULT_DC_LAMBDA
check = rules_dc.check


@jax.jit
def compensate(grads: Any, w_now: Any, w_used: Any, lam: jax.Array) -> Any:
  """g + λ · g ⊙ g ⊙ (W_now − W_p), leaf by leaf (one stage's part; runs where its arguments live).

  Args:
    grads: the stage's parameter gradients g (a params-shaped tree, taken at ``w_used``).
    w_now: the stage's weights the step is applied to (same tree structure and shapes).
    w_used: the weights W_p the gradient was taken at.
    lam: λ ≥ 0, float32 scalar (on the stage's device).

  Returns:
    The corrected gradient, ``grads``' structure, shapes and dtypes.
  """
  return jax.tree.map(lambda g, w, wp: g + (lam * g * g * (w - wp)).astype(g.dtype), grads, w_now, w_used)



class Compensator:
  """A VW's correction: λ placed on every local stage's device, :func:`compensate` called per stage.

  Args:
    stages: the VW's stages (``Stage.device``).
    local_stages: the stages in this process.
    lam: λ ≥ 0.

  Raises:
    ValueError: ``lam`` < 0.
  """

  def __init__(self, stages: Any, local_stages: Any, lam: float):
    check("dc", lam)
    self.lam = float(lam)
    self._lams = {s: jax.device_put(np.float32(lam), stages[s].device) for s in local_stages}

  def __call__(self, s: int, grads: Any, w_now: Any, w_used: Any) -> Any:
    """Stage ``s``'s corrected gradient (device tree on its device; asynchronous)."""
    return compensate(grads, w_now, w_used, self._lams[s])


def make(settings: Any, vw: Any) -> Compensator | None:
  """The VW's :class:`Compensator` for ``settings.delay_compensation == "dc"``, None for ``"none"``.

  Raises:
    ValueError: an unknown mode or ``dc_lambda`` < 0.
  """
  check(settings.delay_compensation, settings.dc_lambda)
  if settings.delay_compensation == "none":
    return None
  return Compensator(vw.stages, vw.local_stages, settings.dc_lambda)
