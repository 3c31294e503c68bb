"""One HetPipe training job over MPI: rank 0 runs the parameter server, ranks 1..N run one VW each.

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
import jax
import numpy as np
import optax

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.jobs.job_config import (ConfigError, JobSettings, check_devices, check_partitions, check_world_size,
                                         emulated_task_times, resolved_config)
from hetpipe_jax.jobs.outputs import RunOutputs, check_workdir, settings_summary
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime.param_layout import ParamLayout


def make_optimizer(config: Any, num_minibatches: int) -> optax.GradientTransformation:
  """The optax optimizer each VW applies to its own minibatches (``config.lr_schedule``: constant or cosine)."""
  lr = config.learning_rate
  if config.lr_schedule == "cosine":
    lr = optax.cosine_decay_schedule(config.learning_rate, num_minibatches)
  if config.optimizer == "adam":
    return optax.adam(lr)
  if config.optimizer == "momentum":
    return optax.sgd(lr, momentum=config.momentum)
  return optax.sgd(lr)


def minibatches_per_vw(config: Any, settings: JobSettings, num_train: int) -> int:
  """Minibatches each VW trains, rounded down to whole waves of Nm.

  Raises:
    ConfigError: fewer than one wave.
  """
  if config.num_minibatches > 0:
    total = config.num_minibatches
  else:
    shard = num_train // settings.num_virtual_workers
    total = int(config.num_epochs * (shard // config.batch_size))
  total -= total % settings.num_inflight
  if total < settings.num_inflight:
    raise ConfigError(f"the job trains fewer than one wave ({settings.num_inflight} minibatches) per VW: raise "
                      "config.num_epochs or config.num_minibatches")
  return total


def eval_every_waves(config: Any, settings: JobSettings, num_train: int) -> int:
  """Global-clock ticks between test-set evaluations (``config.eval_every_epochs``; 0 = only at the end)."""
  if config.eval_every_epochs <= 0:
    return 0
  waves_per_epoch = (num_train // settings.num_virtual_workers // config.batch_size) / settings.num_inflight
  return max(1, int(round(config.eval_every_epochs * waves_per_epoch)))


def prepare(config: Any, settings: JobSettings, world_size: int,
            check_local_devices: bool = True) -> tuple[models.ModelSpec, list]:
  """Checks everything that needs the model or jax (model, partitions, devices); returns the model and per-VW
  partitions.

  Raises:
    ConfigError: wrong world size, unknown model, a partition that does not cover the model, too few devices.
  """
  del config
  check_world_size(settings, world_size)
  try:
    spec = models.get_model(settings.model)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  partitions = check_partitions(settings, spec.num_layers)
  if check_local_devices:
    check_devices(settings, len(jax.local_devices()))
  return spec, partitions


def run(config: Any, settings: JobSettings, workdir: str, comm) -> dict | None:
  """Runs the job on this rank; returns the summary on rank 0, None on VW ranks.

  Args:
    config: the job's ConfigDict.
    settings: :func:`hetpipe_jax.jobs.job_config.resolve_settings` of ``config`` (the plan read once).
    workdir: the run's output directory.
    comm: the MPI communicator (rank 0 = PS, rank r = VW r-1).

  Raises:
    ConfigError: invalid settings (raised identically on every rank before any work).
    fashion_mnist.DataError: missing or corrupt dataset files.
  """
  rank, world = comm.Get_rank(), comm.Get_size()
  spec, partitions = prepare(config, settings, world)
  emulated = emulated_task_times(config, settings)  # bad emulation settings fail here, on every rank
  dataset = fashion_mnist.load_fashion_mnist(config.data_dir or None,
                                       expected_counts=(60000, 10000) if config.check_counts else None)
  num_mb = minibatches_per_vw(config, settings, dataset.num_train)
  check_workdir(workdir)
  comm.Barrier()  # every rank passed validation (a failing rank aborts the job before this)

  layout = ParamLayout.from_layer_params(
      jax.eval_shape(lambda: models.init_layer_params(spec, jax.random.key(config.seed))))
  if rank == 0:
    flat0 = layout.flatten(jax.device_get(models.init_layer_params(spec, jax.random.key(config.seed))))
  else:
    flat0 = np.empty(layout.num_params, np.float32)
  comm.Bcast(flat0, root=0)  # every VW starts from rank 0's W0, bit for bit
  if rank == 0:
    return _run_ps(config, settings, spec, layout, flat0, dataset, num_mb, partitions, workdir, comm)
  _run_vw(config, settings, spec, layout, flat0, dataset, num_mb, partitions[rank - 1], rank - 1, comm,
          emulated[rank - 1] if emulated else None)
  return None


def _run_vw(config, settings, spec, layout, flat0, dataset, num_mb, partition, vw_id, comm, task_times) -> None:
  from hetpipe_jax.runtime.virtual_worker import VirtualWorker
  from hetpipe_jax.ps.transport import MPIPSClient

  devices = [jax.local_devices()[d] for d in settings.vws[vw_id].devices]
  optimizer = make_optimizer(config, num_mb)
  stages = stages_lib.build_stages(spec, partition, devices, optimizer)
  source = sharding.ShardedMinibatches(dataset, settings.num_virtual_workers, vw_id, config.batch_size, config.seed)
  client = MPIPSClient(comm, vw_id, layout.num_params, settings.num_virtual_workers)
  vw = VirtualWorker(vw_id, stages, layout, layout.unflatten(flat0), optimizer, settings.num_inflight,
                     settings.staleness_bound, client, source.get,
                     num_virtual_workers=settings.num_virtual_workers, pull_every_wave=config.pull_every_wave,
                     task_time_s=task_times.task_duration_s if task_times else None)
  logging.info("[VW %d] %d stages %s on %s, %d minibatches", vw_id, len(stages), partition,
               [str(d) for d in devices], num_mb)
  stats = vw.run(num_mb)
  report = {
      "records": [r.__dict__ for r in vw.records],
      "stats": stats.__dict__,
      "partition": [list(r) for r in partition],
      "stage_devices": [d.id for d in devices],
      "trace_counts": {s.stage_id: dict(s.trace_counts) for s in stages},
      "tasks": vw.task_log if config.save_task_trace else [],
  }
  client.finish(num_mb // settings.num_inflight, report)
  logging.info("[VW %d] done: %.1f s, wait %.2f s, idle %.2f s", vw_id, stats.wall_time_s, stats.wait_s,
               stats.idle_s)


def _run_ps(config, settings, spec, layout, flat0, dataset, num_mb, partitions, workdir, comm) -> dict:
  from hetpipe_jax.jobs.evaluation import Evaluator
  from hetpipe_jax.ps.param_server import ParameterServer
  from hetpipe_jax.ps.service import ParameterServerService

  outputs = RunOutputs(workdir)
  outputs.write_config(resolved_config(config, settings, partitions))
  for note in settings.notes:
    logging.info("[PS] %s", note)
  evaluator = Evaluator(spec, layout, dataset.test_images, dataset.test_labels, config.eval_batch_size,
                        jax.local_devices()[0])
  eval_every = eval_every_waves(config, settings, dataset.num_train)
  server = ParameterServer(flat0, settings.num_virtual_workers, config.ps_apply)
  service = ParameterServerService(comm, server, num_minibatches_per_vw=num_mb, num_inflight=settings.num_inflight,
                                   evaluate=evaluator.evaluate, eval_every_waves=eval_every,
                                   log_every_waves=config.log_every_waves, log_metrics=outputs.log_metrics,
                                   progress=config.progress)
  logging.info("[PS] %d VWs x %d minibatches (Nm=%d, D=%d, ps_apply=%s), model %s with %d parameters",
               settings.num_virtual_workers, num_mb, settings.num_inflight, settings.staleness_bound, config.ps_apply,
               spec.name, layout.num_params)
  t0 = time.perf_counter()
  service.run()
  wall = time.perf_counter() - t0
  final = evaluator.evaluate(server.weights)
  service.last_eval = final
  service.log_metrics(server.global_clock, evaluated=True)
  extra = outputs.write_minibatches(r for rep in service.reports.values() for r in rep["records"])
  applied = outputs.write_ps_applied(server.state.applied, settings.num_virtual_workers)
  if config.save_task_trace:
    _write_runtime_trace(service.reports, settings.num_inflight, outputs.dir)
  ckpt = outputs.save_checkpoint(layout.unflatten(server.weights))
  total = settings.num_virtual_workers * num_mb
  per_vw = {str(vw): {k: rep["stats"][k] for k in ("wait_s", "idle_s", "wall_time_s", "num_pulls", "num_pushes",
                                                   "peak_inflight_per_stage", "max_concurrent_tasks", "num_tasks",
                                                   "num_overruns", "overrun_s", "host_busy_s",
                                                   "start_unix_s")}
            | {"stage_devices": rep["stage_devices"]}
            for vw, rep in sorted(service.reports.items())}
  summary = {
      "mode": "mpi",
      "time_unit": "wall-clock seconds",
      "test_accuracy": final["test_accuracy"],
      "test_loss": final["test_loss"],
      "final_train_loss": service.last_loss,
      "num_minibatches": total,
      "num_minibatches_per_vw": num_mb,
      "wall_time_s": wall,
      "minibatches_per_s": total / wall,
      "images_per_s": total * config.batch_size / wall,
      **settings_summary(settings, partitions, config),
      "global_clock": server.global_clock,
      **applied,
      **extra,
      "trace_counts": {str(vw): rep["trace_counts"] for vw, rep in sorted(service.reports.items())},
      "evaluations": service.evals,
      "per_vw": per_vw,
      "wait_s": {vw: v["wait_s"] for vw, v in per_vw.items()},
      "idle_s": {vw: v["idle_s"] for vw, v in per_vw.items()},
      "checkpoint": str(ckpt),
  }
  if not math.isfinite(summary["test_loss"]):
    logging.warning("[PS] final test loss is not finite")
  outputs.finish(summary)
  logging.info("[PS] done: test accuracy %.4f, %d minibatches in %.1f s (%.1f minibatches/s)",
               final["test_accuracy"], total, wall, total / wall)
  return summary


def _write_runtime_trace(reports: dict, num_inflight: int, out: pathlib.Path) -> None:
  """tasks.jsonl, a Chrome trace (Perfetto) and a Figure-1-style Gantt PNG of every VW's measured tasks."""
  from hetpipe_jax.sim import gantt
  from hetpipe_jax.sim import trace
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
