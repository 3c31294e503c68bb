"""One set-up for every driver: :func:`set_up` turns a :class:`hetpipe_jax.jobs.job.Job` into a :class:`RunContext`
(the model, partitions, data, run length, parameter layout, start weights, task times, PS shards, resume point).

Runtime layer. Every check that needs the model, jax or the data runs here, in one order for every method and mode
(MPI: on every rank, before the ranks' first barrier), so bad input ends every rank with the same message.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from absl import logging
import flax
import jax
import numpy as np
import optax

from hetpipe_jax import models
from hetpipe_jax.data import dataset as dataset_lib
from hetpipe_jax.data import sharding
from hetpipe_jax.data.dataset import DataSettings
from hetpipe_jax.jobs import emulation
from hetpipe_jax.jobs import rank_setup
from hetpipe_jax.jobs import resume as resume_lib
from hetpipe_jax.jobs.evaluation import Evaluator
from hetpipe_jax.jobs.job import Job
from hetpipe_jax.jobs.job_config import (ConfigError, check_devices, check_partitions, check_world_size,
                                         ps_layer_shards, resolved_config)
from hetpipe_jax.jobs.outputs import RunOutputs, check_workdir, weights_sha256
from hetpipe_jax.jobs.training_setup import _muon_layer_shapes, build_stages, make_optimizer
from hetpipe_jax.mpi import wire
from hetpipe_jax.ps.shards import ShardLayout
from hetpipe_jax.rules import methods
from hetpipe_jax.runtime.objectives import get_objective
from hetpipe_jax.runtime.param_layout import ParamLayout


@dataclasses.dataclass
class RunContext:
  """What every driver runs from, set up once (:func:`set_up`).

  Attributes:
    job: the job.
    workdir: the run's output directory.
    spec: the model; partitions: per VW its stages' layer ranges.
    dataset: the training and evaluation data; num_minibatches: minibatches per VW (flush methods: steps).
    layout: the flat parameter layout; flat0: float32 ``[num_params]``, the weights the run starts from (W0, or the
      resume point's).
    task_times: per VW the emulated task times (virtual time: the simulated ones), or None.
    emulate_plan: virtual time: whether the times are the plan's (config.json's ``emulate_plan``).
    shards: the PS shards' layer layout (MPI, parameter-server methods), else None.
    point: the resume point, or None.
    restricted: this rank's GPU restriction from the launcher (MPI), or None.
    comm: the MPI communicator, or None (virtual time).
  """

  job: Job
  workdir: str
  spec: models.ModelSpec
  partitions: list
  dataset: Any
  num_minibatches: int
  layout: ParamLayout
  flat0: np.ndarray
  task_times: list | None
  emulate_plan: bool | None
  shards: ShardLayout | None
  point: Any
  restricted: Any
  comm: Any

  @property
  def start_minibatch(self) -> int:
    """Minibatches per VW done before this run (the resume point's), else 0."""
    return self.point.minibatch_start if self.point else 0

  @property
  def clock0(self) -> int:
    """The global clock this run starts at."""
    return self.point.step if self.point else 0

  @property
  def total_waves(self) -> int:
    """The global clock this run ends at."""
    return self.clock0 + (self.num_minibatches - self.start_minibatch) // self.job.num_inflight

  def minibatches_at(self, clock: int) -> int:
    """Minibatches each VW has trained when the global clock reaches ``clock`` (a resumed run's earlier part
    included): where a checkpoint segment starting at ``clock`` reads its data from (WSP methods: a wave is Nm)."""
    return self.start_minibatch + (clock - self.clock0) * self.job.num_inflight

  def segments(self) -> list[tuple[int, int]]:
    """``(first, end)`` global clocks of each checkpoint segment (:func:`hetpipe_jax.jobs.resume.segments`)."""
    return resume_lib.segments(self.clock0, self.total_waves, self.job.checkpoint.every_waves)

  def config_json(self, **fields: Any) -> dict:
    """``config.json``: :func:`hetpipe_jax.jobs.job_config.resolved_config` with ``fields``, the objective and the
    data, and the replay fields."""
    return resolved_config(self.job, self.partitions, **fields, **data_config_fields(self.spec, self.dataset),
                           **replay_fields(self.flat0, self.job.seed, self.point.step if self.point else None))

  def optimizer(self) -> Any:
    """A VW's optimizer (:func:`hetpipe_jax.jobs.training_setup.make_optimizer`) over the run's length."""
    return make_optimizer(self.job.optim, self.num_minibatches, self.spec)

  def stages(self, vw_id: int, devices: list, optimizer: Any, remat: bool = False) -> list:
    """VW ``vw_id``'s stages on ``devices`` (:func:`hetpipe_jax.jobs.training_setup.build_stages`)."""
    return build_stages(self.job.optim, self.spec, self.partitions[vw_id], devices, optimizer, remat=remat)

  def minibatches(self, vw_id: int) -> sharding.ShardedMinibatches:
    """VW ``vw_id``'s shard of the training data in its seeded order."""
    return sharding.ShardedMinibatches(self.dataset, self.job.num_virtual_workers, vw_id, self.job.batch_size,
                                       self.job.seed)

  def evaluator(self, device: Any) -> Evaluator:
    """The test-set evaluator on ``device``."""
    return Evaluator(self.spec, self.layout, self.dataset.eval_inputs, self.dataset.eval_targets,
                     self.job.run.eval_batch_size, device)

  def open_outputs(self) -> RunOutputs:
    """The run's :class:`hetpipe_jax.jobs.outputs.RunOutputs`; a resumed run's ``metrics.jsonl`` first cut back to
    the checkpoint's lines (later lines belong to the lost part of the run)."""
    if self.point is not None:
      resume_lib.rewrite_lines(pathlib.Path(self.workdir) / "metrics.jsonl", self.point.meta["metrics"])
    return RunOutputs(self.workdir)

  def start_outputs(self, config_json: dict, name: str) -> RunOutputs:
    """:meth:`open_outputs` with ``config.json`` written (``config_json``: :meth:`config_json`'s) and the job's notes
    logged, each line prefixed with ``name`` (``"[PS]"``); the lead of every driver starts so."""
    outputs = self.open_outputs()
    outputs.write_config(config_json)
    for note in self.job.notes:
      logging.info("%s %s", name, note)
    return outputs

  def resumed_logs(self) -> tuple[list[dict], list[tuple[int, int]], list[tuple], list[dict]]:
    """``(records, applied, staleness, resumes)`` the run continues: the resume point's minibatch records, the PS's
    ``(wave, vw)`` applications, ``(tau, scale)`` per applied wave and the earlier resumes plus this one (all empty
    for a fresh run)."""
    meta = self.point.meta if self.point else {}
    records: list[dict] = list(meta.get("records", []))
    applied: list[tuple[int, int]] = [tuple(a) for a in meta.get("applied", [])]
    staleness: list = [tuple(a) for a in meta.get("applied_staleness", [])]
    resumes = list(meta.get("resumes", []))
    if self.point is not None:
      resumes.append({"global_clock": self.clock0, "minibatches_per_vw": self.start_minibatch,
                      "time_s": meta["time_s"],
                      "checkpoint": str(pathlib.Path(self.workdir) / "checkpoints" / str(self.clock0)),
                      "notes": self.point.notes})
    return records, applied, staleness, resumes

  def save_checkpoint(self, store: Any, end: int, flat: np.ndarray, opt_states: dict, log: Any, *,
                      applied: list, records: list, time_s: float, config_json: dict, resumes: list,
                      version_ids: list, extra: dict) -> dict[str, float]:
    """The lead's training checkpoint at global clock ``end`` (a segment's barrier: the PS holds every VW's waves
    below it), the same for every transport; returns its save statistics.

    Args:
      store: the run's :class:`hetpipe_jax.jobs.checkpoint.TrainingCheckpoints`.
      end: the global clock; flat: the global weights there, float32 ``[num_params]``.
      opt_states: per VW its stages' optimizer state by layer (``VirtualWorker.opt_state_by_layer``).
      log: the run's :class:`hetpipe_jax.runtime.clock_log.ClockLog` (its loss window and evaluations go along).
      applied, records, resumes: the run's ``(wave, vw)`` applications, minibatch records and resumes so far.
      time_s: the run's time at ``end`` (wall or simulated seconds).
      config_json: ``config.json``; version_ids: per VW its newest weight version's id; extra: the transport's own
        fields (``mode`` and what its resume reads).
    """
    meta = resume_lib.checkpoint_meta(
        step=end, settings=self.job, partitions=self.partitions, model_name=self.spec.name,
        num_layers=self.spec.num_layers, opt_parts_per_layer=len(opt_states[0][1][0]) if opt_states[0][1] else 0,
        minibatches_done=self.minibatches_at(end), applied=applied,
        records=records, metrics=resume_lib.read_lines(pathlib.Path(self.workdir) / "metrics.jsonl"), time_s=time_s,
        config_json=config_json, resumes=resumes, version_ids=version_ids, **log.state(), extra=extra)
    return resume_lib.save_training_checkpoint(store, end, self.layout.unflatten(flat), opt_states, meta)

  @property
  def eval_every(self) -> int:
    """Global-clock ticks between evaluations (0: only at the end)."""
    return eval_every_waves(self.job, self.dataset.num_train)


def set_up(job: Job, workdir: str, comm: Any = None) -> RunContext:
  """Every driver's set-up (MPI: on every rank; virtual time: ``comm`` None), checks in this order: ``--resume`` for
  a method without checkpoints, this rank's GPUs, the world size, model, partitions and devices (:func:`prepare`),
  the task times, the data, the run length, the workdir and its checkpoints, the parameter layout, the PS shards,
  the resume point and what is left to train; then (MPI) every rank's barrier and W0 from rank 0.

  Raises:
    ConfigError: any of these checks (the same message on every rank).
    hetpipe_jax.data.fashion_mnist.DataError: missing or corrupt dataset files.
  """
  wsp = job.pipeline.sync == "wsp"
  if job.resume and not wsp:
    raise ConfigError(f"--resume is not supported for config.method={job.method!r}" +
                      (" (all-reduce methods keep only the final weights)" if comm is not None else ""))
  restricted = None
  if comm is not None:
    restricted = rank_setup.rank_devices_of(job.platform, comm)
    if restricted is not None and job.platform == "gpu":  # on CPU the table is only recorded
      rank_setup.check_rank_devices(job, restricted.table)
  # a rank restricted to its GPUs sees only those: its stages' devices are checked in rank_setup.stage_devices
  spec, partitions = prepare(job, comm.Get_size() if comm is not None else job.world_size,
                             check_local_devices=comm is not None and (
                                 restricted is None or restricted.applied != "CUDA_VISIBLE_DEVICES"))
  if comm is None:
    times, emulate_plan = emulation.virtual_task_times(job)
  else:
    times, emulate_plan = emulation.emulated_task_times(job), None  # bad emulation settings fail on every rank
  dataset = load_data(job.data, spec)
  num_mb = minibatches_per_vw(job, dataset.num_train)
  check_workdir(workdir)
  if wsp:
    resume_lib.check_resume_workdir(workdir, job.resume)
  if comm is None:
    params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(job.seed)))
    layout = ParamLayout.from_layer_params(params0)
  else:
    layout = ParamLayout.from_layer_params(
        jax.eval_shape(lambda: models.init_layer_params(spec, jax.random.key(job.seed))))
  shards = None
  if comm is not None and wsp:
    offsets = layout.layer_offsets
    shards = ShardLayout.build(offsets, ps_layer_shards(job, partitions,
                                                        [b > a for a, b in zip(offsets, offsets[1:])]),
                               job.num_ps_shards)
    if comm.Get_rank() == 0:  # under local placement (default placement refuses an empty shard in ps_layer_shards)
      for i in (i for i in range(shards.num_shards) if shards.size(i) == 0):
        logging.warning("[PS] shard %d (node %s) holds no parameters: no stage on its node has any (local "
                        "placement)", i, job.shard_nodes[i])
  # Every rank reads the checkpoint itself (the same files), so a bad one stops every rank before any work.
  point = (resume_lib.load_resume_point(workdir, job, partitions, layout, spec.num_layers, spec.name)
           if job.resume else None)
  start_mb = point.minibatch_start if point else 0
  if wsp and (num_mb - start_mb) // job.num_inflight < 1:
    raise ConfigError(f"--resume: the checkpoint has {start_mb} of the run's {num_mb} minibatches per VW done; "
                      "nothing is left to train (raise config.num_epochs or config.num_minibatches)")
  if point is not None:
    flat0 = point.flat_weights
  elif comm is None:
    flat0 = layout.flatten(params0)
  if comm is not None:
    wire.idle_collective(comm.Ibarrier())  # every rank passed validation (a failing rank aborts the job first)
    if point is None:
      if comm.Get_rank() == 0:
        flat0 = layout.flatten(jax.device_get(models.init_layer_params(spec, jax.random.key(job.seed))))
      else:
        flat0 = np.empty(layout.num_params, np.float32)
      wire.idle_collective(comm.Ibcast(flat0, root=0))  # every VW starts from rank 0's W0, bit for bit
  return RunContext(job, str(workdir), spec, partitions, dataset, num_mb, layout, flat0, times,
                    emulate_plan, shards, point, restricted, comm)


def minibatches_per_wave(settings: Job) -> int:
  """Minibatches per wave: Nm (WSP methods), or 1 for the flush methods (a step is one minibatch of M
  micro-batches)."""
  return methods.minibatches_per_wave(methods.get_method(settings.method), settings.num_inflight)


def minibatches_per_vw(settings: Job, num_train: int) -> int:
  """Minibatches each VW trains, rounded down to whole waves of Nm (flush methods: steps, one minibatch each).

  Raises:
    ConfigError: fewer than one wave, or a warm-up (``warmup_cosine``) as long as the run or longer.
  """
  run = settings.run
  if run.num_minibatches > 0:
    total = run.num_minibatches
  else:
    shard = num_train // settings.num_virtual_workers
    total = int(run.num_epochs * (shard // settings.batch_size))
  unit = minibatches_per_wave(settings)
  total -= total % unit
  if total < unit or total < 1:
    raise ConfigError(f"the job trains fewer than one wave ({unit} minibatches) per VW: raise "
                      "config.num_epochs or config.num_minibatches")
  warmup = settings.optim.warmup_minibatches
  if settings.optim.lr_schedule == "warmup_cosine" and warmup >= total:
    raise ConfigError(f"config.warmup_minibatches={warmup} is not shorter than the run's {total} minibatches per VW: "
                      "lower it, or train longer")
  return total


def eval_every_waves(settings: Job, num_train: int) -> int:
  """Global-clock ticks between test-set evaluations (``config.eval_every_epochs``; 0 = only at the end)."""
  every = settings.run.eval_every_epochs
  if every <= 0:
    return 0
  waves_per_epoch = (num_train // settings.num_virtual_workers // settings.batch_size) / minibatches_per_wave(settings)
  return max(1, int(round(every * waves_per_epoch)))


def prepare(settings: Job, world_size: int,
            check_local_devices: bool = True) -> tuple[models.ModelSpec, list]:
  """Checks everything that needs the model or jax (model, partitions, devices); returns the model and per-VW
  partitions.

  Raises:
    ConfigError: wrong world size, unknown model (a registry name, or a ``module:factory`` that does not import or
      does not return a ModelSpec), a partition that does not cover the model, too few devices, ``muon`` for a
      model without 2-D hidden weights.
  """
  check_world_size(settings, world_size, settings.flat)
  try:
    spec = models.load_model(settings.model)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  partitions = check_partitions(settings, spec.num_layers)
  if settings.optim.optimizer == "muon":
    _muon_layer_shapes(spec)
  if check_local_devices:
    check_devices(settings, len(jax.local_devices()))
  return spec, partitions


def load_data(data: DataSettings, spec: models.ModelSpec) -> Any:
  """The dataset ``data.dataset`` names, checked against the model (:func:`hetpipe_jax.data.dataset.load_dataset`).

  Raises:
    ConfigError: ``config.dataset`` cannot be loaded or does not fit ``config.model`` (shape, dtype, targets).
    fashion_mnist.DataError: missing or corrupt dataset files.
  """
  try:
    return dataset_lib.load_dataset(data, tuple(spec.input_shape), spec.input_dtype, spec.num_classes)
  except dataset_lib.DatasetConfigError as e:
    raise ConfigError(str(e)) from None


def data_config_fields(spec: models.ModelSpec, dataset: Any) -> dict:
  """What config.json adds about the model's objective and the data (both jobs record it)."""
  objective = get_objective(spec.objective)
  return {"objective": objective.name, "loss_unit": objective.loss_unit,
          "dataset_info": dataset_lib.dataset_description(dataset)}


INITIAL_WEIGHTS_RULE = (
    "models.init_layer_params(model, jax.random.key(seed)): layer i's params are spec.layers[i].init("
    "jax.random.fold_in(jax.random.key(seed), i), x_i)['params'] (Flax Linen; {} for a layer without parameters), "
    "x_0 = zeros([1, *input_shape], input_dtype), x_(i+1) = spec.layers[i].apply({'params': params_i}, x_i); "
    "hashed as the float32 little-endian bytes of every layer's leaves in jax.tree order (sorted keys), layers in "
    "order (the PS's flat layout)")
EXAMPLE_IDS_RULE = (
    "minibatches.jsonl example_ids: per minibatch (flush methods: micro-batch) the rows of the training split of "
    "config.dataset (dataset_info) it trained on, in the order fed; its inputs and targets are train_inputs[ids], "
    "train_targets[ids] (Fashion-MNIST: the IDX train files' images / 255 as float32 [n, 28, 28, 1], labels int32)")


def replay_fields(flat0: np.ndarray, seed: int, resumed_at_clock: int | None = None) -> dict:
  """What config.json records so that a run can be replayed from its outputs alone: the initial weights'
  SHA-256 (:func:`hetpipe_jax.jobs.outputs.weights_sha256` of W0 in layer order) and the rule that makes them, and
  how ``minibatches.jsonl``'s ``example_ids`` name the data; every method and mode records the same fields.

  Args:
    flat0: the weights the run starts from, float32 ``[num_params]`` in layer order.
    seed: ``config.seed``.
    resumed_at_clock: a resumed run's checkpoint (its weights are the start, not W0's rule).
  """
  rule = (INITIAL_WEIGHTS_RULE if resumed_at_clock is None else
          f"the global weights of checkpoints/{resumed_at_clock} (resumed at global clock {resumed_at_clock})")
  return {"replay": {"initial_weights_sha256": weights_sha256(flat0), "initial_weights_num_params": int(flat0.size),
                     "initial_weights_rule": rule, "seed": int(seed), "example_ids_rule": EXAMPLE_IDS_RULE,
                     "jax_version": jax.__version__, "flax_version": flax.__version__,
                     "optax_version": optax.__version__}}
