"""One training job, resolved once: a frozen, typed :class:`Job` in sections, built from the flat config and a plan.

Planning layer (no jax, no mpi4py). The user-facing settings stay flat: ``experiments/configs/*.py`` and the
``--config.<field>=<value>`` flags are unchanged, and ``config.json`` records the flat config as it ran
(:attr:`Job.flat` with every plan-decided setting replaced by its value, :func:`hetpipe_jax.jobs.job_config.
resolved_config`), so a run's records are those of the flat config. :func:`hetpipe_jax.jobs.job_config.resolve_job`
is the one function that reads the ConfigDict: it validates every setting (the error names the setting and the fix),
reads the plan once, resolves the parameter-server shards and stage ranks of an MPI job, and returns the :class:`Job`;
every function after it (the drivers, the outputs, resume, the data loader) takes the Job or one of its sections.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping

from hetpipe_jax.data.dataset import DataSettings
from hetpipe_jax.rules import methods
from hetpipe_jax.rules.partition import Partition


@dataclasses.dataclass(frozen=True)
class VWLayout:
  """One VW's pipeline: a layer range and a local device index per stage."""

  partition: Partition | None  # None -> even split once the model's layer count is known
  devices: tuple[int, ...]


class _RankLayout:
  """The MPI layout's counts, read from ``method``, ``num_ps_shards``, ``num_virtual_workers``, ``vws`` and
  ``stage_groups`` (one rule for :class:`JobSettings` and :class:`Job`)."""

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
    """MPI ranks: ``num_ps_shards`` PS shards (ranks ``0..S-1``), one rank per VW, then the stage ranks (all-reduce
    methods: no PS)."""
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


@dataclasses.dataclass(frozen=True)
class JobSettings(_RankLayout):
  """The layout a job resolves first (:func:`hetpipe_jax.jobs.job_config.settings_from_config`, then the MPI job's
  PS shards and stage ranks, :mod:`hetpipe_jax.jobs.job_ranks`); :func:`hetpipe_jax.jobs.job_config.resolve_job`
  turns it into the :class:`Job`'s sections. Nothing after ``resolve_job`` sees it.

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



@dataclasses.dataclass(frozen=True)
class PipelineSettings:
  """The method and its pipelines (HetPipe §4).

  Attributes:
    method: the training method (:mod:`hetpipe_jax.rules.methods`).
    num_virtual_workers: N.
    num_inflight: Nm, minibatches in flight per VW (the flush methods: M, micro-batches per step).
    vws: per VW its partition and stage devices.
    memory_caps: per VW, per stage, the most minibatches a stage may hold (a plan's ``held_per_stage``); None: Nm.
    stage_groups: per VW its stages grouped into processes (MPI stage ranks); ``()``: one process per VW.
    stage_ranks: ``config.stage_ranks`` as given; stage_rank_grouping: ``"gpu"`` or ``"node"``.
    vertical_sync: PipeDream's vertical sync. remat: the flush methods' rematerialisation.
    platform: ``"cpu"`` or ``"gpu"``; num_cpu_devices: forced host devices per process (0: as the stages need).
  """

  method: str
  num_virtual_workers: int
  num_inflight: int
  vws: tuple[VWLayout, ...]
  memory_caps: tuple[tuple[int, ...], ...] | None
  stage_groups: tuple[tuple[tuple[int, ...], ...], ...]
  stage_ranks: bool
  stage_rank_grouping: str
  vertical_sync: bool
  remat: bool
  platform: str
  num_cpu_devices: int

  @property
  def sync(self) -> str:
    """``"wsp"`` (parameter-server methods) or ``"allreduce"`` (:attr:`hetpipe_jax.rules.methods.Method.sync`)."""
    return methods.get_method(self.method).sync


@dataclasses.dataclass(frozen=True)
class WSPSettings:
  """Wave synchronous parallel (HetPipe §5): D, the pull policy and the PS's application order."""

  staleness_bound: int
  pull_every_wave: bool
  ps_apply: str


@dataclasses.dataclass(frozen=True)
class PSSettings:
  """The parameter servers (HetPipe §8.1): shards (ranks ``0..S-1``), layer placement, staleness scaling.

  Attributes:
    num_shards: S (1 in virtual time and for the methods with one PS).
    placement: ``"default"`` or ``"local"``.
    shard_nodes: node of each shard.
    vw_stage_nodes: per VW, per stage, the node of its GPU (plan) or ``"host"``.
    staleness_scaling: ``"none"``, ``"inverse"`` or ``"exp"``; staleness_alpha: the ``exp`` rate.
    watchdog_s: the lead's progress watchdog (:mod:`hetpipe_jax.rules.watchdog`; seconds, 0: off; MPI only).
  """

  num_shards: int
  placement: str
  shard_nodes: tuple[str, ...]
  vw_stage_nodes: tuple[tuple[str, ...], ...]
  staleness_scaling: str
  staleness_alpha: float
  watchdog_s: float = 0.0

  def scaling_kwargs(self) -> dict[str, Any]:
    """The :class:`hetpipe_jax.ps.param_server.ParameterServer` keywords of the staleness scaling."""
    return {"staleness_scaling": self.staleness_scaling, "staleness_alpha": float(self.staleness_alpha)}

  def staleness_log(self, staleness: list) -> list | None:
    """The ``(tau, scale)`` per applied wave that ``ps_applied.jsonl`` records, or None when scaling is off."""
    return None if self.staleness_scaling == "none" else staleness


@dataclasses.dataclass(frozen=True)
class OptimSettings:
  """The optimizer every stage applies (``config.optimizer`` and the settings it uses), clipping, and the staleness
  remedies of the update rules: DC-ASGD (``delay_compensation``, ``dc_lambda``), weight prediction
  (``weight_prediction``) and PipeMare's delay-scaled steps (``delay_scaled_lr``, ``pipemare_warmup_minibatches``;
  :mod:`hetpipe_jax.rules.weight_prediction`)."""

  optimizer: str
  learning_rate: float
  lr_schedule: str
  warmup_minibatches: int
  momentum: float
  adam_b1: float
  adam_b2: float
  weight_decay: float
  muon_beta: float
  grad_clip_norm: float
  delay_compensation: str
  dc_lambda: float
  weight_prediction: str = "none"
  delay_scaled_lr: str = "none"
  pipemare_warmup_minibatches: int = 500
  muon_consistent_rms: float = 0.0


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
  """Training checkpoints: every ``every_waves`` global-clock ticks (0: only the final weights), keeping the newest
  ``max_to_keep``."""

  every_waves: int
  max_to_keep: int

  def due(self, end: int, total: int) -> bool:
    """Whether the segment ending at global clock ``end`` (of ``total``) ends in a checkpoint."""
    return self.every_waves > 0 and (end % self.every_waves == 0 or end == total)


@dataclasses.dataclass(frozen=True)
class EmulationSettings:
  """Emulated device times: synthetic per-stage milliseconds, the plan's cost-model times, or (virtual time) another
  plan's (``timing_plan``); :mod:`hetpipe_jax.jobs.emulation` turns them into task times. ``emulate_plan``: the
  config's (None: unset, so virtual time takes the plan's times when no other source is given)."""

  emulate_stage_ms: str
  emulate_plan: bool | None
  timing_plan: str


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """Run length, logging and evaluation.

  Attributes:
    num_epochs: passes over the training set (all VWs together); num_minibatches: > 0, per VW instead.
    log_every_waves: a metrics line every this many global-clock ticks.
    eval_every_epochs: test-set evaluation cadence (0: only at the end); eval_batch_size: its batch.
    progress: a progress bar; save_task_trace: tasks.jsonl, trace and Gantt.
    debug_nan_update: the fault drill's ``(vw, wave)`` or None.
  """

  num_epochs: float
  num_minibatches: int
  log_every_waves: int
  eval_every_epochs: float
  eval_batch_size: int
  progress: bool
  save_task_trace: bool
  debug_nan_update: tuple[int, int] | None


@dataclasses.dataclass(frozen=True)
class Job(_RankLayout):
  """A validated training job (:func:`hetpipe_jax.jobs.job_config.resolve_job`); what runs is what it holds.

  Attributes:
    model: registry name or ``module:factory``.
    batch_size: examples per minibatch per VW. seed: W0's and the data order's seed.
    data: the dataset section (:class:`hetpipe_jax.data.dataset.DataSettings`).
    pipeline, wsp, ps, optim, checkpoint, emulation, run: the sections.
    plan: the typed plan the job runs from, or None; plan_path: ``config.plan`` as given (``""``: none).
    sources: per resolved setting where its value comes from (``plan``, ``config``, ``default``, ...).
    notes: log lines about overrides.
    mode: ``"mpi"`` or ``"virtual"``; resume: continue from the newest checkpoint.
    flat: the config as given, flat (``config.json``'s fields before resolution).

  Also :class:`JobSettings`' layout fields, read through the sections (``_LAYOUT_FIELDS`` below): ``method``,
  ``num_virtual_workers``, ``num_inflight``, ``vws``, ``memory_caps``, ``stage_groups``, ``platform``,
  ``staleness_bound``, ``num_ps_shards``, ``ps_placement``, ``shard_nodes``, ``vw_stage_nodes``.
  """

  model: str
  batch_size: int
  seed: int
  data: DataSettings
  pipeline: PipelineSettings
  wsp: WSPSettings
  ps: PSSettings
  optim: OptimSettings
  checkpoint: CheckpointSettings
  emulation: EmulationSettings
  run: RunSettings
  plan: Any
  plan_path: str
  sources: Mapping[str, str]
  notes: tuple[str, ...]
  mode: str
  resume: bool
  flat: Mapping[str, Any]

  @property
  def minibatches_per_wave(self) -> int:
    """Nm (WSP methods), or 1 for the flush methods (a step is one minibatch of M micro-batches)."""
    return methods.minibatches_per_wave(methods.get_method(self.method), self.num_inflight)


# :class:`JobSettings`' layout fields, read on a Job through its sections (the MPI helpers, rank layouts and checks
# take either): ``job.method`` is ``job.pipeline.method``, ``job.num_ps_shards`` is ``job.ps.num_shards``, ...
_LAYOUT_FIELDS = {"pipeline": ("method", "num_virtual_workers", "num_inflight", "vws", "memory_caps", "stage_groups",
                               "platform"),
                  "wsp": ("staleness_bound",), "ps": ("num_shards", "placement", "shard_nodes", "vw_stage_nodes")}
_LAYOUT_NAMES = {("ps", "num_shards"): "num_ps_shards", ("ps", "placement"): "ps_placement"}
for _section, _names in _LAYOUT_FIELDS.items():
  for _name in _names:
    setattr(Job, _LAYOUT_NAMES.get((_section, _name), _name), property(operator.attrgetter(f"{_section}.{_name}")))
