"""``hetpipe_jax.train --mode=virtual``: one process trains every VW of a (possibly large) cluster in simulated time.

Runtime layer. Same settings, validation and outputs as the MPI job (:mod:`hetpipe_jax.jobs.mpi_job`), with times in
simulated seconds (labelled ``simulated_*``) from the cost model's task durations (``config.emulate_stage_ms``, or
``config.plan`` with the GPU types of its cluster), driven by :mod:`hetpipe_jax.runtime.virtual_time`.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from hetpipe_jax import models
from hetpipe_jax.data import sharding
from hetpipe_jax.jobs import resume as resume_lib
from hetpipe_jax.jobs.checkpoint import TrainingCheckpoints
from hetpipe_jax.jobs.evaluation import Evaluator
from hetpipe_jax.jobs.job_config import (ConfigError, JobSettings, emulated_task_times, ps_scaling, ps_staleness_log,
                                         resolved_config)
from hetpipe_jax.jobs.mpi_job import (build_stages, data_config_fields, eval_every_waves, load_data, make_optimizer,
                                      minibatches_per_vw, prepare, replay_fields, update_settings)
from hetpipe_jax.jobs.outputs import (RunOutputs, allreduce_results, check_replicas_identical, check_workdir,
                                      settings_summary, weights_sha256)
from hetpipe_jax.ps.param_server import ParameterServer
from hetpipe_jax.rules import methods
from hetpipe_jax.runtime import virtual_time
from hetpipe_jax.runtime import virtual_worker as vw_lib
from hetpipe_jax.runtime.param_layout import ParamLayout
from hetpipe_jax.sim import engine as engine_lib
from hetpipe_jax.sim import engine_report
from hetpipe_jax.sim import trace


def _virtual_task_times(config, settings):
  """``(task times, emulate_plan)``: the durations virtual time runs on — synthetic ones (``emulate_stage_ms``), a
  ``timing_plan``'s, or else the plan's GPU types through the cost model — and whether they are the plan's (what
  config.json records as ``emulate_plan``).

  Raises:
    ConfigError: none of the three is given.
  """
  use_plan = not config.emulate_stage_ms.strip() and not config.get("timing_plan", "")
  if use_plan and settings.plan is None:
    raise ConfigError("--mode=virtual needs task durations: set config.emulate_stage_ms, config.plan or "
                      "config.timing_plan")
  emulate_plan = bool(use_plan or config.emulate_plan)
  return emulated_task_times(config, settings, plan_times=emulate_plan, virtual=True), emulate_plan


def run(config: Any, settings: JobSettings, workdir: str, resume: bool = False) -> dict:
  """Trains in virtual time; writes the run's outputs (:mod:`hetpipe_jax.jobs.outputs`) and, every
  ``config.checkpoint_every_waves`` global-clock ticks, a training checkpoint (:mod:`hetpipe_jax.jobs.resume`).

  Args:
    config: the job's ConfigDict.
    settings: :func:`hetpipe_jax.jobs.job_config.resolve_settings` of ``config`` (the plan read once).
    workdir: the run's output directory.
    resume: continue from the newest readable checkpoint in ``workdir`` (any plan of the same model).

  Raises:
    ConfigError: invalid settings, no task times (set ``config.emulate_stage_ms`` or use a plan), ``resume``
      without checkpoints (or checkpoints without ``resume``), or a checkpoint of another model.
  """
  if config.get("num_ps_shards") not in (None, 1):
    raise ConfigError(f"config.num_ps_shards={config.num_ps_shards}: virtual time runs one in-process PS; leave it "
                      "unset or 1 (sharded parameter servers run under MPI)")
  if config.get("ps_watchdog_s", 0.0):
    raise ConfigError(f"config.ps_watchdog_s={config.ps_watchdog_s}: virtual time has no hung ranks to watch; set it "
                      "to 0 (the watchdog runs under MPI)")
  # the PS methods' run, or all-reduce BSP (no PS: gpipe, 1f1b_flush, horovod), by the method's ``sync``
  return _RUNS[methods.get_method(settings.method).sync](config, settings, workdir, resume)


def _run_wsp(config: Any, settings: JobSettings, workdir: str, resume: bool) -> dict:
  """:func:`run` for the parameter-server methods (hetpipe, pipedream)."""
  spec, partitions = prepare(config, settings, world_size=settings.world_size, check_local_devices=False)
  times, emulate_plan = _virtual_task_times(config, settings)
  dataset = load_data(config, spec)
  num_mb = minibatches_per_vw(config, settings, dataset.num_train)
  check_workdir(workdir)
  resume_lib.check_resume_workdir(workdir, resume)
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(config.seed)))
  layout = ParamLayout.from_layer_params(params0)
  point = (resume_lib.load_resume_point(workdir, settings, partitions, layout, spec.num_layers, spec.name)
           if resume else None)
  nm, n = settings.num_inflight, settings.num_virtual_workers
  start_mb = point.minibatch_start if point else 0
  num_waves = (num_mb - start_mb) // nm  # waves of this run (after the resume point)
  if num_waves < 1:
    raise ConfigError(f"--resume: the checkpoint has {start_mb} of the run's {num_mb} minibatches per VW done; "
                      "nothing is left to train (raise config.num_epochs or config.num_minibatches)")
  clock0 = point.step if point else 0
  if point:  # metrics.jsonl as it was at the checkpoint (later lines belong to the lost part of the run)
    resume_lib.rewrite_lines(pathlib.Path(workdir) / "metrics.jsonl", point.meta["metrics"])
  outputs = RunOutputs(workdir)
  config_json = resolved_config(config, settings, partitions, emulate_plan=emulate_plan,
                                **data_config_fields(spec, dataset),
                                **replay_fields(point.flat_weights if point else layout.flatten(params0), config.seed,
                                                point.step if point else None))
  outputs.write_config(config_json)
  for note in settings.notes:
    logging.info("[virtual] %s", note)

  server = ParameterServer(point.flat_weights if point else layout.flatten(params0), n, config.ps_apply,
                           **ps_scaling(config))
  devices = jax.local_devices()
  outbox: dict = {}
  vws, next_device = [], 0
  data_offset = [start_mb] * n  # per VW: minibatches done before the current segment
  meta = point.meta if point else {}
  off = resume_lib.Offsets(clock0, start_mb, float(meta.get("time_s", 0.0)))
  for v, partition in enumerate(partitions):
    stage_devices = [devices[(next_device + s) % len(devices)] for s in range(len(partition))]
    next_device += len(partition)
    optimizer = make_optimizer(config, num_mb, spec)
    stages = build_stages(config, spec, partition, stage_devices, optimizer)
    source = sharding.ShardedMinibatches(dataset, n, v, config.batch_size, config.seed)
    vw = vw_lib.VirtualWorker(stages, layout, layout.unflatten(server.weights),
                              vw_lib.WSPSettings(v, n, nm, settings.staleness_bound, config.pull_every_wave),
                              update_settings(config, settings, optimizer, v, num_mb),
                              vw_lib.VWHooks(lambda p, get=source.get_with_ids, v=v: get(data_offset[v] + p),
                                             virtual_time.RecordingPSClient(v, outbox),
                                             corrupt_update=resume_lib.nan_injector(config, v, off)))
    if point:
      vw.load_opt_state(*point.opt_states[v])
      vw.set_version_id(point.meta["version_ids"][v % len(point.meta["version_ids"])])
    vws.append(vw)

  evaluator = Evaluator(spec, layout, dataset.eval_inputs, dataset.eval_targets, config.eval_batch_size, devices[0])
  eval_every = eval_every_waves(config, settings, dataset.num_train)
  total_waves = clock0 + num_waves
  bar = None
  if config.progress:
    from tqdm import tqdm
    bar = tqdm(total=total_waves, initial=clock0, desc="[virtual] global clock", unit="wave", mininterval=1.0,
               dynamic_ncols=True)
  state: dict[str, Any] = {"loss": meta.get("last_loss", float("nan")), "losses": list(meta.get("pending_losses", [])),
                           "evals": list(meta.get("evals", []))}
  records: list[dict] = list(meta.get("records", []))
  applied: list[tuple[int, int]] = [tuple(a) for a in meta.get("applied", [])]
  staleness: list = [tuple(a) for a in meta.get("applied_staleness", [])]  # (tau, scale) per applied wave
  resumes = list(meta.get("resumes", []))
  if point:
    resumes.append({"global_clock": clock0, "minibatches_per_vw": start_mb, "time_s": meta["time_s"],
                    "checkpoint": str(pathlib.Path(workdir) / "checkpoints" / str(clock0)), "notes": point.notes})
  host_t0 = time.perf_counter()

  def on_clock(clock: int, t: float, losses: list) -> None:
    clock += off.clock
    t += off.time_s
    state["losses"] += [s / max(k, 1) for _, s, k in losses]
    evaluated = eval_every > 0 and clock % eval_every == 0
    if clock % max(1, config.log_every_waves) and not evaluated:
      return
    if state["losses"]:
      state["loss"] = float(np.mean(state["losses"]))
      state["losses"] = []
    done = (start_mb + (clock - clock0) * nm) * n
    line = {"minibatches": done, "wave": clock - 1, "global_clock": clock, "loss": state["loss"],
            "simulated_time_s": t, "minibatches_per_simulated_s": done / t,
            "host_wall_time_s": time.perf_counter() - host_t0}
    if evaluated:
      line.update(evaluator.evaluate(server.weights))
      state["evals"].append({"global_clock": clock, "simulated_time_s": t, **{k: line[k] for k in
                                                                             ("test_accuracy", "test_loss")}})
    outputs.log_metrics(line)
    if bar is not None:
      bar.update(clock - bar.n)
      bar.set_postfix({"loss": f"{state['loss']:.3f}", "sim_s": f"{t:.1f}"}, refresh=False)

  logging.info("[virtual] %d VWs x %d minibatches (Nm=%d, D=%d, ps_apply=%s) of %s in simulated time%s", n, num_mb,
               nm, settings.staleness_bound, config.ps_apply, spec.name,
               f", resumed at global clock {clock0}" if point else "")
  store = TrainingCheckpoints(workdir, config.checkpoint_max_to_keep) if config.checkpoint_every_waves > 0 else None
  ckpt_stats: list[dict] = []
  report = None
  wait_s = (list(meta.get("wait_s", [])) + [0.0] * n)[:n]  # per VW, over the whole run (a new plan may change N)
  idle_s = (list(meta.get("idle_s", [])) + [0.0] * n)[:n]
  max_distance = int(meta.get("max_clock_distance", 0))
  try:
    for first, end in resume_lib.segments(clock0, total_waves, config.checkpoint_every_waves):
      if first != clock0 or point:
        server.state = server.state.fresh()
        for vw in vws:
          vw.begin_segment(server.weights)
      off.clock, off.minibatch = first, start_mb + (first - clock0) * nm
      server.wave_offset = first
      for v in range(n):
        data_offset[v] = off.minibatch
      marks = [len(vw.records) for vw in vws]
      report, _ = virtual_time.run(vws, server, outbox, times, end - first, settings.staleness_bound,
                                   config.pull_every_wave, on_clock)
      for vw, mark in zip(vws, marks):
        for rec in vw.records[mark:]:
          resume_lib.shift_record(rec, off)
          records.append(dict(rec.__dict__))
      applied += [(first + w, v) for w, v in server.state.applied]
      staleness += server.state.staleness
      for r in report.vws:
        wait_s[r.vw_id] += r.wait_s
        idle_s[r.vw_id] += r.idle_s
      max_distance = max(max_distance, report.max_clock_distance)
      # The barrier: the last pushes reach the PS and its weights reach every VW before the next segment starts.
      # After the last segment there is none: the run ends when its last minibatch completes, as in the engine.
      off.time_s += report.makespan_s + (max(t.push_s + t.pull_s for t in times) if end < total_waves else 0.0)
      if store is not None and (end % config.checkpoint_every_waves == 0 or end == total_waves):
        ckpt_meta = resume_lib.checkpoint_meta(
            step=end, settings=settings, partitions=partitions, model_name=spec.name, num_layers=spec.num_layers,
            opt_parts_per_layer=len(vws[0].opt_state_by_layer()[1][0]), minibatches_done=off.minibatch + (end - first) * nm,
            applied=applied, records=records, metrics=resume_lib.read_lines(outputs.dir / "metrics.jsonl"),
            evals=state["evals"], time_s=off.time_s, config_json=config_json, resumes=resumes,
            version_ids=[vw.version.version_id for vw in vws], last_loss=state["loss"],
            pending_losses=state["losses"],
            extra={"mode": "virtual", "wait_s": wait_s, "idle_s": idle_s, "max_clock_distance": max_distance,
                   "applied_staleness": staleness})
        ckpt_stats.append(resume_lib.save_training_checkpoint(store, end, layout.unflatten(server.weights),
                                                   {v: vw.opt_state_by_layer() for v, vw in enumerate(vws)}, ckpt_meta))
  finally:
    if store is not None:
      store.close()
  if bar is not None:
    bar.update(total_waves - bar.n)
    bar.close()
  final = evaluator.evaluate(server.weights)
  total = num_mb * n
  outputs.log_metrics({"minibatches": total, "global_clock": total_waves, "loss": state["loss"],
                       "simulated_time_s": off.time_s, **final})
  extra = outputs.write_minibatches(records)
  applied_fields = outputs.write_ps_applied(applied, n, staleness=ps_staleness_log(config, staleness))
  if config.save_task_trace:
    from hetpipe_jax.sim import gantt  # matplotlib only when drawing
    trace.write_trace(trace.report_trace(report), str(outputs.dir / "trace.json"))
    gantt.plot_report(report, str(outputs.dir / "gantt.png"))
  ckpt = outputs.save_checkpoint(layout.unflatten(server.weights))
  sim_time = off.time_s
  summary = {
      "mode": "virtual",
      "time_unit": "simulated seconds",
      "test_accuracy": final["test_accuracy"],
      "test_loss": final["test_loss"],
      **final,
      "objective": config_json["objective"],
      "loss_unit": config_json["loss_unit"],
      "final_train_loss": state["loss"],
      "num_minibatches": total,
      "num_minibatches_per_vw": num_mb,
      "simulated_time_s": sim_time,
      "wall_time_s": sim_time,
      # The engine's network rule (rules/network: VWs on one node share its NIC), as it ran.
      "shared_nic": engine_lib.EngineConfig.shared_nic if report is None else report.config["shared_nic"],
      "minibatches_per_s": total / sim_time,
      "images_per_s": total * config.batch_size / sim_time,
      "steady_minibatches_per_s": engine_report.steady_rates(
          [[r["complete_time_s"] for r in records if r["vw_id"] == v and r["minibatch_id"] >= start_mb]
           for v in range(n)], nm, warmup_waves=1)[1],
      "host_wall_time_s": time.perf_counter() - host_t0,
      **settings_summary(settings, partitions, config, spec),
      "global_clock": total_waves,
      **applied_fields,
      **extra,
      "evaluations": state["evals"],
      "wait_s": {str(v): w for v, w in enumerate(wait_s)},
      "idle_s": {str(v): w for v, w in enumerate(idle_s)},
      "max_clock_distance": max_distance,
      "checkpoint": str(ckpt),
      **resume_lib.checkpoint_summary(config, ckpt_stats, resumes),
  }
  outputs.finish(summary)
  logging.info("[virtual] done: test accuracy %.4f, %d minibatches in %.1f simulated s (%.1f host s)",
               final["test_accuracy"], total, sim_time, summary["host_wall_time_s"])
  return summary


def _run_allreduce(config: Any, settings: JobSettings, workdir: str, resume: bool) -> dict:
  """``--mode=virtual`` for the all-reduce methods (gpipe, 1f1b_flush, horovod): every VW in one process, the
  engine's all-reduce BSP schedule (:func:`hetpipe_jax.runtime.virtual_time.run_allreduce`), real numerics.

  Raises:
    ConfigError: ``resume`` (not supported for these methods), or no task times.
  """
  if resume:
    raise ConfigError(f"--resume is not supported for config.method={settings.method!r}")
  spec, partitions = prepare(config, settings, world_size=settings.world_size, check_local_devices=False)
  times, emulate_plan = _virtual_task_times(config, settings)
  dataset = load_data(config, spec)
  steps = minibatches_per_vw(config, settings, dataset.num_train)
  check_workdir(workdir)
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(config.seed)))
  layout = ParamLayout.from_layer_params(params0)
  n, m = settings.num_virtual_workers, settings.num_inflight
  outputs = RunOutputs(workdir)
  outputs.write_config(resolved_config(config, settings, partitions, emulate_plan=emulate_plan,
                                       checkpoint_every_waves=0, **data_config_fields(spec, dataset),
                                       **replay_fields(layout.flatten(params0), config.seed)))
  for note in settings.notes:
    logging.info("[virtual] %s", note)
  devices = jax.local_devices()
  outbox: dict = {}
  vws, next_device = [], 0
  for v, partition in enumerate(partitions):
    stage_devices = [devices[(next_device + s) % len(devices)] for s in range(len(partition))]
    next_device += len(partition)
    optimizer = make_optimizer(config, steps, spec)
    stages = build_stages(config, spec, partition, stage_devices, optimizer, remat=bool(config.remat))
    source = sharding.ShardedMinibatches(dataset, n, v, config.batch_size, config.seed)
    micro = sharding.MicroBatches(source.get_with_ids, m)  # records carry each micro-batch's example ids
    vws.append(vw_lib.VirtualWorker(
        stages, layout, params0, vw_lib.WSPSettings(v, n, m, settings.staleness_bound),
        vw_lib.UpdateSettings(optimizer, settings.method, reducer=virtual_time.HeldReducer(v, outbox)),
        vw_lib.VWHooks(micro.get)))
  evaluator = Evaluator(spec, layout, dataset.eval_inputs, dataset.eval_targets, config.eval_batch_size, devices[0])
  eval_every = eval_every_waves(config, settings, dataset.num_train)
  bar = None
  if config.progress:
    from tqdm import tqdm
    bar = tqdm(total=steps, desc=f"[virtual {settings.method}] step", unit="step", mininterval=1.0,
               dynamic_ncols=True)
  state: dict[str, Any] = {"loss": float("nan"), "losses": [], "evals": []}
  host_t0 = time.perf_counter()

  def on_step(step: int, t: float, loss: float) -> None:
    clock = step + 1
    state["losses"].append(loss)
    if bar is not None:
      bar.update(1)
    evaluated = eval_every > 0 and clock % eval_every == 0 and clock < steps
    if clock % max(1, config.log_every_waves) and not evaluated:
      return
    state["loss"] = float(np.mean(state["losses"]))
    state["losses"] = []
    line = {"minibatches": clock * n, "wave": step, "global_clock": clock, "loss": state["loss"],
            "simulated_time_s": t, "minibatches_per_simulated_s": clock * n / t if t > 0 else float("nan"),
            "host_wall_time_s": time.perf_counter() - host_t0}
    if evaluated:
      line.update(evaluator.evaluate(layout.flatten(vws[0].layer_params())))
      state["evals"].append({"global_clock": clock, "simulated_time_s": t,
                             **{k: line[k] for k in ("test_accuracy", "test_loss")}})
    outputs.log_metrics(line)

  logging.info("[virtual] %s: %d VWs x %d steps of %d micro-batches of %s in simulated time", settings.method, n,
               steps, m, spec.name)
  report, _ = virtual_time.run_allreduce(vws, outbox, times, steps, on_step)
  if bar is not None:
    bar.close()
  if state["losses"]:
    state["loss"] = float(np.mean(state["losses"]))
  final_flat = layout.flatten(vws[0].layer_params())
  digests = {vw.vw_id: weights_sha256(layout.flatten(vw.layer_params())) for vw in vws}
  identical = len(set(digests.values())) == 1
  final = evaluator.evaluate(final_flat)
  sim_time = report.makespan_s
  outputs.log_metrics({"minibatches": steps * n, "global_clock": steps, "loss": state["loss"],
                       "simulated_time_s": sim_time, **final})
  records = [dict(rec.__dict__) for vw in vws for rec in vw.records]
  extra = outputs.write_minibatches(records)
  if config.save_task_trace:
    from hetpipe_jax.sim import gantt  # matplotlib only when drawing
    trace.write_trace(trace.report_trace(report), str(outputs.dir / "trace.json"))
    gantt.plot_report(report, str(outputs.dir / "gantt.png"))
  ckpt = outputs.save_checkpoint(layout.unflatten(final_flat))
  total = steps * n
  summary = {
      "mode": "virtual",
      "time_unit": "simulated seconds",
      **allreduce_results(final, state["loss"], steps, n, m),
      "simulated_time_s": sim_time,
      "wall_time_s": sim_time,
      "minibatches_per_s": total / sim_time,
      "images_per_s": total * config.batch_size / sim_time,
      "steady_minibatches_per_s": report.total_minibatches_per_s / m,
      "host_wall_time_s": time.perf_counter() - host_t0,
      **settings_summary(settings, partitions, config, spec),
      "global_clock": steps,
      "shared_nic": report.config["shared_nic"],  # the engine's network rule, as it ran
      "allreduce": {"steps": report.final_global_clock,
                    "allreduce_s_per_step": max(t.allreduce_time_s(report.config["shared_nic"]) for t in times),
                    "replicas_identical": identical,
                    "replica_sha256": {str(v): d for v, d in sorted(digests.items())}},
      **extra,
      "evaluations": state["evals"] + [{"global_clock": steps, "simulated_time_s": sim_time, **final}],
      "wait_s": {str(r.vw_id): r.wait_s for r in report.vws},
      "idle_s": {str(r.vw_id): r.idle_s for r in report.vws},
      "checkpoint": str(ckpt),
      "checkpoint_every_waves": 0,
  }
  outputs.finish(summary)
  check_replicas_identical(digests, workdir)  # a non-zero exit
  logging.info("[virtual] done: test accuracy %.4f, %d minibatches in %.1f simulated s (%.1f host s)",
               final["test_accuracy"], total, sim_time, summary["host_wall_time_s"])
  return summary


_RUNS = {"wsp": _run_wsp, "allreduce": _run_allreduce}  # the methods table's ``sync`` -> its run
