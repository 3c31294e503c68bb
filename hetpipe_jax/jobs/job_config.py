"""Validated job settings derived from an ml_collections config (checked on every rank before any work).

Planning layer: no jax or mpi4py, so a bad config fails in milliseconds with one clear message.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import task_times
from hetpipe_jax.data.dataset import DatasetConfigError, check_dataset_name
from hetpipe_jax.mpi import rank_layout
from hetpipe_jax.paths import repo_path
from hetpipe_jax.planning import plan_format
from hetpipe_jax.planning import plan_times as plan_times_lib
from hetpipe_jax.planning.ps_placement import PLACEMENTS, assign_layers, gpu_node
from hetpipe_jax.rules import delay_compensation
from hetpipe_jax.rules import weight_prediction
from hetpipe_jax.rules import methods
from hetpipe_jax.rules import partition as partition_rules
from hetpipe_jax.rules import wsp
from hetpipe_jax.rules.partition import Partition


class ConfigError(ValueError):
  """A setting is invalid; the message names it and says how to fix it."""


# Settings a plan decides; left unset (None) in the config they come from the plan, or without a plan from these
# defaults. Given in the config as well as a plan, they must agree with it (Nm may be lowered or raised within the
# plan's Max_m).
PLAN_DECIDED = ("num_virtual_workers", "num_stages", "partition", "num_inflight")
DEFAULTS_WITHOUT_PLAN = {"num_virtual_workers": 2, "num_stages": 2, "num_inflight": 2}


@dataclasses.dataclass(frozen=True)
class VWLayout:
  """One VW's pipeline: a layer range and a local device index per stage."""

  partition: Partition | None  # None -> even split once the model's layer count is known
  devices: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class JobSettings:
  """The validated settings that run (recorded as they are in config.json and summary.json).

  Attributes:
    model: registry name.
    num_virtual_workers: N.
    num_inflight: Nm (HetPipe §4).
    staleness_bound: D (HetPipe §5).
    vws: per VW its layout.
    platform: "cpu" or "gpu".
    plan: the typed plan the job runs from, or None.
    sources: per plan-decided setting where its value comes from: "plan", "config", "config (= plan)",
      "config (overrides the plan's ...)" or "default".
    notes: log lines about overrides.
    method: the training method (:mod:`hetpipe_jax.rules.methods`); for the flush methods (gpipe, 1f1b_flush,
      horovod) ``num_inflight`` is M, the micro-batches per step (each of ``batch_size / M`` examples).
    memory_caps: per VW, per stage, the most minibatches a stage may hold (``plan_format.memory_caps``: a plan
      made with ``inflight_memory="schedule"``, run at its Nm); None: no caps (at most Nm).
  """

  model: str
  num_virtual_workers: int
  num_inflight: int
  staleness_bound: int
  vws: tuple[VWLayout, ...]
  platform: str
  plan: Any = None  # plan_format.Plan | None (typed; read once per process)
  sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
  notes: tuple[str, ...] = ()
  # Sharded parameter servers (MPI jobs; :func:`with_ps_shards`): ranks 0..S-1 are the shards, rank 0 the lead.
  num_ps_shards: int = 1
  ps_placement: str = "default"
  shard_nodes: tuple[str, ...] = ("host",)  # node of each shard
  vw_stage_nodes: tuple[tuple[str, ...], ...] = ()  # per VW, per stage, the node of its GPU (plan) or "host"
  method: str = "hetpipe"
  memory_caps: tuple[tuple[int, ...], ...] | None = None
  # Stage ranks (MPI jobs; :func:`with_stage_ranks`): per VW its stages grouped into processes, group 0 on the VW's
  # driver rank (S + v), the further groups on ranks after the drivers; () = one process per VW.
  stage_groups: tuple[tuple[tuple[int, ...], ...], ...] = ()

  @property
  def num_stage_ranks(self) -> int:
    """Ranks beyond the VWs' drivers that run stages (0 without stage ranks)."""
    return sum(len(g) - 1 for g in self.stage_groups)

  @property
  def num_ps_ranks(self) -> int:
    """MPI ranks of parameter servers (``num_ps_shards``; 0 for the all-reduce methods)."""
    return methods.num_ps_ranks(methods.get_method(self.method), self.num_ps_shards)

  @property
  def world_size(self) -> int:
    """MPI ranks: ``num_ps_shards`` PS shards (ranks ``0..S-1``) then one rank per VW (WSP methods); one rank per VW
    (all-reduce methods: no PS)."""
    return self.num_ps_ranks + self.num_virtual_workers + self.num_stage_ranks

  @property
  def num_stages(self) -> int | None:
    """Stages per VW when every VW has the same count, else None."""
    counts = {len(v.devices) for v in self.vws}
    return counts.pop() if len(counts) == 1 else None

  @property
  def max_num_stages(self) -> int:
    return max(len(v.devices) for v in self.vws)

  @property
  def devices_needed(self) -> int:
    """Local devices one VW process needs (max device index + 1)."""
    return 1 + max(max(v.devices) for v in self.vws)


def parse_partition(text: str | None) -> tuple[Partition, ...] | None:
  """``"0:3,3:7"`` (every VW) or ``"0:2,2:7;0:3,3:7"`` (per VW) → per-VW partitions; None or ``""`` → None (even).

  Raises:
    ConfigError: malformed text.
  """
  if text is None or not text.strip():
    return None
  try:
    return tuple(partition_rules.parse_partition(part) for part in text.split(";"))
  except ValueError as e:
    raise ConfigError(f"config.partition={e}") from None


def format_partitions(partitions: Sequence[Sequence[Sequence[int]]]) -> str:
  """Per-VW partitions as ``config.partition`` text (one partition when all VWs share it)."""
  texts = [partition_rules.format_partition(p) for p in partitions]
  return texts[0] if len(set(texts)) == 1 else ";".join(texts)


def _parse_devices(text: str, num_stages: int) -> tuple[int, ...]:
  if not text.strip():
    return tuple(range(num_stages))
  try:
    devices = tuple(int(v) for v in text.split(","))
  except ValueError:
    raise ConfigError(f"config.stage_devices={text!r} is malformed: give one device index per stage, e.g. '0,1'") \
        from None
  if len(devices) != num_stages:
    raise ConfigError(f"config.stage_devices lists {len(devices)} devices for {num_stages} stages")
  # A device may hold several stages (one GPU running a whole VW, as scripts/gpu_check.sh does): each stage keeps
  # its own in-order executor, so the stages' tasks still follow the schedule; they share the device's compute.
  if min(devices) < 0:
    raise ConfigError(f"config.stage_devices={text!r} must be non-negative device indices")
  return devices


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
  for name, (default, users) in OPTIMIZER_SETTINGS.items():
    value = config.get(name, default)
    if value != default and config.optimizer not in users:
      kind = _DECAY_RATES.get(name, f"a {name.replace('_', '-')} setting").split(" (")[0]
      raise ConfigError(f"config.{name}={value} is {kind}; config.optimizer={config.optimizer!r} (it is used by "
                        f"{', '.join(map(repr, users))})")


def optimizer_summary(config: Any) -> dict[str, Any]:
  """``summary.json``'s ``"optimizer"``: its name, learning rate and schedule, and the settings it uses (the values
  config.json holds)."""
  used = {name: config.get(name, default) for name, (default, users) in OPTIMIZER_SETTINGS.items()
          if config.optimizer in users}
  return {"name": config.optimizer, "learning_rate": config.learning_rate, "lr_schedule": config.lr_schedule,
          "warmup_minibatches": config.get("warmup_minibatches", 0), **used}


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
  _check_watchdog(config)
  _check_weight_prediction_and_pipemare(config)
  if not config.learning_rate > 0:
    raise ConfigError(f"config.learning_rate={config.learning_rate} must be > 0")
  if config.checkpoint_every_waves < 0:
    raise ConfigError(f"config.checkpoint_every_waves={config.checkpoint_every_waves} must be >= 0 (0: only the "
                      "final weights)")
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


def _check_watchdog(config: Any) -> None:
  """``ps_watchdog_s`` (:mod:`hetpipe_jax.rules.watchdog`): >= 0, and > 0 only for the methods with a PS."""
  limit = config.get("ps_watchdog_s", 0.0)
  if not limit >= 0:
    raise ConfigError(f"config.ps_watchdog_s={limit} must be >= 0 (seconds a VW may stay silent; 0: off)")
  method = config.get("method", "hetpipe")
  if limit > 0 and method in methods.METHODS and method not in methods.PS_METHODS:
    raise ConfigError(f"config.ps_watchdog_s={limit} is the parameter server's watchdog; method {method!r} has no "
                      "PS (all-reduce): set it to 0")


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
    ConfigError: an unknown mode, prediction with an optimizer that has no direction (``sgd``, ``muon``), T < 1,
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
  """

  name: str
  default: Any
  methods: tuple[str, ...]
  what: str


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
    MethodSetting("stage_ranks", False, ("hetpipe",), "runs HetPipe's pipeline with a VW's stages on separate ranks"),
    MethodSetting("remat", False, _FLUSH_METHODS, "rematerialises the flush methods' activations"),
)


def ps_scaling(config: Any) -> dict[str, Any]:
  """The :class:`hetpipe_jax.ps.param_server.ParameterServer` keywords of ``config.ps_staleness_scaling`` and
  ``config.ps_staleness_alpha`` (staleness-aware wave updates)."""
  return {"staleness_scaling": config.get("ps_staleness_scaling", "none"),
          "staleness_alpha": float(config.get("ps_staleness_alpha", 1.0))}


def ps_staleness_log(config: Any, staleness: list) -> list | None:
  """The ``(tau, scale)`` per applied wave that ``ps_applied.jsonl`` records: ``staleness``, or None under
  ``ps_staleness_scaling="none"`` (the file as without the setting)."""
  return None if config.get("ps_staleness_scaling", "none") == "none" else staleness


def check_method_settings(config: Any, method: str) -> None:
  """Refuses a setting of :data:`METHOD_SETTINGS` given to a method that does not use it.

  Raises:
    ConfigError: naming the setting, the method and the fix.
  """
  for s in METHOD_SETTINGS:
    value = config.get(s.name, s.default)
    if method in s.methods or value == s.default:
      continue
    fix = ("leave it unset" if s.default is None else
           f"set --config.{s.name}={s.default} (the default)")
    raise ConfigError(f"config.{s.name}={value!r} {s.what}, which config.method={method!r} does not use (used by "
                      f"{', '.join(s.methods)}): {fix}")


def _settings_from_plan(config: Any, plan: Any) -> JobSettings:
  """The plan's layout and Nm, with every plan-decided setting the config also gives checked against it."""
  method = config.get("method", "hetpipe")
  if plan.method != method:
    raise ConfigError(f"the plan {config.plan} is for method {plan.method!r} but config.method={method!r}: set "
                      f"--config.method={plan.method}, or plan with --method={method}")
  if int(plan.batch_size) != config.batch_size:
    raise ConfigError(f"the plan was made for batch size {plan.batch_size} but config.batch_size="
                      f"{config.batch_size}: re-plan or set --config.batch_size={plan.batch_size}")
  fix = "leave it unset to use the plan's value, re-plan, or run without a plan (--config.plan=)"
  sources: dict[str, str] = {}
  notes: list[str] = []
  num_vws = len(plan.virtual_workers)
  given = config.get("num_virtual_workers")
  if given is not None and given != num_vws:
    raise ConfigError(f"config.num_virtual_workers={given} but the plan {config.plan} has {num_vws} virtual workers: "
                      f"{fix}")
  sources["num_virtual_workers"] = "plan" if given is None else "config (= plan)"
  plan_stages = [len(vw.partition) for vw in plan.virtual_workers]
  given = config.get("num_stages")
  if given is not None and any(s != given for s in plan_stages):
    raise ConfigError(f"config.num_stages={given} but the plan {config.plan} has {plan_stages} stages per virtual "
                      f"worker: {fix}")
  sources["num_stages"] = "plan" if given is None else "config (= plan)"
  plan_partitions = [tuple(tuple(r) for r in vw.partition) for vw in plan.virtual_workers]
  text = config.get("partition")
  if text is not None:
    given_parts = parse_partition(text)
    if given_parts is None:  # "" = an explicit even split
      given_parts = tuple(partition_rules.even_partition(plan.num_layers, s) for s in plan_stages)
    if len(given_parts) == 1:
      given_parts = given_parts * num_vws
    if list(given_parts) != plan_partitions:
      raise ConfigError(f"config.partition={text!r} but the plan {config.plan} has partition "
                        f"{format_partitions(plan_partitions)!r}: {fix}")
  sources["partition"] = "plan" if text is None else "config (= plan)"
  max_m = min(vw.max_num_inflight for vw in plan.virtual_workers)
  given = config.get("num_inflight")
  num_inflight = plan.num_inflight if given is None else given
  if given is None:
    sources["num_inflight"] = "plan"
  elif given == plan.num_inflight:
    sources["num_inflight"] = "config (= plan)"
  elif given > max_m:
    raise ConfigError(f"config.num_inflight={given} exceeds the plan's Max_m={max_m} (the most minibatches in flight "
                      f"that fit every GPU's memory; the plan chose Nm={plan.num_inflight}): set "
                      f"--config.num_inflight to at most {max_m}, or leave it unset to use the plan's Nm")
  else:
    sources["num_inflight"] = f"config (overrides the plan's Nm={plan.num_inflight}; <= the plan's Max_m={max_m})"
    notes.append(f"config.num_inflight={given} overrides the plan's Nm={plan.num_inflight}: memory re-checked "
                 f"against the plan's Max_m={max_m} (every stage fits)")
  # On "cpu" every VW process forces its own host devices, so stage s runs on local device s; on "gpu" the plan's
  # node-local device indices are used as they are.
  vws = []
  for vw, partition in zip(plan.virtual_workers, plan_partitions):
    planned = tuple(range(len(partition))) if config.platform == "cpu" else tuple(vw.devices)
    if config.stage_devices.strip() and _parse_devices(config.stage_devices, len(partition)) != planned:
      raise ConfigError(f"config.stage_devices={config.stage_devices!r} but the plan places virtual worker "
                        f"{vw.vw_id} on devices {list(planned)}: {fix}")
    vws.append(VWLayout(partition, planned))
  caps = plan_format.memory_caps(plan, num_inflight)
  if caps is not None:
    sources["memory_caps"] = "plan (inflight_memory='schedule': each stage holds at most its held_per_stage)"
  elif plan.cost_model.get("inflight_memory") == "schedule" and num_inflight != plan.num_inflight:
    sources["memory_caps"] = "none (the plan's held_per_stage was counted at its Nm, the run uses another)"
    notes.append(f"the plan counted memory with inflight_memory='schedule' at Nm={plan.num_inflight}; at "
                 f"Nm={num_inflight} its per-stage caps do not apply and are not enforced")
  return JobSettings(plan.model, num_vws, num_inflight, config.staleness_bound, tuple(vws), config.platform, plan,
                     sources, tuple(notes), method=method, memory_caps=caps)


def settings_from_config(config: Any, plan: Any = None) -> JobSettings:
  """Checks the scalar settings and builds the per-VW layout (from the config, or from a typed plan).

  Args:
    config: the job's ConfigDict (see ``experiments/configs/default.py``).
    plan: the :class:`hetpipe_jax.planning.plan_format.Plan` named by ``config.plan`` (:func:`load_plan`), or None.

  Raises:
    ConfigError: ``num_inflight < 1``, ``staleness_bound < 0``, a non-positive VW/stage/batch count, a malformed
      partition or device list, an unknown platform or optimizer; with a plan, a plan-decided setting that disagrees
      with it (``num_inflight`` may differ when it is at most the plan's Max_m).
  """
  _check_scalars(config)
  if plan is not None:
    return _settings_from_plan(config, plan)
  sources = {}
  values = {}
  method = config.get("method", "hetpipe")
  defaults = dict(DEFAULTS_WITHOUT_PLAN)
  defaults.update(methods.get_method(method).config_defaults)  # horovod: one GPU per worker; pipedream: NOAM
  for name, default in defaults.items():
    given = config.get(name)
    values[name] = default if given is None else given
    sources[name] = "default" if given is None else "config"
  partitions = parse_partition(config.get("partition"))
  sources["partition"] = "config" if partitions else "default (even split)"
  num_vws, num_stages = values["num_virtual_workers"], values["num_stages"]
  if values["num_inflight"] is None:
    values["num_inflight"] = num_stages
    sources["num_inflight"] = "default (PipeDream's NOAM = num_stages)"
  if methods.get_method(method).single_stage and num_stages != 1:
    raise ConfigError(f"config.method={method!r} holds the whole model on one device per worker: num_stages must be 1, "
                      f"got {num_stages}")
  if config.batch_size % methods.micro_batches_per_minibatch(methods.get_method(method), values["num_inflight"]):
    raise ConfigError(f"config.method={method!r} splits each minibatch into num_inflight={values['num_inflight']} "
                      f"micro-batches, but config.batch_size={config.batch_size} is not a multiple of it")
  if partitions is not None:
    if len(partitions) not in (1, num_vws):
      raise ConfigError(f"config.partition={config.partition!r} gives {len(partitions)} partitions for {num_vws} "
                        "virtual workers: give one for all, or one per VW separated by ';'")
    if any(len(p) != num_stages for p in partitions):
      raise ConfigError(f"config.partition={config.partition!r} has {[len(p) for p in partitions]} ranges but "
                        f"config.num_stages={num_stages}")
    if len(partitions) == 1:
      partitions = partitions * num_vws
  else:
    partitions = (None,) * num_vws
  devices = _parse_devices(config.stage_devices, num_stages)
  return JobSettings(config.model, num_vws, values["num_inflight"], config.staleness_bound,
                     tuple(VWLayout(p, devices) for p in partitions), config.platform, None, sources, (), method=method)


def check_world_size(settings: JobSettings, world_size: int, config: Any = None) -> None:
  """Checks that the MPI world is the job's ranks (:attr:`JobSettings.world_size`).

  Args:
    settings: the job's settings (PS shards and stage ranks resolved).
    world_size: the MPI world's size.
    config: the job's ConfigDict, when given: a fix that would contradict it (a per-VW partition or emulated times)
      is not suggested.

  Raises:
    ConfigError: a world of another size; the message suggests only fixes that fit the job: ``mpiexec -n <ranks>``,
      and without a plan or stage ranks, the number of VWs that fits the world when there is one.
  """
  if world_size != settings.world_size:
    what = "the plan's" if settings.plan is not None else "config.num_virtual_workers"
    if settings.num_ps_ranks:
      s = settings.num_ps_shards
      ps = "rank 0 = PS" if s == 1 else f"ranks 0..{s - 1} = PS shards (config.num_ps_shards={s})"
      layout = f"{ps}, ranks {s}..{s + settings.num_virtual_workers - 1} = VWs"
      if settings.num_stage_ranks:
        first = s + settings.num_virtual_workers
        layout += (f" (their first stages), ranks {first}..{first + settings.num_stage_ranks - 1} = the VWs' further "
                   f"stages (config.stage_ranks=True, grouping {settings.stage_groups})")
    else:
      s = 0
      layout = f"one rank per VW: config.method={settings.method!r} has no PS"
    fits = world_size - s  # the VWs this world holds beside the PS shards
    per_vw = config is not None and any(";" in (config.get(name) or "") for name in ("partition", "emulate_stage_ms"))
    other = (f" or set config.num_virtual_workers={fits}"
             if settings.plan is None and not settings.num_stage_ranks and fits >= 1 and not per_vw else "")
    raise ConfigError(f"MPI world size is {world_size} but the job has {settings.num_virtual_workers} virtual "
                      f"workers ({what}): run `mpiexec -n {settings.world_size} ...` ({layout}){other}")


def check_devices(settings: JobSettings, num_devices: int) -> None:
  """Raises ConfigError when a VW needs more local devices than its process has."""
  if settings.devices_needed > num_devices:
    raise ConfigError(f"{settings.max_num_stages} stages need {settings.devices_needed} local devices per VW but "
                      f"only {num_devices} {settings.platform} device(s) exist: lower config.num_stages or fix "
                      "config.stage_devices")


def check_partitions(settings: JobSettings, num_layers: int) -> list[Partition]:
  """Per-VW partitions validated against the model's layer count (an even split where none is given).

  Raises:
    ConfigError: a partition that does not cover every layer exactly once, or more stages than layers.
  """
  out = []
  for vw in settings.vws:
    try:
      if vw.partition is None:
        out.append(partition_rules.even_partition(num_layers, len(vw.devices)))
      else:
        out.append(partition_rules.validate_partition(vw.partition, num_layers))
    except ValueError as e:
      raise ConfigError(f"config.partition: {e}") from None
  return out


def resolved_config(config: Any, settings: JobSettings, partitions: Sequence[Partition],
                    **overrides: Any) -> dict[str, Any]:
  """The config as it runs: every plan-decided setting replaced by the value that runs, plus ``setting_sources``.

  This is what ``config.json`` records (so config.json and summary.json agree); ``overrides`` are further resolved
  values (e.g. ``emulate_plan=True`` in virtual mode).
  """
  d = config.to_dict()
  d.update(num_virtual_workers=settings.num_virtual_workers, num_stages=settings.num_stages,
           partition=format_partitions(partitions), num_inflight=settings.num_inflight, **overrides)
  d["setting_sources"] = dict(settings.sources)
  d["memory_caps"] = None if settings.memory_caps is None else [list(c) for c in settings.memory_caps]
  return d


def config_to_json(d: Mapping[str, Any]) -> str:
  return json.dumps(dict(d), indent=2, sort_keys=True, default=str)


def load_plan(config: Any) -> Any:
  """Reads ``config.plan`` (a plan JSON written by ``python -m hetpipe_jax.plan``) once; None when unset.

  Returns:
    The typed :class:`hetpipe_jax.planning.plan_format.Plan`.

  Raises:
    ConfigError: the file is missing or unreadable, or it was made for another model than ``config.model``.
  """
  if not config.plan:
    return None
  try:
    return plan_format.load_plan(str(repo_path(config.plan)), expected_model=config.model)
  except (OSError, ValueError) as e:
    raise ConfigError(f"config.plan={config.plan!r}: {e}") from None


def resolve_settings(config: Any) -> JobSettings:
  """:func:`load_plan` then :func:`settings_from_config`: the one call an entry point makes."""
  return settings_from_config(config, load_plan(config))


def parse_stage_ms(text: str, num_vws: int, num_stages: int) -> list[list[float]] | None:
  """``"20,40"`` (every VW) or ``"20,40;30,30"`` (per VW) → per-VW per-stage milliseconds; ``""`` → None.

  Raises:
    ConfigError: malformed, wrong counts, or a non-positive time.
  """
  if not text.strip():
    return None
  try:
    rows = [[float(v) for v in part.split(",")] for part in text.split(";")]
  except ValueError:
    raise ConfigError(f"config.emulate_stage_ms={text!r} is malformed: write per-stage milliseconds, e.g. "
                      "'20,40' for every VW or '20,40;30,30' per VW") from None
  if len(rows) == 1:
    rows = rows * num_vws
  if len(rows) != num_vws or any(len(r) != num_stages for r in rows):
    raise ConfigError(f"config.emulate_stage_ms={text!r} needs {num_stages} times per VW for {num_vws} VWs")
  if any(v <= 0 for r in rows for v in r):
    raise ConfigError(f"config.emulate_stage_ms={text!r}: every time must be > 0")
  return rows


def timing_plan_task_times(config: Any, settings: JobSettings) -> list:
  """Per-VW task times from ``config.timing_plan``: another plan's cost-model times drive simulated time while
  ``config.model``'s numerics run on the config's layout (virtual time only; e.g. the paper-scale ResNet-152's plan
  on ``hetpipe_paper`` timing a Fashion-MNIST model, HetPipe §8.4 reproduced as staleness pattern and speed).

  The timing plan must describe the run's schedule: the same method, number of VWs, stages per VW, ``num_inflight``
  (Nm, or M for the flush methods) and batch size; its model may differ from ``config.model``.

  Returns:
    Per VW a :class:`hetpipe_jax.costs.task_times.VWTaskTimes` (seconds),
    :func:`hetpipe_jax.planning.plan_times.task_times_from_plan`.

  Raises:
    ConfigError: ``config.plan`` is also set, the file is missing or invalid, or the timing plan's schedule differs
      from the run's (the message names both values and the fix).
  """
  name = f"config.timing_plan={config.timing_plan!r}"
  if settings.plan is not None:
    raise ConfigError(f"{name} and config.plan={config.plan!r}: a timing plan times a run laid out by the config "
                      "(num_virtual_workers, num_stages, num_inflight); unset one of them (--config.plan=)")
  try:
    plan = plan_format.load_plan(str(repo_path(config.timing_plan)))
  except (OSError, ValueError) as e:
    raise ConfigError(f"{name}: {e}") from None
  stages = [len(vw.partition) for vw in plan.virtual_workers]
  checks = (("method", plan.method, settings.method),
            ("num_virtual_workers", len(stages), settings.num_virtual_workers),
            ("num_stages", stages, [len(vw.devices) for vw in settings.vws]),
            ("num_inflight", plan.num_inflight, settings.num_inflight),
            ("batch_size", plan.batch_size, config.batch_size))
  for field, want, got in checks:
    if want != got:
      raise ConfigError(f"{name} has {field}={want} but the run has config.{field}={got}: the timing plan must "
                        f"describe the run's schedule; set --config.{field}={want} or plan the timing again")
  try:
    return plan_times_lib.task_times_from_plan(plan, plan_times_lib.profile_for_plan(plan),
                                               cluster_lib.load_cluster(plan.cluster))
  except (OSError, ValueError) as e:
    raise ConfigError(f"{name}: {e}") from None


def emulated_task_times(config: Any, settings: JobSettings, *, plan_times: bool | None = None,
                        virtual: bool = False) -> list | None:
  """Per-VW :class:`hetpipe_jax.costs.task_times.VWTaskTimes` for emulated devices, or None when not emulating.

  ``config.emulate_stage_ms`` gives synthetic per-stage times of one minibatch (a third forward, two thirds
  backward; the flush methods' tasks are micro-batches, each ``1 / M`` of it);
  ``config.emulate_plan`` (or ``plan_times=True``) uses the cost model's times for the GPU types of the plan's devices;
  ``config.timing_plan`` (``virtual`` runs only) another plan's (:func:`timing_plan_task_times`).

  Raises:
    ConfigError: two sources set, plan times without a plan, a timing plan outside virtual time, or malformed times.
  """
  use_plan = config.emulate_plan if plan_times is None else plan_times
  if config.get("timing_plan", ""):
    if not virtual:
      raise ConfigError(f"config.timing_plan={config.timing_plan!r} times simulated seconds: it needs --mode=virtual "
                        "(under MPI use config.emulate_plan with a plan of config.model)")
    if config.emulate_stage_ms.strip() or config.emulate_plan:
      raise ConfigError("set one of config.timing_plan, config.emulate_stage_ms and config.emulate_plan")
    return timing_plan_task_times(config, settings)
  stages = settings.num_stages
  rows = None
  if config.emulate_stage_ms.strip():
    if stages is None:
      raise ConfigError("config.emulate_stage_ms needs every VW to have the same number of stages")
    rows = parse_stage_ms(config.emulate_stage_ms, settings.num_virtual_workers, stages)
  if rows is not None and use_plan:
    raise ConfigError("set config.emulate_stage_ms or config.emulate_plan, not both")
  if rows is not None:
    # the given times are per minibatch; a task is a micro-batch (flush methods)
    per_task = methods.micro_batches_per_minibatch(methods.get_method(settings.method), settings.num_inflight)
    rows = [[v / per_task for v in r] for r in rows]
    return [task_times.uniform_task_times(r) for r in rows]
  if not use_plan:
    return None
  if settings.plan is None:
    raise ConfigError("config.emulate_plan needs config.plan (the plan's GPU types give the task times)")
  plan = settings.plan
  try:
    profile = plan_times_lib.profile_for_plan(plan)
    return plan_times_lib.task_times_from_plan(plan, profile, cluster_lib.load_cluster(plan.cluster))
  except (OSError, ValueError) as e:
    raise ConfigError(f"config.emulate_plan: {e}") from None


def plan_nodes(plan: Any) -> list[str]:
  """The plan's nodes in shard order: its ``ps_placement["shard_nodes"]`` (the cluster's node order), or for older
  plans the nodes in order of first appearance among the VWs' GPUs."""
  names = plan.ps_placement.get("shard_nodes")
  if names:
    return list(names)
  out: list[str] = []
  for vw in plan.virtual_workers:
    for g in vw.gpus:
      if gpu_node(g) not in out:
        out.append(gpu_node(g))
  return out


def with_ps_shards(config: Any, settings: JobSettings) -> JobSettings:
  """Resolves the sharded parameter servers of an MPI job (HetPipe §8.1 "Parameter Placement").

  ``config.num_ps_shards`` (unset: one shard per node of the plan, HetPipe §8.1; 1 without a plan, today's single
  rank-0 PS) and ``config.ps_placement`` (``""``: the plan's chosen policy, ``"default"`` without a plan). Each layer
  lives on one shard: ``default`` places the parameterised layers round-robin over the shards, ``local`` on the
  shard of the node that runs the layer in most VWs (needs a plan and one shard per plan node).

  Raises:
    ConfigError: ``num_ps_shards < 1``, an unknown placement, ``local`` without a plan or with a shard count other
      than the plan's node count; with more than one shard, periodic checkpoints or evaluations (not supported
      yet: they need every shard's weights on one rank during the run).
  """
  plan = settings.plan
  nodes = plan_nodes(plan) if plan is not None else ["host"]
  given = config.get("num_ps_shards")
  sources = dict(settings.sources)
  one_ps = not methods.get_method(settings.method).sharded_ps
  if given is None and one_ps:
    num = 1
    sources["num_ps_shards"] = f"default (1: config.method={settings.method!r} runs with one PS on rank 0)"
  elif given is None:
    num = len(nodes) if plan is not None else 1
    sources["num_ps_shards"] = "plan (one shard per node)" if plan is not None else "default (1: one PS on rank 0)"
  else:
    num = int(given)
    sources["num_ps_shards"] = "config"
    if num < 1:
      raise ConfigError(f"config.num_ps_shards={given}: must be >= 1 (1 = one PS on rank 0), or leave it unset for "
                        "one shard per node of the plan")
  if one_ps and num > 1:
    raise ConfigError(f"config.num_ps_shards={num} with config.method={settings.method!r}: per-stage updates with "
                      "sharded parameter servers are not supported yet; leave config.num_ps_shards unset (one PS) "
                      "or use --config.method=hetpipe")
  policy = config.get("ps_placement") or ""
  if policy:
    sources["ps_placement"] = "config"
  else:
    policy = plan.ps_placement.get("policy", "default") if plan is not None else "default"
    sources["ps_placement"] = "plan" if plan is not None else "default"
  if policy not in PLACEMENTS:
    raise ConfigError(f"config.ps_placement={policy!r} must be one of {list(PLACEMENTS)} (or '' for the plan's)")
  if policy == "local" and (plan is None or num != len(nodes)):
    raise ConfigError(f"config.ps_placement='local' needs a plan and one shard per plan node (config.num_ps_shards="
                      f"{num}, plan nodes: {len(nodes) if plan is not None else 'no plan'}): give a plan and leave "
                      "config.num_ps_shards unset, or use --config.ps_placement=default")
  if num > 1 and config.checkpoint_every_waves > 0:
    raise ConfigError(f"config.checkpoint_every_waves={config.checkpoint_every_waves} with {num} PS shards: "
                      "checkpoint barriers are not supported with sharded parameter servers yet; set "
                      "--config.checkpoint_every_waves=0 (the final weights are still saved) or "
                      "--config.num_ps_shards=1")
  if num > 1 and config.eval_every_epochs > 0:
    raise ConfigError(f"config.eval_every_epochs={config.eval_every_epochs} with {num} PS shards: evaluation during "
                      "the run is not supported with sharded parameter servers yet; set "
                      "--config.eval_every_epochs=0 (the final weights are still evaluated) or "
                      "--config.num_ps_shards=1")
  scaling = config.get("ps_staleness_scaling", "none")
  if num > 1 and scaling != "none":
    raise ConfigError(f"config.ps_staleness_scaling={scaling!r} with {num} PS shards: the shards see the VWs' "
                      "pushes and pulls in their own orders, so they could scale one wave by different staleness; "
                      "set --config.num_ps_shards=1 or --config.ps_staleness_scaling=none")
  shard_nodes = tuple(nodes[i % len(nodes)] for i in range(num))
  if plan is not None:
    stage_nodes = tuple(tuple(gpu_node(g) for g in vw.gpus) for vw in plan.virtual_workers)
  else:
    stage_nodes = tuple(("host",) * len(v.devices) for v in settings.vws)
  return dataclasses.replace(settings, num_ps_shards=num, ps_placement=policy, shard_nodes=shard_nodes,
                             vw_stage_nodes=stage_nodes, sources=sources)


def ps_layer_shards(settings: JobSettings, partitions: Sequence[Partition], has_params: Sequence[bool]
                    ) -> list[int | None]:
  """Per layer, the index of the PS shard that holds it (None: no parameters), by the one placement rule
  (:func:`hetpipe_jax.planning.ps_placement.assign_layers`) over ``settings.shard_nodes``.

  Under ``default`` placement every shard must hold some parameters: a shard left empty (more shards than layers
  with parameters) would be a rank that serves nothing. Under ``local`` placement a node whose stages have no
  parameters keeps its (empty) shard: the placement has one shard per node.

  Raises:
    ConfigError: ``default`` placement leaves a shard without parameters (the message names the shards and the
      most that hold some).
  """
  num = settings.num_ps_shards
  per_vw = []
  for part, nodes in zip(partitions, settings.vw_stage_nodes):
    layer_nodes = [""] * len(has_params)
    for (start, end), node in zip(part, nodes):
      for layer in range(start, end):
        layer_nodes[layer] = node
    per_vw.append(layer_nodes)
  if settings.ps_placement == "local":  # one shard per node: shard i is node i
    labels = list(settings.shard_nodes)
  else:  # round-robin over the shards themselves
    labels = [str(i) for i in range(num)]
  shards = [None if a is None else labels.index(a)
            for a in assign_layers(settings.ps_placement, labels, has_params, per_vw)]
  empty = [i for i in range(num) if i not in shards]
  if empty and settings.ps_placement != "local":
    held = sum(bool(h) for h in has_params)
    raise ConfigError(f"config.num_ps_shards={num}: PS shard{'s' if len(empty) > 1 else ''} "
                      f"{', '.join(map(str, empty))} would hold no parameters (the model has {held} layers with "
                      f"parameters, placed round-robin over the shards): set --config.num_ps_shards to at most "
                      f"{held} (python -m hetpipe_jax.launch: --num_ps_shards={held})")
  return shards


def with_stage_ranks(config: Any, settings: JobSettings, resume: bool = False) -> JobSettings:
  """Resolves stage ranks (``config.stage_ranks``): a VW's stages on separate MPI ranks, grouped by
  :func:`hetpipe_jax.mpi.rank_layout.stage_groups` (``config.stage_rank_grouping``: ``"gpu"``, one rank per stage;
  ``"node"``, the VW's stages on one plan node in one rank). Call after :func:`with_ps_shards` (it sets the stages'
  nodes). Off: ``settings`` unchanged (one process per VW).

  Raises:
    ConfigError: checkpoint barriers (``config.checkpoint_every_waves > 0``) or ``--resume`` with stage ranks (the
      optimizer states live on the stage ranks; not supported yet).
  """
  if not config.get("stage_ranks", False):
    return settings
  if config.checkpoint_every_waves > 0:
    raise ConfigError(f"config.checkpoint_every_waves={config.checkpoint_every_waves} with config.stage_ranks=True: "
                      "checkpoint barriers are not supported with stage ranks yet; set "
                      "--config.checkpoint_every_waves=0 (the final weights are still saved)")
  if resume:
    raise ConfigError("--resume with config.stage_ranks=True is not supported yet (stage ranks write no checkpoints "
                      "with optimizer states): resume without stage ranks")
  grouping = config.get("stage_rank_grouping", "gpu")
  groups = tuple(rank_layout.stage_groups(nodes, grouping) for nodes in settings.vw_stage_nodes)
  return dataclasses.replace(settings, stage_groups=groups)
