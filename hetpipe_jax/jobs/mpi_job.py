"""One HetPipe training job over MPI: ranks 0..S-1 run the parameter-server shards (S = config.num_ps_shards, rank 0
the lead: outputs, evaluation, checkpoints), ranks S..S+N-1 run one VW each (with ``config.stage_ranks``: each VW's
driver and first stage group; the VWs' further stage groups run on ranks S+N.., :mod:`hetpipe_jax.mpi.stage_server`).

Runtime layer; :mod:`hetpipe_jax.train` is its thin absl entry point. Everything that can be checked is checked on
every rank before training starts (settings, world size, model, partition, devices, data), so bad input ends every
rank with the same clear message and no rank waits on another.
"""

from __future__ import annotations

import json
import math
import pathlib
import time
from typing import Any

from absl import logging
import flax
import jax
import numpy as np
import optax

from hetpipe_jax import models
from hetpipe_jax.data import dataset as dataset_lib
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.jobs import rank_setup
from hetpipe_jax.jobs import resume as resume_lib
from hetpipe_jax.jobs.checkpoint import TrainingCheckpoints
from hetpipe_jax.jobs.evaluation import Evaluator
from hetpipe_jax.jobs.job_config import (ConfigError, JobSettings, check_devices, check_partitions, check_world_size,
                                         emulated_task_times, ps_layer_shards, ps_scaling, ps_staleness_log,
                                         resolved_config, with_ps_shards, with_stage_ranks)
from hetpipe_jax.jobs.outputs import RunOutputs, check_workdir, settings_summary, weights_sha256
from hetpipe_jax.mpi import ps_shards
from hetpipe_jax.mpi.ps_client import MPIPSClient, StageRankPSClient
from hetpipe_jax.mpi.ps_server import ParameterServerService
from hetpipe_jax.mpi.rank_layout import stage_rank_layout
from hetpipe_jax.mpi.stage_client import RemoteStages
from hetpipe_jax.mpi.stage_server import StageRankServer
from hetpipe_jax.ps.param_server import ParameterServer
from hetpipe_jax.ps.shards import ShardLayout
from hetpipe_jax.rules import methods
from hetpipe_jax.rules import weight_prediction
from hetpipe_jax.runtime import opt_state
from hetpipe_jax.runtime import optimizers
from hetpipe_jax.runtime import placement as placement_lib
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime import update_rules
from hetpipe_jax.runtime import virtual_worker as vw_lib
from hetpipe_jax.runtime.objectives import get_objective
from hetpipe_jax.runtime.param_layout import ParamLayout
from hetpipe_jax.sim import trace


def make_optimizer(config: Any, num_minibatches: int, spec: models.ModelSpec | None = None) -> Any:
  """The optax optimizer each VW applies to its own minibatches, one state per stage (``config.optimizer``).

  ``config.lr_schedule``: constant, cosine, or warmup_cosine (linear from 0 over ``config.warmup_minibatches``, then
  cosine to 0 at ``num_minibatches``). ``sgd``; ``momentum`` (``config.momentum``); ``adam``, ``nadam`` (Dozat 2016,
  Nesterov momentum) and ``nadamw`` (NAdam with decoupled weight decay ``config.weight_decay``, multiplied by the
  learning rate as optax does) with ``config.adam_b1`` / ``adam_b2``; ``muon`` (``optax.contrib.muon``: Nesterov
  momentum ``config.muon_beta`` orthogonalized by 5 Newton–Schulz steps on the 2-D hidden weights that
  :func:`hetpipe_jax.runtime.optimizers.muon_dimension_numbers` picks, optax's adamw with Nesterov momentum, i.e.
  NAdamW, with ``adam_b1`` / ``adam_b2`` on every other parameter, ``config.weight_decay`` on both).
  ``config.grad_clip_norm`` is not part of it: the stages clip each minibatch's gradient by its global norm over
  every stage before this optimizer (:func:`build_stages`, :mod:`hetpipe_jax.runtime.grad_clip`), which a per-stage
  optax chain could not.

  Args:
    config: the job's ConfigDict.
    num_minibatches: the schedule's length (minibatches per VW, or steps).
    spec: the model (``muon`` needs it: its rule is per layer of the whole model).

  Returns:
    An ``optax.GradientTransformation`` every stage applies, or (``muon``) an
    :class:`hetpipe_jax.runtime.optimizers.PerStage` (:func:`hetpipe_jax.runtime.optimizers.for_layers` gives a
    stage's).

  Raises:
    ConfigError: ``muon`` without a model, or for a model with no 2-D hidden weights.
  """
  lr = learning_rate(config, num_minibatches)
  b1, b2 = config.get("adam_b1", 0.9), config.get("adam_b2", 0.999)
  decay = config.get("weight_decay", 0.0)
  if config.optimizer == "muon":
    dims = optimizers.muon_dimension_numbers(_muon_layer_shapes(config, spec))
    return optimizers.PerStage(lambda start, end: optax.contrib.muon(
        lr, beta=config.get("muon_beta", 0.95), weight_decay=decay, adam_b1=b1, adam_b2=b2,
        adam_weight_decay=decay, muon_weight_dimension_numbers=dims[start:end]))
  if config.optimizer == "adam":
    tx = optax.adam(lr, b1=b1, b2=b2)
  elif config.optimizer == "nadam":
    tx = optax.nadam(lr, b1=b1, b2=b2)
  elif config.optimizer == "nadamw":
    tx = optax.nadamw(lr, b1=b1, b2=b2, weight_decay=decay)
  elif config.optimizer == "momentum":
    tx = optax.sgd(lr, momentum=config.momentum)
  else:
    tx = optax.sgd(lr)
  return tx


def learning_rate(config: Any, num_minibatches: int) -> Any:
  """``config.learning_rate`` under ``config.lr_schedule`` (:func:`make_optimizer`'s): a float, or an optax schedule
  ``step count -> rate`` over ``num_minibatches`` steps."""
  lr = config.learning_rate
  if config.lr_schedule == "cosine":
    lr = optax.cosine_decay_schedule(config.learning_rate, num_minibatches)
  if config.lr_schedule == "warmup_cosine":
    lr = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_minibatches, num_minibatches)
  return lr


def optimizer_step(config: Any, num_minibatches: int) -> Any:
  """What weight prediction reads of :func:`make_optimizer`'s optimizer (its rate or schedule and the settings it
  uses; :class:`hetpipe_jax.rules.weight_prediction.OptimizerStep`), for ``config.weight_prediction`` other than
  ``"none"``; None otherwise."""
  if config.get("weight_prediction", "none") == "none":
    return None
  return weight_prediction.OptimizerStep(
      config.optimizer, learning_rate(config, num_minibatches), b1=config.get("adam_b1", 0.9),
      b2=config.get("adam_b2", 0.999), weight_decay=config.get("weight_decay", 0.0) if config.optimizer == "nadamw"
      else 0.0, momentum=config.get("momentum", 0.9) if config.optimizer == "momentum" else 0.0)


def build_stages(config: Any, spec: models.ModelSpec, partition, devices, optimizer: optax.GradientTransformation,
                 remat: bool = False) -> list:
  """A VW's stages (:func:`hetpipe_jax.runtime.stages.build_stages`) with the job's ``config.grad_clip_norm`` (> 0:
  every update clips by the minibatch's global norm over all stages; 0: off), for every method and mode."""
  return stages_lib.build_stages(spec, partition, devices, optimizer, remat=remat,
                                 grad_clip_norm=float(config.get("grad_clip_norm", 0.0)))


def _muon_layer_shapes(config: Any, spec: models.ModelSpec | None) -> list:
  """The model's per-layer param shapes for Muon's rule (abstract evaluation, nothing runs).

  Raises:
    ConfigError: no model, or a model where the rule gives Muon no parameter.
  """
  if spec is None:
    raise ConfigError("config.optimizer='muon' decides its parameters per layer of the model: pass the model")
  shapes = jax.eval_shape(lambda: models.init_layer_params(spec, jax.random.key(config.seed)))
  if not optimizers.muon_leaf_names(shapes):
    raise ConfigError(f"config.optimizer='muon': model {spec.name!r} has no 2-D hidden weights (a Dense 'kernel' "
                      "outside its output layer) for Muon to orthogonalize; use 'nadamw' or 'adam'")
  return shapes


def minibatches_per_wave(settings: JobSettings) -> int:
  """Minibatches per wave: Nm (WSP methods), or 1 for the flush methods (a step is one minibatch of M
  micro-batches)."""
  return methods.minibatches_per_wave(methods.get_method(settings.method), settings.num_inflight)


def minibatches_per_vw(config: Any, settings: JobSettings, num_train: int) -> int:
  """Minibatches each VW trains, rounded down to whole waves of Nm (flush methods: steps, one minibatch each).

  Raises:
    ConfigError: fewer than one wave, or a warm-up (``warmup_cosine``) as long as the run or longer.
  """
  if config.num_minibatches > 0:
    total = config.num_minibatches
  else:
    shard = num_train // settings.num_virtual_workers
    total = int(config.num_epochs * (shard // config.batch_size))
  unit = minibatches_per_wave(settings)
  total -= total % unit
  if total < unit or total < 1:
    raise ConfigError(f"the job trains fewer than one wave ({unit} minibatches) per VW: raise "
                      "config.num_epochs or config.num_minibatches")
  warmup = config.get("warmup_minibatches", 0)
  if config.lr_schedule == "warmup_cosine" and warmup >= total:
    raise ConfigError(f"config.warmup_minibatches={warmup} is not shorter than the run's {total} minibatches per VW: "
                      "lower it, or train longer")
  return total


def eval_every_waves(config: Any, settings: JobSettings, num_train: int) -> int:
  """Global-clock ticks between test-set evaluations (``config.eval_every_epochs``; 0 = only at the end)."""
  if config.eval_every_epochs <= 0:
    return 0
  waves_per_epoch = (num_train // settings.num_virtual_workers // config.batch_size) / minibatches_per_wave(settings)
  return max(1, int(round(config.eval_every_epochs * waves_per_epoch)))


def prepare(config: Any, settings: JobSettings, world_size: int,
            check_local_devices: bool = True) -> tuple[models.ModelSpec, list]:
  """Checks everything that needs the model or jax (model, partitions, devices); returns the model and per-VW
  partitions.

  Raises:
    ConfigError: wrong world size, unknown model (a registry name, or a ``module:factory`` that does not import or
      does not return a ModelSpec), a partition that does not cover the model, too few devices, ``muon`` for a
      model without 2-D hidden weights.
  """
  check_world_size(settings, world_size, config)
  try:
    spec = models.load_model(settings.model)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  partitions = check_partitions(settings, spec.num_layers)
  if config.optimizer == "muon":
    _muon_layer_shapes(config, spec)
  if check_local_devices:
    check_devices(settings, len(jax.local_devices()))
  return spec, partitions


def load_data(config: Any, spec: models.ModelSpec) -> Any:
  """The dataset ``config.dataset`` names, checked against the model (:func:`hetpipe_jax.data.dataset.load_dataset`).

  Raises:
    ConfigError: ``config.dataset`` cannot be loaded or does not fit ``config.model`` (shape, dtype, targets).
    fashion_mnist.DataError: missing or corrupt dataset files.
  """
  try:
    return dataset_lib.load_dataset(config, tuple(spec.input_shape), spec.input_dtype, spec.num_classes)
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


def run(config: Any, settings: JobSettings, workdir: str, comm, resume: bool = False) -> dict | None:
  """Runs the job on this rank; returns the summary on rank 0, None on VW ranks.

  With ``config.checkpoint_every_waves = K > 0`` the run is cut into segments at the global clocks K, 2K, ...; each
  segment's end is a checkpoint barrier (:mod:`hetpipe_jax.jobs.resume`).

  Args:
    config: the job's ConfigDict.
    settings: :func:`hetpipe_jax.jobs.job_config.resolve_settings` of ``config`` (the plan read once).
    workdir: the run's output directory.
    comm: the MPI communicator (rank 0 = PS, rank r = VW r-1).
    resume: continue from the newest readable checkpoint in ``workdir`` (any plan of the same model).

  Raises:
    ConfigError: invalid settings (raised identically on every rank before any work), ``resume`` without
      checkpoints (or checkpoints without it), a checkpoint of another model, nothing left to train.
    fashion_mnist.DataError: missing or corrupt dataset files.
  """
  if not settings.num_ps_ranks:
    raise ConfigError(f"config.method={settings.method!r} has no PS: its job is hetpipe_jax.jobs.allreduce_job")
  settings = with_ps_shards(config, settings)  # sharded PS: ranks 0..S-1 (bad settings fail here, on every rank)
  settings = with_stage_ranks(config, settings, resume)  # stage ranks: ranks S+N.. (after the VWs' drivers)
  rank, world = comm.Get_rank(), comm.Get_size()
  restricted = rank_setup.rank_devices_of(config, comm)
  if restricted is not None and config.platform == "gpu":  # on CPU the table is only recorded
    rank_setup.check_rank_devices(settings, restricted.table)
  # a rank restricted to its GPUs sees only those: its stages' devices are checked in rank_setup.stage_devices
  spec, partitions = prepare(config, settings, world,
                             check_local_devices=restricted is None or restricted.applied != "CUDA_VISIBLE_DEVICES")
  emulated = emulated_task_times(config, settings)  # bad emulation settings fail here, on every rank
  dataset = load_data(config, spec)
  num_mb = minibatches_per_vw(config, settings, dataset.num_train)
  check_workdir(workdir)
  resume_lib.check_resume_workdir(workdir, resume)
  layout = ParamLayout.from_layer_params(
      jax.eval_shape(lambda: models.init_layer_params(spec, jax.random.key(config.seed))))
  offsets = layout.layer_offsets
  shards = ShardLayout.build(offsets, ps_layer_shards(settings, partitions,
                                                      [b > a for a, b in zip(offsets, offsets[1:])]),
                             settings.num_ps_shards)
  if rank == 0:  # under local placement (default placement refuses an empty shard in ps_layer_shards)
    for i in (i for i in range(shards.num_shards) if shards.size(i) == 0):
      logging.warning("[PS] shard %d (node %s) holds no parameters: no stage on its node has any (local placement)",
                      i, settings.shard_nodes[i])
  # Every rank reads the checkpoint itself (the same files), so a bad one stops every rank before any work.
  point = (resume_lib.load_resume_point(workdir, settings, partitions, layout, spec.num_layers, spec.name)
           if resume else None)
  start_mb = point.minibatch_start if point else 0
  if (num_mb - start_mb) // settings.num_inflight < 1:
    raise ConfigError(f"--resume: the checkpoint has {start_mb} of the run's {num_mb} minibatches per VW done; "
                      "nothing is left to train (raise config.num_epochs or config.num_minibatches)")
  comm.Barrier()  # every rank passed validation (a failing rank aborts the job before this)

  if point is not None:
    flat0 = point.flat_weights
  elif rank == 0:
    flat0 = layout.flatten(jax.device_get(models.init_layer_params(spec, jax.random.key(config.seed))))
  else:
    flat0 = np.empty(layout.num_params, np.float32)
  if point is None:
    comm.Bcast(flat0, root=0)  # every VW starts from rank 0's W0, bit for bit
  num_shards = settings.num_ps_shards
  if rank == 0:
    return _run_ps(config, settings, spec, layout, flat0, dataset, num_mb, partitions, workdir, comm, point, shards,
                   restricted)
  if rank < num_shards:
    ps_shards.run_shard(settings, config.ps_apply, flat0, shards, rank, comm, partitions, offsets)
    return None
  if rank >= num_shards + settings.num_virtual_workers:  # a stage rank
    vw_id = next(v for r, v, _ in stage_rank_layout(num_shards, settings.stage_groups) if r == rank)
    _run_stage_rank(config, settings, spec, layout, flat0, dataset, num_mb, partitions, vw_id, comm, shards,
                    restricted)
    return None
  vw_id = rank - num_shards
  _run_vw(config, settings, spec, layout, flat0, dataset, num_mb, partitions[vw_id], vw_id, comm,
          emulated[vw_id] if emulated else None, point, shards, partitions, restricted)
  return None


def _wsp_settings(settings, vw_id: int, pull_every_wave: bool = True):
  """VW ``vw_id``'s :class:`~hetpipe_jax.runtime.virtual_worker.WSPSettings` (its index, N, Nm, D and pulls)."""
  return vw_lib.WSPSettings(vw_id, settings.num_virtual_workers, settings.num_inflight, settings.staleness_bound,
                     pull_every_wave)


def update_settings(config, settings, optimizer, vw_id: int, num_minibatches: int = 0, **options):
  """VW ``vw_id``'s :class:`~hetpipe_jax.runtime.update_rules.UpdateSettings`: the method, the optimizer and the
  update-rule options the job sets (``vertical_sync``, ``delay_compensation`` and ``dc_lambda``,
  ``weight_prediction`` with the optimizer's hyperparameters (its schedule over ``num_minibatches``),
  ``delay_scaled_lr`` and ``pipemare_warmup_minibatches``; the plan's memory caps as ``max_held``), plus ``options``
  (the flush methods' ``reducer`` and ``on_step``)."""
  return update_rules.UpdateSettings(optimizer, settings.method, vertical_sync=bool(config.get("vertical_sync", False)),
                        delay_compensation=config.get("delay_compensation", "none"),
                        dc_lambda=float(config.get("dc_lambda", update_rules.UpdateSettings.dc_lambda)),
                        weight_prediction=config.get("weight_prediction", "none"),
                        optimizer_step=optimizer_step(config, num_minibatches),
                        delay_scaled_lr=config.get("delay_scaled_lr", "none"),
                        pipemare_warmup_minibatches=config.get("pipemare_warmup_minibatches",
                                                               update_rules.UpdateSettings.pipemare_warmup_minibatches),
                        max_held=settings.memory_caps[vw_id] if settings.memory_caps else None, **options)


def _run_stage_rank(config, settings, spec, layout, flat0, dataset, num_mb, partitions, vw_id, comm,
                    shards, restricted) -> None:
  """A stage rank: runs its stages of VW ``vw_id`` as the VW's driver commands
  (:class:`hetpipe_jax.mpi.stage_server.StageRankServer`), pushes and pulls its stages' parts of every shard
  (:class:`hetpipe_jax.mpi.ps_client.StageRankPSClient`), then joins the job's final collective."""
  partition = partitions[vw_id]
  link = rank_setup.stage_link(config, settings, spec, partition, vw_id, num_mb, comm)
  devices = rank_setup.stage_devices(settings, vw_id, link, restricted)
  optimizer = make_optimizer(config, num_mb, spec)
  stages = build_stages(config, spec, partition, devices, optimizer)
  vw = vw_lib.VirtualWorker(stages, layout, layout.unflatten(flat0), _wsp_settings(settings, vw_id),
                            vw_lib.UpdateSettings(optimizer, settings.method), placement=placement_lib.LinkedStages(link))
  source = sharding.ShardedMinibatches(dataset, settings.num_virtual_workers, vw_id, config.batch_size, config.seed)
  ps = StageRankPSClient(comm, ps_shards.vw_parts(settings, shards, partitions, layout.layer_offsets)[vw_id],
                         StageRankServer.local_index_of(vw), settings.num_virtual_workers)
  server = StageRankServer(comm, vw, settings.num_ps_shards + vw_id, source.get(0)[1], ps, shards.index)
  logging.info("[VW %d] stage rank %d: stages %s on %s", vw_id, comm.Get_rank(), vw.local_stages,
               [str(devices[s]) for s in vw.local_stages])
  server.serve()
  ps_shards.ps_byte_matrix(comm)


def _segments(config, settings, num_mb: int, point) -> tuple[int, int, list[tuple[int, int]]]:
  """``(first clock, total waves, segments)`` of this run (after the resume point, if any)."""
  start_mb = point.minibatch_start if point else 0
  clock0 = point.step if point else 0
  total = clock0 + (num_mb - start_mb) // settings.num_inflight
  return clock0, total, resume_lib.segments(clock0, total, config.checkpoint_every_waves)


def _checkpoint_due(config, end: int, total: int) -> bool:
  return config.checkpoint_every_waves > 0 and (end % config.checkpoint_every_waves == 0 or end == total)


def _opt_state_bytes(scalars: list, per_layer: list) -> np.ndarray:
  """A VW's optimizer state by layer as one uint8 buffer (its leaves' bytes in tree order; nothing pickled)."""
  leaves = jax.tree.leaves((scalars, per_layer))
  return np.concatenate([np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8) for x in leaves] or
                        [np.zeros(0, np.uint8)])


def _opt_state_from_bytes(buffer: np.ndarray, template: tuple[list, list]) -> tuple[list, list]:
  """Inverse of :func:`_opt_state_bytes` given a state of the same structure (shapes and dtypes).

  Raises:
    ValueError: the buffer's size does not match the template's.
  """
  leaves, treedef = jax.tree.flatten(template)
  out, pos = [], 0
  for leaf in leaves:
    leaf = np.asarray(leaf)
    n = leaf.size * leaf.dtype.itemsize
    out.append(buffer[pos:pos + n].view(leaf.dtype).reshape(leaf.shape).copy())
    pos += n
  if pos != buffer.size:
    raise ValueError(f"optimizer state of {buffer.size} bytes, expected {pos}")
  return jax.tree.unflatten(treedef, out)


_STAT_SUMS = ("wait_s", "idle_s", "wall_time_s", "num_pulls", "num_pushes", "num_tasks", "num_overruns", "overrun_s",
              "host_busy_s", "update_s", "sync_s", "inject_s", "dispatch_s")


def _run_vw(config, settings, spec, layout, flat0, dataset, num_mb, partition, vw_id, comm, task_times,
            point, shards, partitions, restricted) -> None:

  link = remote = None
  placement = placement_lib.ALL_LOCAL
  if settings.stage_groups:  # stage ranks: this rank runs the VW's first stage group and drives the others
    link = rank_setup.stage_link(config, settings, spec, partition, vw_id, num_mb, comm)
    remote = RemoteStages(comm, vw_id, link)
    placement = placement_lib.LinkedStages(link, remote)
  devices = rank_setup.stage_devices(settings, vw_id, link, restricted)
  optimizer = make_optimizer(config, num_mb, spec)
  stages = build_stages(config, spec, partition, devices, optimizer)
  source = sharding.ShardedMinibatches(dataset, settings.num_virtual_workers, vw_id, config.batch_size, config.seed)
  sharded = shards if settings.num_ps_shards > 1 else None
  parts = ps_shards.vw_parts(settings, shards, partitions, layout.layer_offsets)
  client = MPIPSClient(comm, vw_id, layout.num_params, settings.num_virtual_workers, shards=sharded,
                       first_vw_rank=settings.num_ps_shards, parts=parts[vw_id] if parts else None)
  nm = settings.num_inflight
  clock0, total, segs = _segments(config, settings, num_mb, point)
  start_mb = point.minibatch_start if point else 0
  off = resume_lib.Offsets(clock0, start_mb, 0.0)
  vw = vw_lib.VirtualWorker(
      stages, layout, layout.unflatten(flat0), _wsp_settings(settings, vw_id, config.pull_every_wave),
      update_settings(config, settings, optimizer, vw_id, num_mb),
      vw_lib.VWHooks(lambda p: source.get_with_ids(off.minibatch + p), client, sharded,
                     corrupt_update=resume_lib.nan_injector(config, vw_id, off)),
      placement, vw_lib.HostSettings(task_time_s=task_times.task_duration_s if task_times else None))
  first_start = None
  if point is not None:
    vw.load_opt_state(*point.opt_states[vw_id])
    vw.set_version_id(point.meta["version_ids"][vw_id % len(point.meta["version_ids"])])
    first_start = point.meta.get("start_unix_s", {}).get(str(vw_id % int(point.meta["num_virtual_workers"])))
  logging.info("[VW %d] %d stages %s on %s, %d minibatches", vw_id, len(stages), partition,
               [str(d) for d in devices], num_mb)
  totals: dict[str, Any] = dict.fromkeys(_STAT_SUMS, 0)
  totals["barrier_s"] = 0.0  # at checkpoint barriers: sending the state, waiting for the others and the save
  peaks: list[int] = [0] * len(stages)
  max_concurrent = 0
  sent = 0  # records already sent to the PS
  for i, (first, end) in enumerate(segs):
    off.clock, off.minibatch = first, start_mb + (first - clock0) * nm
    mark = len(vw.records)
    before = dict(vw.stats.__dict__)
    stats = vw.run((end - first) * nm)
    if first_start is None:
      first_start = stats.start_unix_s
    off.time_s = stats.start_unix_s - first_start
    for rec in vw.records[mark:]:
      resume_lib.shift_record(rec, off)
    for k in _STAT_SUMS:
      totals[k] += (stats.__dict__[k] - before[k]) if k != "wall_time_s" else stats.wall_time_s
    peaks = [max(a, b) for a, b in zip(peaks, stats.peak_inflight_per_stage)]
    max_concurrent = max(max_concurrent, stats.max_concurrent_tasks)
    report = {"records": [r.__dict__ for r in vw.records[sent:]], "version_id": vw.version.version_id,
              "start_unix_s": first_start}
    sent = len(vw.records)
    if i + 1 < len(segs):  # a checkpoint barrier: the PS holds every VW's waves of the run so far
      t_barrier = time.perf_counter()
      opt = _opt_state_bytes(*vw.opt_state_by_layer()) if _checkpoint_due(config, end, total) else None
      _, flat = client.barrier(end - first, report, opt)
      vw.begin_segment(flat)
      totals["barrier_s"] += time.perf_counter() - t_barrier
  stats = {**dict(vw.stats.__dict__), **totals, "peak_inflight_per_stage": peaks,
           "max_concurrent_tasks": max_concurrent, "start_unix_s": first_start}
  if _checkpoint_due(config, total, total):  # the final checkpoint's optimizer state, before DONE
    client.send_opt_state(num_mb // nm, _opt_state_bytes(*vw.opt_state_by_layer()))
  trace_counts = {s.stage_id: dict(s.trace_counts) for s in stages}
  if remote is not None:  # the stage ranks' own counts replace the placeholders' (never traced here)
    stage_reports = remote.stop(client.num_pulls_requested)
    for rep in stage_reports.values():
      trace_counts.update({int(s): c for s, c in rep["trace_counts"].items()})
    report["stage_ranks"] = {"ranks": list(link.stage_ranks),
                             "version_waits": sum(r["version_waits"] for r in stage_reports.values()),
                             "version_wait_s": sum(r["version_wait_s"] for r in stage_reports.values()),
                             "remote_tasks": sum(r["tasks"] for r in stage_reports.values())}
  report.update({
      "stats": stats,
      "partition": [list(r) for r in partition],
      "stage_devices": [d.id for d in devices],
      "trace_counts": trace_counts,
      "tasks": vw.task_log if config.save_task_trace else [],
  })
  client.finish(num_mb // nm, report)
  ps_shards.ps_byte_matrix(comm)
  logging.info("[VW %d] done: %.1f s, wait %.2f s, idle %.2f s", vw_id, totals["wall_time_s"], totals["wait_s"],
               totals["idle_s"])


def _run_ps(config, settings, spec, layout, flat0, dataset, num_mb, partitions, workdir, comm, point,
            shards, restricted) -> dict:

  n, nm = settings.num_virtual_workers, settings.num_inflight
  meta = point.meta if point else {}
  if point is not None:  # metrics.jsonl as it was at the checkpoint (later lines belong to the lost part)
    resume_lib.rewrite_lines(pathlib.Path(workdir) / "metrics.jsonl", meta["metrics"])
  outputs = RunOutputs(workdir)
  config_json = resolved_config(config, settings, partitions, num_ps_shards=settings.num_ps_shards,
                                ps_placement=settings.ps_placement, **rank_setup.stage_rank_fields(settings),
                                **rank_setup.rank_device_fields(restricted),
                                **data_config_fields(spec, dataset),
                                **replay_fields(flat0, config.seed, point.step if point else None))
  outputs.write_config(config_json)
  for note in settings.notes:
    logging.info("[PS] %s", note)
  evaluator = Evaluator(spec, layout, dataset.eval_inputs, dataset.eval_targets, config.eval_batch_size,
                        jax.local_devices()[0])
  eval_every = eval_every_waves(config, settings, dataset.num_train)
  server = ParameterServer(shards.gather(flat0, 0), n, config.ps_apply, **ps_scaling(config))  # shard 0's slice (all of it when S = 1)
  clock0, total, segs = _segments(config, settings, num_mb, point)
  start_mb = point.minibatch_start if point else 0
  parts = ps_shards.vw_parts(settings, shards, partitions, layout.layer_offsets)
  service = ParameterServerService(comm, server, num_minibatches_per_vw=num_mb, num_inflight=nm,
                                   evaluate=evaluator.evaluate, eval_every_waves=eval_every,
                                   log_every_waves=config.log_every_waves, log_metrics=outputs.log_metrics,
                                   progress=config.progress, first_vw_rank=settings.num_ps_shards,
                                   parts=parts, shard=0, watchdog_s=config.ps_watchdog_s)
  service.minibatches_done = [start_mb] * n
  service.evals = list(meta.get("evals", []))
  service.last_loss = meta.get("last_loss", float("nan"))
  service.recent_losses = list(meta.get("pending_losses", []))
  service.time_offset_s = float(meta.get("time_s", 0.0))
  if service._bar is not None:  # pylint: disable=protected-access
    service._bar.update(start_mb * n)  # pylint: disable=protected-access
  logging.info("[PS] %d VWs x %d minibatches (Nm=%d, D=%d, ps_apply=%s), model %s with %d parameters%s", n, num_mb, nm,
               settings.staleness_bound, config.ps_apply, spec.name, layout.num_params,
               f", resumed at global clock {clock0}" if point else "")
  records: list[dict] = list(meta.get("records", []))
  applied: list[tuple[int, int]] = [tuple(a) for a in meta.get("applied", [])]
  staleness: list = [tuple(a) for a in meta.get("applied_staleness", [])]  # (tau, scale) per applied wave
  resumes = list(meta.get("resumes", []))
  if point is not None:
    resumes.append({"global_clock": clock0, "minibatches_per_vw": start_mb, "time_s": meta["time_s"],
                    "checkpoint": str(pathlib.Path(workdir) / "checkpoints" / str(clock0)), "notes": point.notes})
  start_unix = dict(meta.get("start_unix_s", {}))
  version_ids = list(meta.get("version_ids", [0] * n))
  params0 = layout.unflatten(flat0)
  templates = []  # per VW, the structure of its optimizer state by layer (to read the bytes it sends)
  for part in partitions:
    tx = make_optimizer(config, num_mb, spec)
    scalars, per_layer = None, []
    for start, end in part:
      stage_tx = optimizers.for_layers(tx, start, end)
      sc, layers = opt_state.split_by_layer(stage_tx.init(list(params0[start:end])), params0[start:end])
      scalars = sc if scalars is None else scalars
      per_layer.extend(layers)
    templates.append((scalars, per_layer))
  store = TrainingCheckpoints(workdir, config.checkpoint_max_to_keep) if config.checkpoint_every_waves > 0 else None
  ckpt_stats: list[dict] = []
  t0 = time.perf_counter()

  def take_reports(reps: dict) -> None:
    for vw, rep in sorted(reps.items()):
      records.extend(rep["records"])
      version_ids[vw] = rep["version_id"]
      start_unix.setdefault(str(vw), rep["start_unix_s"])

  def save(end: int, opt_buffers: dict) -> None:
    opt_states = {v: _opt_state_from_bytes(np.asarray(buf, np.uint8), templates[v]) for v, buf in opt_buffers.items()}
    ckpt_meta = resume_lib.checkpoint_meta(
        step=end, settings=settings, partitions=partitions, model_name=spec.name, num_layers=spec.num_layers,
        opt_parts_per_layer=len(templates[0][1][0]) if templates[0][1] else 0,
        minibatches_done=start_mb + (end - clock0) * nm, applied=applied, records=records,
        metrics=resume_lib.read_lines(outputs.dir / "metrics.jsonl"), evals=service.evals,
        time_s=service.time_offset_s + time.perf_counter() - service.t0, config_json=config_json, resumes=resumes,
        version_ids=version_ids, last_loss=service.last_loss, pending_losses=service.recent_losses,
        extra={"mode": "mpi", "start_unix_s": start_unix, "applied_staleness": staleness})
    ckpt_stats.append(resume_lib.save_training_checkpoint(store, end, layout.unflatten(server.weights), opt_states,
                                                          ckpt_meta))

  try:
    for i, (first, end) in enumerate(segs):
      if i:
        server.state = server.state.fresh()
      service.clock_offset = first
      service.expect_opt_state = _checkpoint_due(config, end, total)
      service.run()
      applied += [(first + w, v) for w, v in server.state.applied]
      staleness += server.state.staleness
      take_reports(service.segment_reports if i + 1 < len(segs) else service.reports)
      if i + 1 < len(segs):
        if service.expect_opt_state:
          save(end, service.segment_opt)
        service.release_barrier()
    if store is not None and service.expect_opt_state:
      save(total, service.segment_opt)
  finally:
    if store is not None:
      store.close()
    service.close()
  wall = time.perf_counter() - t0
  final_flat, shard_logs = ps_shards.gather_shards(comm, shards, flat0, server.weights, applied)
  byte_matrix = ps_shards.ps_byte_matrix(comm)
  final = evaluator.evaluate(final_flat)
  service.last_eval = final
  service.log_metrics(total, evaluated=True)
  extra = outputs.write_minibatches(records)
  applied_fields = outputs.write_ps_applied(applied, n, shard_logs, ps_staleness_log(config, staleness))
  if config.save_task_trace:
    _write_runtime_trace(service.reports, nm, outputs.dir)
  ckpt = outputs.save_checkpoint(layout.unflatten(final_flat))
  total_mb = n * num_mb
  trained_mb = n * (num_mb - start_mb)
  per_vw = {str(vw): {k: rep["stats"][k] for k in ("wait_s", "idle_s", "wall_time_s", "num_pulls", "num_pushes",
                                                   "peak_inflight_per_stage", "max_concurrent_tasks", "num_tasks",
                                                   "num_overruns", "overrun_s", "host_busy_s", "update_s",
                                                   "start_unix_s", "barrier_s", "ps_channel", "ps_channel_s")}
            | {"stage_devices": rep["stage_devices"]}
            for vw, rep in sorted(service.reports.items())}
  summary = {
      "mode": "mpi",
      "time_unit": "wall-clock seconds",
      "test_accuracy": final["test_accuracy"],
      "test_loss": final["test_loss"],
      **final,
      "objective": config_json["objective"],
      "loss_unit": config_json["loss_unit"],
      "final_train_loss": service.last_loss,
      "num_minibatches": total_mb,
      "num_minibatches_per_vw": num_mb,
      "wall_time_s": wall,
      "minibatches_per_s": trained_mb / wall,
      "images_per_s": trained_mb * config.batch_size / wall,
      **settings_summary(settings, partitions, config, spec),
      "global_clock": total,
      **applied_fields,
      "num_ps_shards": settings.num_ps_shards,
      "ps_placement": settings.ps_placement,
      "ps_shards": {"layer_shards": list(shards.layer_shards), "shard_nodes": list(settings.shard_nodes),
                    "floats_per_shard": [shards.size(s) for s in range(shards.num_shards)],
                    "first_vw_rank": settings.num_ps_shards},
      "ps_bytes": ps_shards.ps_bytes_summary(byte_matrix, settings, partitions, layout.layer_offsets, shards,
                                               total - clock0, parts),
      **rank_setup.stage_rank_fields(settings),
      **({"stage_rank_stats": {str(vw): rep["stage_ranks"] for vw, rep in sorted(service.reports.items())}}
         if settings.stage_groups else {}),
      **extra,
      "trace_counts": {str(vw): rep["trace_counts"] for vw, rep in sorted(service.reports.items())},
      "evaluations": service.evals,
      "per_vw": per_vw,
      "wait_s": {vw: v["wait_s"] for vw, v in per_vw.items()},
      "idle_s": {vw: v["idle_s"] for vw, v in per_vw.items()},
      "checkpoint": str(ckpt),
      **resume_lib.checkpoint_summary(config, ckpt_stats, resumes),
      # The slowest VW's seconds in checkpoint barriers (send its state, wait for the others and the save) over the
      # run's wall time: what checkpoints cost beyond the pipeline drain at each barrier.
      "checkpoint_barrier_fraction": max(v["barrier_s"] for v in per_vw.values()) / wall,
  }
  if not math.isfinite(summary["test_loss"]):
    logging.warning("[PS] final test loss is not finite")
  outputs.finish(summary)
  logging.info("[PS] done: test accuracy %.4f, %d minibatches in %.1f s (%.1f minibatches/s)",
               final["test_accuracy"], trained_mb, wall, trained_mb / wall)
  return summary


def _write_runtime_trace(reports: dict, num_inflight: int, out: pathlib.Path) -> None:
  """tasks.jsonl, a Chrome trace (Perfetto) and a Figure-1-style Gantt PNG of every VW's measured tasks."""
  from hetpipe_jax.sim import gantt  # matplotlib only when drawing
  events = []
  with open(out / "tasks.jsonl", "w", encoding="utf-8") as f:
    for vw in sorted(reports):
      for task, start_s, end_s in reports[vw]["tasks"]:
        f.write(json.dumps({"vw_id": vw, "task": task, "start_s": start_s, "end_s": end_s}) + "\n")
      events += trace.runtime_events(reports[vw]["tasks"], vw, num_inflight)
  trace.write_trace(trace.chrome_trace(events), str(out / "trace.json"))
  # About a second from the middle of the run (the first waves include JIT compilation).
  starts = sorted(e.start_s for e in events)
  start = starts[len(starts) // 2]
  end = min(max(e.end_s for e in events), start + 1.0)
  gantt.plot_gantt(events, str(out / "gantt.png"), num_inflight=num_inflight, time_window_s=(start, end),
                   title="runtime (wall time, middle of the run)")
