"""The flat config's settings checks: every setting valid, and used by the method that runs or refused.

Planning layer (no jax, no mpi4py): a bad config fails in milliseconds with one clear message naming the setting and
the fix. Called by :func:`hetpipe_jax.jobs.job_config.resolve_job` (the one reader of the ConfigDict) only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hetpipe_jax.data.dataset import DatasetConfigError, check_dataset_name
from hetpipe_jax.rules import delay_compensation
from hetpipe_jax.rules import methods
from hetpipe_jax.rules import weight_prediction
from hetpipe_jax.rules import wsp


class ConfigError(ValueError):
  """A setting is invalid; the message names it and says how to fix it."""



def parse_debug_nan_update(text: str) -> tuple[int, int] | None:
  """``config.debug_nan_update`` (``"vw:wave"``, a fault drill) as ``(vw, wave)``; None when empty.

  Raises:
    ConfigError: malformed.
  """
  if not text.strip():
    return None
  try:
    vw, wave = (int(x) for x in text.split(":"))
  except ValueError:
    raise ConfigError(f"config.debug_nan_update={text!r} is malformed: use 'vw:wave' (e.g. '1:3'), or '' for "
                      "none") from None
  if vw < 0 or wave < 0:
    raise ConfigError(f"config.debug_nan_update={text!r}: the VW and the wave must be >= 0")
  return vw, wave


# config.optimizer's values (hetpipe_jax.jobs.mpi_job.make_optimizer builds them), and the settings only some of them
# use: name -> (default, the optimizers that use it). A setting off its default for another optimizer is an error,
# so the value recorded (config.json, summary.json's "optimizer") is the value that runs.
OPTIMIZERS = ("sgd", "momentum", "adam", "nadam", "nadamw", "muon")
OPTIMIZER_SETTINGS = {
    "momentum": (0.9, ("momentum",)),
    "adam_b1": (0.9, ("adam", "nadam", "nadamw", "muon")),
    "adam_b2": (0.999, ("adam", "nadam", "nadamw", "muon")),
    "muon_beta": (0.95, ("muon",)),
    "muon_consistent_rms": (0.0, ("muon",)),
    "weight_decay": (0.0, ("nadamw", "muon")),
}
_DECAY_RATES = {"adam_b1": "an Adam setting (Adam's decay rate of the gradient's mean)",
                "adam_b2": "an Adam setting (Adam's decay rate of the gradient's second moment)",
                "muon_beta": "a Muon setting (Muon's momentum decay rate)"}


def _check_optimizer_settings(config: Any) -> None:
  for name, what in _DECAY_RATES.items():
    value = config.get(name, OPTIMIZER_SETTINGS[name][0])
    if not 0 <= value < 1:
      raise ConfigError(f"config.{name}={value} must be in [0, 1) ({what.split(' (')[1]}")
  decay = config.get("weight_decay", 0.0)
  if not decay >= 0:
    raise ConfigError(f"config.weight_decay={decay} must be >= 0 (decoupled weight decay, times the learning rate)")
  rms = config.get("muon_consistent_rms", 0.0)
  if not rms >= 0:
    raise ConfigError(f"config.muon_consistent_rms={rms} must be >= 0 (the RMS of Muon's scaled update, e.g. 0.2; "
                      "0 = optax's width scaling)")
  for name, (default, users) in OPTIMIZER_SETTINGS.items():
    value = config.get(name, default)
    if value != default and config.optimizer not in users:
      kind = _DECAY_RATES.get(name, f"a {name.replace('_', '-')} setting").split(" (")[0]
      raise ConfigError(f"config.{name}={value} is {kind}; config.optimizer={config.optimizer!r} (it is used by "
                        f"{', '.join(map(repr, users))})")


def optimizer_summary(optim: Any) -> dict[str, Any]:
  """``summary.json``'s ``"optimizer"``: its name, learning rate and schedule, and the settings it uses (the values
  config.json holds).

  Args:
    optim: the job's :class:`hetpipe_jax.jobs.job.OptimSettings`.
  """
  used = {name: getattr(optim, name) for name, (default, users) in OPTIMIZER_SETTINGS.items()
          if optim.optimizer in users}
  return {"name": optim.optimizer, "learning_rate": optim.learning_rate, "lr_schedule": optim.lr_schedule,
          "warmup_minibatches": optim.warmup_minibatches, **used}


def _check_scalars(config: Any) -> None:
  for name in ("num_inflight", "num_virtual_workers", "num_stages"):
    value = config.get(name)
    if value is not None and value < 1:
      extra = " (1 = no pipelining)" if name == "num_inflight" else ""
      raise ConfigError(f"config.{name}={value}: must be >= 1{extra}, or leave it unset to take the plan's value")
  if config.staleness_bound < 0:
    raise ConfigError(f"config.staleness_bound={config.staleness_bound}: D must be >= 0 (0 = BSP with pipelining)")
  if config.ps_apply not in wsp.PS_APPLY_MODES:
    raise ConfigError(f"config.ps_apply={config.ps_apply!r} must be 'on_receipt' (HetPipe §5: the PS adds each wave "
                      "update when it arrives) or 'clock_aligned' (a wave is added once every VW pushed it)")
  try:
    wsp.check_ps_staleness_scaling(config.get("ps_staleness_scaling", "none"), config.get("ps_staleness_alpha", 1.0))
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  if config.batch_size < 1:
    raise ConfigError(f"config.batch_size={config.batch_size} must be >= 1")
  if config.platform not in ("cpu", "gpu"):
    raise ConfigError(f"config.platform={config.platform!r} must be 'cpu' or 'gpu'")
  if config.optimizer not in OPTIMIZERS:
    raise ConfigError(f"config.optimizer={config.optimizer!r} must be one of {', '.join(map(repr, OPTIMIZERS))}")
  if config.lr_schedule not in ("constant", "cosine", "warmup_cosine"):
    raise ConfigError(f"config.lr_schedule={config.lr_schedule!r} must be 'constant', 'cosine' or 'warmup_cosine'")
  warmup = config.get("warmup_minibatches", 0)
  if warmup < 0 or (warmup > 0) != (config.lr_schedule == "warmup_cosine"):
    raise ConfigError(f"config.warmup_minibatches={warmup} is used only by config.lr_schedule='warmup_cosine', "
                      "which needs it > 0: set both, or warmup_minibatches=0")
  _check_optimizer_settings(config)
  if not config.get("grad_clip_norm", 0.0) >= 0:
    raise ConfigError(f"config.grad_clip_norm={config.get('grad_clip_norm')} must be >= 0 (0: no clipping)")
  _check_delay_compensation(config)
  _check_weight_prediction_and_pipemare(config)
  if not config.get("ps_watchdog_s", 0.0) >= 0:
    raise ConfigError(f"config.ps_watchdog_s={config.get('ps_watchdog_s')} must be >= 0 (seconds a VW may stay "
                      "silent; 0: off)")
  if not config.learning_rate > 0:
    raise ConfigError(f"config.learning_rate={config.learning_rate} must be > 0")
  if config.get("checkpoint_every_waves") is not None and config.checkpoint_every_waves < 0:
    raise ConfigError(f"config.checkpoint_every_waves={config.checkpoint_every_waves} must be >= 0 (0: only the "
                      "final weights; unset: the method's default)")
  if config.checkpoint_max_to_keep < 1:
    raise ConfigError(f"config.checkpoint_max_to_keep={config.checkpoint_max_to_keep} must be >= 1")
  parse_debug_nan_update(config.debug_nan_update)
  try:
    check_dataset_name(config.get("dataset", "fashion_mnist"))
  except DatasetConfigError as e:
    raise ConfigError(str(e)) from None
  method = config.get("method", "hetpipe")
  if method not in methods.METHODS:
    raise ConfigError(f"config.method={method!r} is not a method: use one of {list(methods.METHODS)}")
  if method not in methods.HARNESS_METHODS:
    raise ConfigError(f"config.method={method!r} is planned and simulated (hetpipe_jax.compare, the engine) and run on "
                      "one host by experiments/fsdp_validate.py, not by hetpipe_jax.train: use one of "
                      f"{list(methods.HARNESS_METHODS)}")
  m = config.get("num_inflight")
  if m is not None and config.batch_size % methods.micro_batches_per_minibatch(methods.get_method(method), m):
    raise ConfigError(f"config.method={method!r} splits each minibatch into num_inflight={m} micro-batches, but "
                      f"config.batch_size={config.batch_size} is not a multiple of it: pick a divisor")
  grouping = config.get("stage_rank_grouping", "gpu")
  if grouping not in ("gpu", "node"):
    raise ConfigError(f"config.stage_rank_grouping={grouping!r} must be 'gpu' (one rank per stage) or 'node' (a "
                      "VW's stages on one plan node share a rank)")
  check_method_settings(config, method)
  check_dependent_settings(config, method)


def _check_delay_compensation(config: Any) -> None:
  """``delay_compensation`` and ``dc_lambda`` (:mod:`hetpipe_jax.runtime.delay_compensation`); the methods that take
  it are checked with :data:`METHOD_SETTINGS`.

  Raises:
    ConfigError: an unknown mode, λ < 0, or ``"dc"`` with stage ranks.
  """
  mode = config.get("delay_compensation", "none")
  lam = config.get("dc_lambda", delay_compensation.DEFAULT_DC_LAMBDA)
  if mode not in delay_compensation.DELAY_COMPENSATION:
    raise ConfigError(f"config.delay_compensation={mode!r} must be one of "
                      f"{', '.join(map(repr, delay_compensation.DELAY_COMPENSATION))}")
  if not lam >= 0:
    raise ConfigError(f"config.dc_lambda={lam} must be >= 0 (DC-ASGD's λ; the paper's DC-ASGD-c uses 0.04)")
  if mode == "dc" and config.get("stage_ranks", False):
    raise ConfigError("config.delay_compensation='dc' runs with a VW's stages in its process, not with "
                      "config.stage_ranks=True: set one of them back")


def _check_weight_prediction_and_pipemare(config: Any) -> None:
  """``weight_prediction`` against ``config.optimizer``, ``delay_scaled_lr`` and ``pipemare_warmup_minibatches``
  (:mod:`hetpipe_jax.rules.weight_prediction`); the methods that take them are checked with :data:`METHOD_SETTINGS`.

  Raises:
    ConfigError: an unknown mode, prediction with an optimizer that has no direction (``sgd``), T < 1,
      or either one with stage ranks.
  """
  try:
    weight_prediction.check(config.get("weight_prediction", "none"), config.optimizer)
    weight_prediction.check_delay_scaled_lr(config.get("delay_scaled_lr", "none"),
                                            config.get("pipemare_warmup_minibatches",
                                                       weight_prediction.DEFAULT_PIPEMARE_WARMUP))
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  for name in ("weight_prediction", "delay_scaled_lr"):
    mode = config.get(name, "none")
    if mode != "none" and config.get("stage_ranks", False):
      raise ConfigError(f"config.{name}={mode!r} runs with a VW's stages in its process, not with "
                        "config.stage_ranks=True: set one of them back")


@dataclasses.dataclass(frozen=True)
class MethodSetting:
  """A setting only some methods use (:data:`METHOD_SETTINGS`).

  Attributes:
    name: the config field.
    default: its value when unused (``None``: unset).
    methods: the methods that use it.
    what: what it sets, as the error says it (``config.<name>=<value> <what>, ...``).
    off: further values that mean "not used", accepted by every method (``checkpoint_every_waves=0``).
  """

  name: str
  default: Any
  methods: tuple[str, ...]
  what: str
  off: tuple[Any, ...] = ()


_PS_METHODS = methods.PS_METHODS
_FLUSH_METHODS = methods.FLUSH_METHODS
# Every setting that belongs to some methods only: given away from its default to another method, it is refused with
# an error naming it (for every method alike, MPI and virtual time), instead of being ignored and recorded as if it
# ran. The all-reduce methods (gpipe, 1f1b_flush, horovod) have no parameter server.
METHOD_SETTINGS = (
    MethodSetting("num_ps_shards", None, _PS_METHODS, "sets the parameter-server shards"),
    MethodSetting("ps_placement", "", _PS_METHODS, "places layers on the parameter-server shards"),
    MethodSetting("ps_apply", "on_receipt", _PS_METHODS, "sets how the parameter server applies wave updates"),
    MethodSetting("pull_every_wave", True, _PS_METHODS, "sets when a VW pulls from the parameter server"),
    MethodSetting("ps_staleness_scaling", "none", _PS_METHODS,
                  "scales each wave update at the parameter server by its staleness"),
    MethodSetting("ps_staleness_alpha", 1.0, _PS_METHODS, "is the parameter server's staleness scaling rate"),
    MethodSetting("vertical_sync", False, ("pipedream",), "is PipeDream's vertical sync"),
    MethodSetting("delay_compensation", "none", ("hetpipe", "pipedream"),
                  "corrects a stale gradient at its (asynchronous) step (DC-ASGD)"),
    MethodSetting("weight_prediction", "none", ("hetpipe", "pipedream"),
                  "runs each minibatch on weights predicted from the optimizer's next step"),
    MethodSetting("delay_scaled_lr", "none", ("hetpipe", "pipedream"),
                  "scales each (asynchronous) step by its delay (PipeMare)"),
    MethodSetting("ps_watchdog_s", 0.0, _PS_METHODS, "is the parameter server's progress watchdog"),
    MethodSetting("stage_ranks", False, ("hetpipe",), "runs HetPipe's pipeline with a VW's stages on separate ranks"),
    MethodSetting("remat", False, _FLUSH_METHODS, "rematerialises the flush methods' activations"),
    MethodSetting("checkpoint_every_waves", None, _PS_METHODS,
                  "writes training checkpoints (the all-reduce methods save only the final weights)", off=(0,)),
)
# config.checkpoint_every_waves unset: the PS methods checkpoint every this many global-clock ticks, the others never.
DEFAULT_CHECKPOINT_EVERY_WAVES = 100


def checkpoint_every_waves(config: Any, method: str) -> int:
  """The global-clock ticks between training checkpoints that run (0: only the final weights): the config's, or
  unset :data:`DEFAULT_CHECKPOINT_EVERY_WAVES` for the PS methods and 0 for the others (checked first by
  :func:`check_method_settings`)."""
  every = config.get("checkpoint_every_waves")
  if every is not None:
    return int(every)
  return DEFAULT_CHECKPOINT_EVERY_WAVES if method in _PS_METHODS else 0


def check_method_settings(config: Any, method: str) -> None:
  """Refuses a setting of :data:`METHOD_SETTINGS` given to a method that does not use it.

  Raises:
    ConfigError: naming the setting, the method and the fix.
  """
  for s in METHOD_SETTINGS:
    value = config.get(s.name, s.default)
    if method in s.methods or value == s.default or value in s.off:
      continue
    fix = ("leave it unset" if s.default is None else
           f"set --config.{s.name}={s.default} (the default)")
    fix += "".join(f" or set --config.{s.name}={v}" for v in s.off)
    raise ConfigError(f"config.{s.name}={value!r} {s.what}, which config.method={method!r} does not use (used by "
                      f"{', '.join(s.methods)}): {fix}")


@dataclasses.dataclass(frozen=True)
class DependentSetting:
  """A setting used only when another one turns its feature on (:data:`DEPENDENT_SETTINGS`).

  Attributes:
    name: the config field.
    default: its value in ``experiments/configs/default.py`` (accepted always: the user did not give it).
    used_by: what uses it, as the error says it (``config.delay_compensation='dc'``).
    used: ``(config, method) -> bool``, whether the config turns that feature on.
  """

  name: str
  default: Any
  used_by: str
  used: Any


# Every setting a feature reads, refused when given (away from its default) while the feature is off, instead of
# being recorded in config.json as if it ran (the optimizer's own settings: OPTIMIZER_SETTINGS; the methods':
# METHOD_SETTINGS).
DEPENDENT_SETTINGS = (
    DependentSetting("dc_lambda", delay_compensation.DEFAULT_DC_LAMBDA, "config.delay_compensation='dc'",
                     lambda c, m: c.get("delay_compensation", "none") != "none"),
    DependentSetting("ps_staleness_alpha", 1.0, "config.ps_staleness_scaling='exp'",
                     lambda c, m: c.get("ps_staleness_scaling", "none") == "exp"),
    DependentSetting("pipemare_warmup_minibatches", weight_prediction.DEFAULT_PIPEMARE_WARMUP,
                     "config.delay_scaled_lr='pipemare'", lambda c, m: c.get("delay_scaled_lr", "none") != "none"),
    DependentSetting("stage_rank_grouping", "gpu", "config.stage_ranks=True",
                     lambda c, m: bool(c.get("stage_ranks", False))),
    DependentSetting("checkpoint_max_to_keep", 3, "training checkpoints (config.checkpoint_every_waves > 0)",
                     lambda c, m: checkpoint_every_waves(c, m) > 0),
    DependentSetting("num_epochs", 5.0, "config.num_minibatches=0 (above 0 it sets the run's length instead)",
                     lambda c, m: c.get("num_minibatches", 0) <= 0),
)


def check_dependent_settings(config: Any, method: str) -> None:
  """Refuses a setting of :data:`DEPENDENT_SETTINGS` given while the feature that reads it is off.

  Raises:
    ConfigError: naming the setting, what uses it and the fix.
  """
  for s in DEPENDENT_SETTINGS:
    value = config.get(s.name, s.default)
    if value != s.default and not s.used(config, method):
      raise ConfigError(f"config.{s.name}={value!r} is used only with {s.used_by}, which this run does not have: "
                        f"turn that on, or leave config.{s.name} at its default ({s.default!r})")
