"""A VW's optimizer and stages from the job's optimizer section (every method and mode builds them here).

Runtime layer (jax, optax).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from hetpipe_jax import models
from hetpipe_jax.jobs.job import OptimSettings
from hetpipe_jax.jobs.job_config import ConfigError
from hetpipe_jax.rules import weight_prediction
from hetpipe_jax.runtime import optimizers
from hetpipe_jax.runtime import stages as stages_lib


def make_optimizer(optim: OptimSettings, num_minibatches: int, spec: models.ModelSpec | None = None) -> Any:
  """The optax optimizer each VW applies to its own minibatches, one state per stage (``optim.optimizer``).

  ``optim.lr_schedule``: constant, cosine, or warmup_cosine (linear from 0 over ``optim.warmup_minibatches``, then
  cosine to 0 at ``num_minibatches``). ``sgd``; ``momentum`` (``momentum``); ``adam``, ``nadam`` (Dozat 2016,
  Nesterov momentum) and ``nadamw`` (NAdam with decoupled weight decay ``weight_decay``, multiplied by the
  learning rate as optax does) with ``adam_b1`` / ``adam_b2``; ``muon`` (``optax.contrib.muon``: Nesterov
  momentum ``muon_beta`` orthogonalized by 5 Newton–Schulz steps on the 2-D hidden weights that
  :func:`hetpipe_jax.runtime.optimizers.muon_dimension_numbers` picks, optax's adamw with Nesterov momentum, i.e.
  NAdamW, with ``adam_b1`` / ``adam_b2`` on every other parameter, ``weight_decay`` on both; ``muon_consistent_rms``
  > 0: optax's ``consistent_rms``, each orthogonalized update scaled to that RMS, else optax's width scaling).
  ``grad_clip_norm`` is not part of it: the stages clip each minibatch's gradient by its global norm over
  every stage before this optimizer (:func:`build_stages`, :mod:`hetpipe_jax.runtime.grad_clip`), which a per-stage
  optax chain could not.

  Args:
    optim: the job's optimizer section.
    num_minibatches: the schedule's length (minibatches per VW, or steps).
    spec: the model (``muon`` needs it: its rule is per layer of the whole model).

  Returns:
    An ``optax.GradientTransformation`` every stage applies, or (``muon``) an
    :class:`hetpipe_jax.runtime.optimizers.PerStage` (:func:`hetpipe_jax.runtime.optimizers.for_layers` gives a
    stage's).

  Raises:
    ConfigError: ``muon`` without a model, or for a model with no 2-D hidden weights.
  """
  lr = learning_rate(optim, num_minibatches)
  b1, b2 = optim.adam_b1, optim.adam_b2
  decay = optim.weight_decay
  if optim.optimizer == "muon":
    dims = optimizers.muon_dimension_numbers(_muon_layer_shapes(spec))
    return optimizers.PerStage(lambda start, end: optax.contrib.muon(
        lr, beta=optim.muon_beta, weight_decay=decay, adam_b1=b1, adam_b2=b2,
        adam_weight_decay=decay, muon_weight_dimension_numbers=dims[start:end],
        consistent_rms=optim.muon_consistent_rms or None))
  if optim.optimizer == "adam":
    tx = optax.adam(lr, b1=b1, b2=b2)
  elif optim.optimizer == "nadam":
    tx = optax.nadam(lr, b1=b1, b2=b2)
  elif optim.optimizer == "nadamw":
    tx = optax.nadamw(lr, b1=b1, b2=b2, weight_decay=decay)
  elif optim.optimizer == "momentum":
    tx = optax.sgd(lr, momentum=optim.momentum)
  else:
    tx = optax.sgd(lr)
  return tx


def learning_rate(optim: OptimSettings, num_minibatches: int) -> Any:
  """``optim.learning_rate`` under ``optim.lr_schedule`` (:func:`make_optimizer`'s): a float, or an optax schedule
  ``step count -> rate`` over ``num_minibatches`` steps."""
  lr = optim.learning_rate
  if optim.lr_schedule == "cosine":
    lr = optax.cosine_decay_schedule(optim.learning_rate, num_minibatches)
  if optim.lr_schedule == "warmup_cosine":
    lr = optax.warmup_cosine_decay_schedule(0.0, optim.learning_rate, optim.warmup_minibatches, num_minibatches)
  return lr


def optimizer_step(optim: OptimSettings, num_minibatches: int) -> Any:
  """What weight prediction reads of :func:`make_optimizer`'s optimizer (its rate or schedule and the settings it
  uses; :class:`hetpipe_jax.rules.weight_prediction.OptimizerStep`), for ``optim.weight_prediction`` other than
  ``"none"``; None otherwise."""
  if optim.weight_prediction == "none":
    return None
  return weight_prediction.OptimizerStep(
      optim.optimizer, learning_rate(optim, num_minibatches), b1=optim.adam_b1, b2=optim.adam_b2,
      weight_decay=optim.weight_decay if optim.optimizer in ("nadamw", "muon") else 0.0,
      momentum=optim.momentum if optim.optimizer == "momentum" else 0.0,
      muon_consistent_rms=optim.muon_consistent_rms)


def build_stages(optim: OptimSettings, spec: models.ModelSpec, partition, devices, optimizer: optax.GradientTransformation,
                 remat: bool = False) -> list:
  """A VW's stages (:func:`hetpipe_jax.runtime.stages.build_stages`) with the job's ``optim.grad_clip_norm`` (> 0:
  every update clips by the minibatch's global norm over all stages; 0: off), for every method and mode."""
  return stages_lib.build_stages(spec, partition, devices, optimizer, remat=remat,
                                 grad_clip_norm=float(optim.grad_clip_norm))


def _muon_layer_shapes(spec: models.ModelSpec | None) -> list:
  """The model's per-layer param shapes for Muon's rule (abstract evaluation, nothing runs).

  Raises:
    ConfigError: no model, or a model where the rule gives Muon no parameter.
  """
  if spec is None:
    raise ConfigError("config.optimizer='muon' decides its parameters per layer of the model: pass the model")
  shapes = jax.eval_shape(lambda: models.init_layer_params(spec, jax.random.key(0)))  # shapes only: any key
  if not optimizers.muon_leaf_names(shapes):
    raise ConfigError(f"config.optimizer='muon': model {spec.name!r} has no 2-D hidden weights (a Dense 'kernel' "
                      "outside its output layer) for Muon to orthogonalize; use 'nadamw' or 'adam'")
  return shapes
