"""Delay-compensated gradients' settings (DC-ASGD, Zheng et al., ICML'17, arXiv 1609.08326): the modes and λ.

Rules layer (pure: no jax), so the job's settings check (:mod:`hetpipe_jax.jobs.job_config`) runs before any import
of jax. The correction itself is :mod:`hetpipe_jax.runtime.delay_compensation`.
"""

from __future__ import annotations

DELAY_COMPENSATION = ("none", "dc")  # "none": no correction (bit-identical to runs without the setting)
# DC-ASGD-c's constant λ₀ in the paper's CIFAR-10 experiments (arXiv 1609.08326, §6: λ₀ = 0.04).
DEFAULT_DC_LAMBDA = 0.04


def check(mode: str, lam: float) -> None:
  """Checks a delay-compensation mode and its λ.

  Raises:
    ValueError: ``mode`` not in :data:`DELAY_COMPENSATION`, or ``lam`` < 0 (or NaN).
  """
  if mode not in DELAY_COMPENSATION:
    raise ValueError(f"delay_compensation={mode!r} must be one of {', '.join(map(repr, DELAY_COMPENSATION))}")
  if not lam >= 0:
    raise ValueError(f"dc_lambda={lam} must be >= 0 (DC-ASGD's λ; the paper's DC-ASGD-c uses 0.04)")
