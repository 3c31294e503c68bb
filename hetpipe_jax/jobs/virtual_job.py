"""``hetpipe_jax.train --mode=virtual``: one process trains every VW of a (possibly large) cluster in simulated time.

Runtime layer. Same settings, validation and outputs as the MPI job (:mod:`hetpipe_jax.jobs.mpi_job`), with times in
simulated seconds (labelled ``simulated_*``) from the cost model's task durations (``config.emulate_stage_ms``, or
``config.plan`` with the GPU types of its cluster), driven by :mod:`hetpipe_jax.runtime.virtual_time`.
"""

from __future__ import annotations

import time
from typing import Any

from absl import logging
import jax
import numpy as np

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.jobs.evaluation import Evaluator
from hetpipe_jax.jobs.job_config import ConfigError, JobSettings, emulated_task_times, resolved_config
from hetpipe_jax.jobs.mpi_job import eval_every_waves, make_optimizer, minibatches_per_vw, prepare
from hetpipe_jax.jobs.outputs import RunOutputs, settings_summary
from hetpipe_jax.ps.param_server import ParameterServer
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime import virtual_time
from hetpipe_jax.runtime.param_layout import ParamLayout
from hetpipe_jax.runtime.virtual_worker import VirtualWorker


def run(config: Any, settings: JobSettings, workdir: str) -> dict:
  """Trains in virtual time; writes the run's outputs (:mod:`hetpipe_jax.jobs.outputs`).

  Args:
    config: the job's ConfigDict.
    settings: :func:`hetpipe_jax.jobs.job_config.resolve_settings` of ``config`` (the plan read once).
    workdir: the run's output directory.

  Raises:
    ConfigError: invalid settings, or no task times (set ``config.emulate_stage_ms`` or use a plan).
  """
  spec, partitions = prepare(config, settings, world_size=settings.world_size, check_local_devices=False)
  # Virtual time needs task durations: synthetic ones, or else the plan's GPU types through the cost model (which
  # config.json then records as emulate_plan=True).
  use_plan = not config.emulate_stage_ms.strip()
  if use_plan and settings.plan is None:
    raise ConfigError("--mode=virtual needs task durations: set config.emulate_stage_ms or config.plan")
  times = emulated_task_times(config, settings, plan_times=use_plan or config.emulate_plan)
  dataset = fashion_mnist.load_fashion_mnist(config.data_dir or None,
                                        expected_counts=(60000, 10000) if config.check_counts else None)
  num_mb = minibatches_per_vw(config, settings, dataset.num_train)
  outputs = RunOutputs(workdir)
  outputs.write_config(resolved_config(config, settings, partitions, emulate_plan=use_plan or config.emulate_plan))
  for note in settings.notes:
    logging.info("[virtual] %s", note)

  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(config.seed)))
  layout = ParamLayout.from_layer_params(params0)
  server = ParameterServer(layout.flatten(params0), settings.num_virtual_workers, config.ps_apply)
  devices = jax.local_devices()
  outbox: dict = {}
  vws, next_device = [], 0
  for v, partition in enumerate(partitions):
    stage_devices = [devices[(next_device + s) % len(devices)] for s in range(len(partition))]
    next_device += len(partition)
    optimizer = make_optimizer(config, num_mb)
    stages = stages_lib.build_stages(spec, partition, stage_devices, optimizer)
    source = sharding.ShardedMinibatches(dataset, settings.num_virtual_workers, v, config.batch_size, config.seed)
    vws.append(VirtualWorker(v, stages, layout, layout.unflatten(server.weights), optimizer, settings.num_inflight,
                             settings.staleness_bound, virtual_time.RecordingPSClient(v, outbox), source.get,
                             num_virtual_workers=settings.num_virtual_workers,
                             pull_every_wave=config.pull_every_wave))

  evaluator = Evaluator(spec, layout, dataset.test_images, dataset.test_labels, config.eval_batch_size, devices[0])
  num_waves = num_mb // settings.num_inflight
  eval_every = eval_every_waves(config, settings, dataset.num_train)
  bar = None
  if config.progress:
    from tqdm import tqdm
    bar = tqdm(total=num_waves, desc="[virtual] global clock", unit="wave", mininterval=1.0, dynamic_ncols=True)
  state: dict[str, Any] = {"loss": float("nan"), "losses": [], "evals": []}
  host_t0 = time.perf_counter()

  def on_clock(clock: int, t: float, losses: list) -> None:
    state["losses"] += [s / max(n, 1) for _, s, n in losses]
    evaluated = eval_every > 0 and clock % eval_every == 0
    if clock % max(1, config.log_every_waves) and not evaluated:
      return
    if state["losses"]:
      state["loss"] = float(np.mean(state["losses"]))
      state["losses"] = []
    line = {"minibatches": clock * settings.num_inflight * settings.num_virtual_workers, "wave": clock - 1,
            "global_clock": clock, "loss": state["loss"], "simulated_time_s": t,
            "minibatches_per_simulated_s": clock * settings.num_inflight * settings.num_virtual_workers / t,
            "host_wall_time_s": time.perf_counter() - host_t0}
    if evaluated:
      line.update(evaluator.evaluate(server.weights))
      state["evals"].append({"global_clock": clock, "simulated_time_s": t, **{k: line[k] for k in
                                                                             ("test_accuracy", "test_loss")}})
    outputs.log_metrics(line)
    if bar is not None:
      bar.update(clock - bar.n)
      bar.set_postfix({"loss": f"{state['loss']:.3f}", "sim_s": f"{t:.1f}"}, refresh=False)

  logging.info("[virtual] %d VWs x %d minibatches (Nm=%d, D=%d) of %s in simulated time", len(vws), num_mb,
               settings.num_inflight, settings.staleness_bound, spec.name)
  report, host_s = virtual_time.run(vws, server, outbox, times, num_waves, settings.staleness_bound,
                                    config.pull_every_wave, on_clock)
  if bar is not None:
    bar.update(num_waves - bar.n)
    bar.close()
  final = evaluator.evaluate(server.weights)
  total = num_mb * len(vws)
  outputs.log_metrics({"minibatches": total, "global_clock": server.global_clock, "loss": state["loss"],
                       "simulated_time_s": report.makespan_s, **final})
  extra = outputs.write_minibatches(r.__dict__ for vw in vws for r in vw.records)
  applied = outputs.write_ps_applied(server.state.applied, settings.num_virtual_workers)
  if config.save_task_trace:
    from hetpipe_jax.sim import gantt
    from hetpipe_jax.sim import trace
    trace.write_trace(trace.report_trace(report), str(outputs.dir / "trace.json"))
    gantt.plot_report(report, str(outputs.dir / "gantt.png"))
  ckpt = outputs.save_checkpoint(layout.unflatten(server.weights))
  summary = {
      "mode": "virtual",
      "time_unit": "simulated seconds",
      "test_accuracy": final["test_accuracy"],
      "test_loss": final["test_loss"],
      "final_train_loss": state["loss"],
      "num_minibatches": total,
      "num_minibatches_per_vw": num_mb,
      "simulated_time_s": report.makespan_s,
      "wall_time_s": report.makespan_s,
      "minibatches_per_s": total / report.makespan_s,
      "images_per_s": total * config.batch_size / report.makespan_s,
      "steady_minibatches_per_s": report.total_minibatches_per_s,
      "host_wall_time_s": host_s,
      **settings_summary(settings, partitions, config),
      "global_clock": server.global_clock,
      **applied,
      **extra,
      "evaluations": state["evals"],
      "wait_s": {str(v.vw_id): v.wait_s for v in report.vws},
      "idle_s": {str(v.vw_id): v.idle_s for v in report.vws},
      "max_clock_distance": report.max_clock_distance,
      "checkpoint": str(ckpt),
  }
  outputs.finish(summary)
  logging.info("[virtual] done: test accuracy %.4f, %d minibatches in %.1f simulated s (%.1f host s)",
               final["test_accuracy"], total, report.makespan_s, host_s)
  return summary
