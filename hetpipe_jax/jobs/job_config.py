"""The one reader of a job's config: :func:`resolve_job` validates the flat ml_collections config (and reads its plan
once) and returns the frozen, typed :class:`hetpipe_jax.jobs.job.Job` every driver runs from.

Planning layer: no jax or mpi4py, so a bad config fails in milliseconds with one clear message, on every rank before
any work. The steps, in order: the flat settings' checks (:mod:`hetpipe_jax.jobs.job_checks`), the layout from the
config or the plan (:func:`settings_from_config`), for an MPI job of a parameter-server method its PS shards and stage
ranks (:mod:`hetpipe_jax.jobs.job_ranks`), then the Job's sections. The flat names stay the user's interface (config
files, ``--config.<field>`` flags, ``config.json``); see :mod:`hetpipe_jax.jobs.job`.
"""

from __future__ import annotations

import json
import types
from typing import Any, Mapping, Sequence

import ml_collections

from hetpipe_jax.data.dataset import DataSettings
from hetpipe_jax.jobs import job as job_lib
from hetpipe_jax.jobs.job import Job, JobSettings, VWLayout  # noqa: F401  (VWLayout: re-exported)
from hetpipe_jax.jobs.job_checks import (METHOD_SETTINGS, OPTIMIZER_SETTINGS, OPTIMIZERS,  # noqa: F401  (re-exported)
                                         ConfigError, MethodSetting, _check_scalars, check_method_settings,
                                         checkpoint_every_waves,
                                         optimizer_summary, parse_debug_nan_update)
from hetpipe_jax.jobs.job_ranks import (plan_nodes, ps_layer_shards, with_ps_shards,  # noqa: F401  (re-exported)
                                        with_stage_ranks)
from hetpipe_jax.paths import repo_path
from hetpipe_jax.planning import plan_format
from hetpipe_jax.rules import delay_compensation
from hetpipe_jax.rules import methods
from hetpipe_jax.rules import partition as partition_rules
from hetpipe_jax.rules import weight_prediction
from hetpipe_jax.rules.partition import Partition


# Settings a plan decides; left unset (None) in the config they come from the plan, or without a plan from these
# defaults. Given in the config as well as a plan, they must agree with it (Nm may be lowered or raised within the
# plan's Max_m).
PLAN_DECIDED = ("num_virtual_workers", "num_stages", "partition", "num_inflight")
DEFAULTS_WITHOUT_PLAN = {"num_virtual_workers": 2, "num_stages": 2, "num_inflight": 2}


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


def check_world_size(settings: Any, world_size: int, flat: Mapping[str, Any] | None = None) -> None:
  """Checks that the MPI world is the job's ranks (:attr:`hetpipe_jax.jobs.job.Job.world_size`).

  Args:
    settings: the :class:`hetpipe_jax.jobs.job.Job` (or its layout, PS shards and stage ranks resolved).
    world_size: the MPI world's size.
    flat: the config as given (:attr:`hetpipe_jax.jobs.job.Job.flat`), when given: a fix that would contradict it
      (a per-VW partition or emulated times) is not suggested.

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
    per_vw = flat is not None and any(";" in (flat.get(name) or "") for name in ("partition", "emulate_stage_ms"))
    other = (f" or set config.num_virtual_workers={fits}"
             if settings.plan is None and not settings.num_stage_ranks and fits >= 1 and not per_vw else "")
    raise ConfigError(f"MPI world size is {world_size} but the job has {settings.num_virtual_workers} virtual "
                      f"workers ({what}): run `mpiexec -n {settings.world_size} ...` ({layout}){other}")


def check_devices(settings: Any, num_devices: int) -> None:
  """Raises ConfigError when a VW needs more local devices than its process has."""
  if settings.devices_needed > num_devices:
    raise ConfigError(f"{settings.max_num_stages} stages need {settings.devices_needed} local devices per VW but "
                      f"only {num_devices} {settings.platform} device(s) exist: lower config.num_stages or fix "
                      "config.stage_devices")


def check_partitions(settings: Any, num_layers: int) -> list[Partition]:
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


def resolved_config(job: Job, partitions: Sequence[Partition], **overrides: Any) -> dict[str, Any]:
  """The config as it runs: the flat config as given (:attr:`hetpipe_jax.jobs.job.Job.flat`) with every
  plan-decided setting replaced by the value that runs, plus ``setting_sources``.

  This is what ``config.json`` records (so config.json and summary.json agree); ``overrides`` are further resolved
  values (e.g. ``emulate_plan=True`` in virtual mode).
  """
  d = dict(job.flat)
  d.update({"num_virtual_workers": job.num_virtual_workers, "num_stages": job.num_stages,
            "partition": format_partitions(partitions), "num_inflight": job.num_inflight,
            "checkpoint_every_waves": job.checkpoint.every_waves, "emulate_plan": bool(job.emulation.emulate_plan),
            **overrides})
  d["setting_sources"] = dict(job.sources)
  d["memory_caps"] = None if job.memory_caps is None else [list(c) for c in job.memory_caps]
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
  """:func:`load_plan` then :func:`settings_from_config`: the layout, the first step of :func:`resolve_job`."""
  return settings_from_config(config, load_plan(config))


def resolve_job(config: Any, mode: str = "mpi", resume: bool = False) -> Job:
  """The job ``config`` describes, validated: the one function that reads the ConfigDict.

  Args:
    config: the job's flat ConfigDict (``experiments/configs/default.py``), ``config.plan`` set.
    mode: ``"mpi"`` (``hetpipe_jax.train``'s default: the parameter-server methods resolve their PS shards and stage
      ranks) or ``"virtual"`` (one process, one in-process PS).
    resume: the run continues from its newest checkpoint (``--resume``).

  Raises:
    ConfigError: any invalid setting (:func:`settings_from_config`, :func:`hetpipe_jax.jobs.job_ranks.
      with_ps_shards`, :func:`hetpipe_jax.jobs.job_ranks.with_stage_ranks`); in virtual time, ``num_ps_shards`` other
      than 1.
  """
  if mode not in ("mpi", "virtual"):
    raise ValueError(f"mode={mode!r} must be 'mpi' or 'virtual'")
  settings = resolve_settings(config)
  if mode == "virtual":
    if config.get("num_ps_shards") not in (None, 1):
      raise ConfigError(f"config.num_ps_shards={config.num_ps_shards}: virtual time runs one in-process PS; leave it "
                        "unset or 1 (sharded parameter servers run under MPI)")
    if config.get("ps_watchdog_s", 0.0):
      raise ConfigError(f"config.ps_watchdog_s={config.ps_watchdog_s}: virtual time has no hung ranks to watch; set "
                        "it to 0 (the watchdog runs under MPI)")
    if config.get("stage_ranks", False):
      raise ConfigError("config.stage_ranks=True: virtual time runs every VW's stages in its one process; set it to "
                        "False (stage ranks run under MPI)")
  elif settings.num_ps_ranks:
    settings = with_ps_shards(config, settings)  # sharded PS: ranks 0..S-1
    settings = with_stage_ranks(config, settings)  # stage ranks: ranks S+N.. (after the VWs' drivers)
  return _build_job(config, settings, mode, resume)


def _build_job(config: Any, settings: JobSettings, mode: str, resume: bool) -> Job:
  """The :class:`Job` of a checked config and its resolved layout (every value as it runs)."""
  get = config.get
  opt = {name: get(name, default) for name, (default, _) in OPTIMIZER_SETTINGS.items()}
  return Job(
      model=settings.model, batch_size=config.batch_size, seed=config.seed,
      data=DataSettings(get("dataset", "fashion_mnist"), config.data_dir, config.check_counts,
                        ml_collections.FrozenConfigDict(config)),
      pipeline=job_lib.PipelineSettings(
          settings.method, settings.num_virtual_workers, settings.num_inflight, settings.vws, settings.memory_caps,
          settings.stage_groups, bool(get("stage_ranks", False)), get("stage_rank_grouping", "gpu"),
          bool(get("vertical_sync", False)), bool(get("remat", False)), settings.platform,
          get("num_cpu_devices", 0)),
      wsp=job_lib.WSPSettings(settings.staleness_bound, config.pull_every_wave, config.ps_apply),
      ps=job_lib.PSSettings(settings.num_ps_shards, settings.ps_placement, settings.shard_nodes,
                            settings.vw_stage_nodes, get("ps_staleness_scaling", "none"),
                            get("ps_staleness_alpha", 1.0), float(get("ps_watchdog_s", 0.0))),
      optim=job_lib.OptimSettings(
          config.optimizer, config.learning_rate, config.lr_schedule, get("warmup_minibatches", 0),
          opt["momentum"], opt["adam_b1"], opt["adam_b2"], opt["weight_decay"], opt["muon_beta"],
          get("grad_clip_norm", 0.0), get("delay_compensation", "none"),
          get("dc_lambda", delay_compensation.DEFAULT_DC_LAMBDA), get("weight_prediction", "none"),
          get("delay_scaled_lr", "none"),
          get("pipemare_warmup_minibatches", weight_prediction.DEFAULT_PIPEMARE_WARMUP),
          muon_consistent_rms=opt["muon_consistent_rms"]),
      checkpoint=job_lib.CheckpointSettings(checkpoint_every_waves(config, settings.method),
                                            config.checkpoint_max_to_keep),
      emulation=job_lib.EmulationSettings(config.emulate_stage_ms, config.emulate_plan, get("timing_plan", "")),
      run=job_lib.RunSettings(config.num_epochs, config.num_minibatches, config.log_every_waves,
                              config.eval_every_epochs, config.eval_batch_size, config.progress,
                              config.save_task_trace, parse_debug_nan_update(config.debug_nan_update)),
      plan=settings.plan, plan_path=config.plan or "",
      sources=types.MappingProxyType({**settings.sources, "checkpoint_every_waves": (
          "default" if config.get("checkpoint_every_waves") is None else "config")}),
      notes=tuple(settings.notes), mode=mode, resume=resume,
      flat=types.MappingProxyType(config.to_dict()))
