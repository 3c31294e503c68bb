"""The GPU check's in-process measurements (:mod:`scripts.gpu_check` runs each in its own process): the per-layer
profile against the roofline, the pipeline's useful-compute ratio, and one stage's peak memory against the model.

Sizes: the GPT-2-small shape on a GPU (``gpt2_small``), on CPU the same 14-layer structure at toy width; 4 stages
(:data:`PARTITION`), Nm = :data:`NUM_INFLIGHT`.
"""

from __future__ import annotations

import gc
import os
import pathlib
import statistics
import subprocess
import sys
import time

from hetpipe_jax.paths import REPO_ROOT

PARTITION = ((0, 3), (3, 7), (7, 11), (11, 14))  # the GPT's 14 layers (embedding, 12 blocks, head) in 4 stages
NUM_INFLIGHT = 4
PIPELINE_GOAL = 0.90
MEMORY_TOLERANCE = 0.20


def gpt_spec(cpu: bool):
  """The GPT-2-small shape on a GPU; on CPU the same 14-layer structure at toy width."""
  from hetpipe_jax import models
  from hetpipe_jax.models import gpt
  if cpu:
    return gpt.gpt("gpt2_small_cpu_rehearsal", vocab_size=256, seq_len=32, d_model=32, num_heads=2, num_blocks=12)
  return models.get_model("gpt2_small")


def cluster_for(device):
  """The cluster file whose GPU type describes ``device`` (None when there is none)."""
  from hetpipe_jax.costs import cluster
  if device.platform == "cpu":
    return cluster.load_cluster("local_cpu")
  kind = device.device_kind
  for name, tag in (("h200", "H200"), ("h100", "H100")):
    if tag in kind:
      return cluster.load_cluster(name)
  return None


def gpt_data(spec, batch: int, seed: int):
  """Random token minibatches ``p -> (int32 [b, seq], int32 [b, seq])`` (the pipeline's numerics do not matter)."""
  import numpy as np
  seq = spec.input_shape[0]

  def get(p):
    rng = np.random.default_rng(seed + p)
    tokens = rng.integers(0, spec.num_classes, (batch, seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]
  return get


def _profile_table(prof, costs, gpu, config) -> tuple[list[dict], float | None]:
  """Per layer: measured ms (``prof``) against the roofline of ``costs``' FLOPs and bytes at efficiency 1 and at
  the fitted efficiency (``costs``: a cost-analysis profile of the same model and batch)."""
  import dataclasses
  from hetpipe_jax.costs import cost_model
  rows, fitted = [], None
  if gpu is not None:
    ideal = dataclasses.replace(gpu, measured_device_kind=None, roofline_efficiency=1.0)
    merged = dataclasses.replace(costs, measured=True, layers=tuple(
        dataclasses.replace(c, fwd_time_ms=m.fwd_time_ms, bwd_time_ms=m.bwd_time_ms)
        for c, m in zip(costs.layers, prof.layers)))
    fitted = cost_model.calibrate_efficiency(merged, ideal)
    at_fit = dataclasses.replace(gpu, measured_device_kind=None, roofline_efficiency=min(fitted, 1.0))
  for layer, cost in zip(prof.layers, costs.layers):
    row = {"layer": layer.name, "fwd_ms": layer.fwd_time_ms, "bwd_ms": layer.bwd_time_ms,
           "fwd_gflop": cost.fwd_flops / 1e9, "bwd_gflop": cost.bwd_flops / 1e9,
           "fwd_gflop_device_cost_analysis": layer.fwd_flops / 1e9,
           "bwd_gflop_device_cost_analysis": layer.bwd_flops / 1e9}
    if gpu is not None:
      one = dataclasses.replace(costs, measured=False, layers=(cost,))
      row["roofline_ms_at_efficiency_1"] = float(cost_model.layer_times_ms(one, ideal, config)[0])
      row["roofline_ms_at_fitted"] = float(cost_model.layer_times_ms(one, at_fit, config)[0])
      row["efficiency"] = row["roofline_ms_at_efficiency_1"] / (layer.fwd_time_ms + layer.bwd_time_ms)
    rows.append(row)
  return rows, fitted


def _cpu_cost_profile(model: str, batch: int, cpu: bool, work: pathlib.Path):
  """The cost-analysis profile the planner uses for a GPU it has not measured (XLA's CPU backend: it counts every
  dot's FLOPs, where the GPU backend's cost analysis leaves out cuBLAS / cuDNN custom calls), made in a CPU-only
  process."""
  from hetpipe_jax.costs import profile_format
  path = work / f"costs_{model}_b{batch}.json"
  code = ("import sys; sys.path.insert(0, '.'); from scripts import gpu_measure; from hetpipe_jax.runtime import "
          "profiler; from hetpipe_jax.costs import profile_format as pf; "
          f"spec = gpu_measure.spec_named({model!r}, {cpu}); "
          f"pf.save_profile(profiler.profile_model(spec, {batch}, measure=False, optimizer='adam'), {str(path)!r})")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        check=False, timeout=90)
  if proc.returncode != 0:
    raise RuntimeError(f"the CPU cost analysis of {model} failed:\n{proc.stderr[-2000:]}")
  return profile_format.load_profile(str(path))


def spec_named(name: str, cpu: bool):
  from hetpipe_jax import models
  return gpt_spec(cpu) if name == gpt_spec(cpu).name else models.get_model(name)


def step_profile(cpu: bool, out: pathlib.Path, work: pathlib.Path, batch: int, repeats: int) -> dict:
  """The profile step (module docstring of ``gpu_check``): per-layer times against the roofline, fitted efficiency."""
  import jax
  from hetpipe_jax import models
  from hetpipe_jax.costs import cost_model, profile_format
  from hetpipe_jax.runtime import profiler
  device = jax.devices()[0]
  clus = cluster_for(device)
  gpu = next(iter(clus.gpu_types.values())) if clus is not None else None
  config = cost_model.CostModelConfig()
  result = {"device_kind": device.device_kind, "cluster": clus.name if clus else None,
            "gpu_type": gpu.name if gpu else None,
            "roofline_source": "FLOPs and bytes of XLA's CPU cost analysis (what the planner uses for a GPU it has "
                               "not measured; the GPU backend's cost analysis leaves out cuBLAS / cuDNN calls: "
                               "*_device_cost_analysis)",
            "models": {}}
  for spec, batch in ((models.get_model("cnn"), 64 if not cpu else 8), (gpt_spec(cpu), batch)):
    t0 = time.perf_counter()
    prof = profiler.profile_model(spec, batch, measure=True, repeats=repeats if not cpu else 2,
                                  optimizer="adam", device=device)
    path = out / f"profile_{spec.name}_b{batch}.json"
    profile_format.save_profile(prof, str(path))
    costs = _cpu_cost_profile(spec.name, batch, cpu, work)
    rows, fitted = _profile_table(prof, costs, gpu, config)
    seq = spec.input_shape[0] if spec.input_dtype == "int32" else None
    result["models"][spec.name] = {
        "batch_size": batch, "sequence_length": seq, "seconds": time.perf_counter() - t0,
        "measured_total_ms": sum(r["fwd_ms"] + r["bwd_ms"] for r in rows),
        "fitted_efficiency": fitted, "profile_file": path.name,
        "planner_path": os.path.relpath(profile_format.default_profile_path(spec.name, batch, prof.device_kind, True),
                                        REPO_ROOT),
        "layers": rows}
  _plot_profile(result, out / "profile.png")
  return result


def _plot_profile(result: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = list(result["models"])
  fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
  for ax, name in zip(axes[0], names):
    m = result["models"][name]
    rows = m["layers"]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["fwd_ms"] + r["bwd_ms"] for r in rows], 0.4, label="measured fwd+bwd")
    if rows and "roofline_ms_at_fitted" in rows[0]:
      ax.bar([x + 0.2 for x in xs], [r["roofline_ms_at_fitted"] for r in rows], 0.4,
             label=f"roofline at fitted efficiency {m['fitted_efficiency']:.3f}")
    ax.set_xticks(list(xs), [r["layer"] for r in rows], rotation=90, fontsize=7)
    ax.set_ylabel("ms per minibatch")
    ax.set_title(f"{name}, batch {m['batch_size']} on {result['device_kind']}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _build_vw(spec, stages, params0, tx, batch, staleness_bound: int = 0):
  from hetpipe_jax.ps import param_server
  from hetpipe_jax.runtime import virtual_worker
  from hetpipe_jax.runtime.param_layout import ParamLayout
  layout = ParamLayout.from_layer_params(params0)
  server = param_server.ParameterServer(layout.flatten(params0), 1)
  return virtual_worker.VirtualWorker(stages, layout, params0,
                                      virtual_worker.WSPSettings(0, 1, NUM_INFLIGHT, staleness_bound),
                                      virtual_worker.UpdateSettings(tx),
                                      virtual_worker.VWHooks(gpt_data(spec, batch, 0),
                                                             param_server.LocalPSClient(server, 0)))


def _median_s(fn, repeats: int) -> float:
  import jax
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def step_pipeline(cpu: bool, batch: int, minibatches: int, bounds: list[int], repeats: int) -> dict:
  """The pipeline step: the runtime's VW of 4 stages on one device against one jitted whole-model step, at each of
  ``bounds`` (D; the first is the headline)."""
  import jax
  import numpy as np
  import optax
  from hetpipe_jax import models
  from hetpipe_jax.runtime import objectives
  from hetpipe_jax.runtime import stages as stages_lib
  spec = gpt_spec(cpu)
  device = jax.devices()[0]
  tx = optax.adam(1e-4)
  n = minibatches if not cpu else 8
  if n % NUM_INFLIGHT:
    raise ValueError(f"pipeline minibatches={n} must be a multiple of Nm = {NUM_INFLIGHT}")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  stages = stages_lib.build_stages(spec, PARTITION, [device] * len(PARTITION), tx)
  requested, out_of_memory = batch, []
  while True:  # all four stages on one device: a smaller GPU (an H100 at batch 8) may not hold them; halve and say so
    try:
      t0 = time.perf_counter()
      _build_vw(spec, stages, params0, tx, batch).run(2 * NUM_INFLIGHT)  # compiles every stage function
      warm_s = time.perf_counter() - t0
      gc.collect()  # the warm-up VW's buffers leave the device
      break
    except Exception as e:  # pylint: disable=broad-except  # XlaRuntimeError; anything else is raised again
      if "RESOURCE_EXHAUSTED" not in str(e) or batch == 1:
        raise
      out_of_memory.append({"batch_size": batch, "error": str(e)[:300]})
      batch //= 2
      del e
      gc.collect()
  # The whole model as one jitted training step (forward, loss, backward, Adam) on the same device.
  loss_fn = objectives.get_objective(spec.objective).loss
  params = jax.device_put(params0, device)
  opt_state = jax.device_put(tx.init(params), device)

  @jax.jit
  def train_step(p, o, x, y):
    loss, g = jax.value_and_grad(lambda q: loss_fn(models.apply_layers(spec.layers, q, x), y))(p)
    delta, o = tx.update(g, o, p)
    return optax.apply_updates(p, delta), o, loss

  x, y = (jax.device_put(a, device) for a in gpt_data(spec, batch, 0)(0))
  step_s = _median_s(lambda: train_step(params, opt_state, x, y), repeats if not cpu else 3)
  del params, opt_state, x, y, train_step  # free the whole model's buffers before the VWs run
  gc.collect()
  by_bound = {}
  for bound in bounds:  # D = 0 first: the headline; D >= 1 lets the PS channel overlap the exchange
    vw = _build_vw(spec, stages, params0, tx, batch, int(bound))
    by_bound[int(bound)] = vw.run(n)
    del vw
    gc.collect()  # the VW's weights, versions and optimizer states leave the device before the next one
  stats = by_bound[int(bounds[0])]
  per_task = lambda s: 1e6 * s / stats.num_tasks  # noqa: E731
  host_overhead = stats.host_busy_s - stats.update_s - stats.sync_s - stats.inject_s + stats.executor_book_s
  ratio = n * step_s / stats.wall_time_s
  result = {
      "model": spec.name, "batch_size": batch, "batch_size_requested": requested, "out_of_memory": out_of_memory,
      "sequence_length": spec.input_shape[0],
      "partition": [list(r) for r in PARTITION], "num_inflight": NUM_INFLIGHT,
      "staleness_bound": int(bounds[0]),
      "device": f"{device.platform}:{device.id} {device.device_kind}", "minibatches": n,
      "warm_up_s": warm_s, "runtime_wall_s": stats.wall_time_s,
      "runtime_minibatches_per_s": n / stats.wall_time_s,
      "whole_model_step_ms": 1e3 * step_s, "whole_model_minibatches_per_s": 1 / step_s,
      "useful_compute_ratio": ratio,
      "host_overhead_us_per_task": per_task(host_overhead),
      "scheduler_thread_busy_us_per_task": per_task(stats.host_busy_s),
      "weight_update_and_push_us_per_task": per_task(stats.update_s),
      "wave_push_s": stats.push_s, "pull_install_s": stats.sync_s, "ps_channel": stats.ps_channel,
      "ps_channel_busy_s": stats.ps_channel_s,
      "per_wave_push_ms": 1e3 * stats.push_s / (n // NUM_INFLIGHT),
      "per_wave_pull_install_ms": 1e3 * stats.sync_s / max(stats.num_pulls, 1), "num_pulls": stats.num_pulls,
      "wave_bytes": 4 * sum(int(np.prod(np.shape(a))) for a in jax.tree.leaves(params0)),
      "pull_install_us_per_task": per_task(stats.sync_s),
      "wait_for_ps_s": stats.wait_s, "num_tasks": stats.num_tasks,
      "note": "useful_compute_ratio = minibatches x the whole model's jitted step / the runtime's wall time, all 4 "
              "stages on one device (no overlap between stages is possible there); the runtime's wall also holds "
              "HetPipe's per-minibatch stage updates and every wave's push to and pull from the in-process PS "
              "(device <-> host copies of the wave's update and the global weights)",
  }
  result["by_staleness_bound"] = {
      str(d): {"runtime_wall_s": st.wall_time_s, "useful_compute_ratio": n * step_s / st.wall_time_s,
               "ps_channel": st.ps_channel, "ps_channel_busy_s": st.ps_channel_s, "wait_for_ps_s": st.wait_s,
               "scheduler_thread_busy_s": st.host_busy_s} for d, st in by_bound.items()}
  if not cpu:
    result["goal"] = PIPELINE_GOAL
    result["goal_met"] = ratio >= PIPELINE_GOAL
  return result


def _stage_bytes_on(device) -> int:
  import jax
  return int(sum(a.nbytes for a in jax.live_arrays() if device in a.devices()))


def step_memory_stage(cpu: bool, batch: int, s: int) -> dict:
  """One stage alone on the device at its conservative peak; measured bytes against the memory model."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from hetpipe_jax import models
  from hetpipe_jax.costs import cluster, cost_model
  from hetpipe_jax.runtime import profiler
  from hetpipe_jax.runtime import stages as stages_lib
  spec = gpt_spec(cpu)
  device = jax.devices()[0]
  tx = optax.adam(1e-4)
  num_stages = len(PARTITION)
  start, end = PARTITION[s]
  is_last = s == num_stages - 1
  # The planner's number for this stage: the cost model on a cost-analysis profile made on this device.
  prof = profiler.profile_model(spec, batch, measure=False, optimizer="adam", device=device)
  clus = cluster_for(device) or cluster.load_cluster("h100")  # any GPU type: capacity is not used here
  costs = cost_model.build_stage_costs(prof, clus, cost_model.CostModelConfig(method="hetpipe"))
  model_bytes = costs.stage_memory_bytes(start, end, is_last, num_stages, NUM_INFLIGHT)
  layers = prof.layers[start:end]
  breakdown = {"params": sum(l.param_bytes for l in layers),
               "optimizer_state": sum(l.optimizer_state_bytes for l in layers),
               "stash_per_minibatch": sum(l.stash_bytes for l in layers),
               "input_activation": int(costs.boundary_bytes[start]),
               "received_gradient": int(costs.boundary_bytes[end]) if end < spec.num_layers else 0,
               "workspace": int(costs.workspace_max[start, end])}
  # The stage alone, with the runtime's own jitted functions.
  st = stages_lib.build_stages(spec, PARTITION, [device] * num_stages, tx)[s]
  stats0 = device.memory_stats() or {}
  base = _stage_bytes_on(device)
  params = jax.device_put(models.init_layer_params(spec, jax.random.key(0))[start:end], device)
  opt_state = jax.device_put(tx.init(params), device)
  wave_delta = jax.device_put(jax.tree.map(jnp.zeros_like, params), device)
  no_clip = jax.device_put(np.float32(0), device)  # the global norm, read only when clipping is on (it is off)
  shapes = models.activation_shapes(spec, batch)
  rng = np.random.default_rng(s)
  seq = spec.input_shape[0]

  def stage_input():
    if s == 0:
      return jax.device_put(rng.integers(0, spec.num_classes, (batch, seq)).astype(np.int32), device)
    return jax.device_put(rng.standard_normal(shapes[start - 1]).astype(np.float32), device)

  live, temps = [], {}
  sample = lambda: live.append(_stage_bytes_on(device) - base)  # noqa: E731
  h = 1 if is_last else NUM_INFLIGHT
  if is_last:
    for _ in range(2):
      labels = jax.device_put(rng.integers(0, spec.num_classes, (batch, seq)).astype(np.int32), device)
      loss, grads, gin = st.forward_backward(params, stage_input(), labels)
      jax.block_until_ready(gin)
      sample()
      params, opt_state, wave_delta = st.update(params, opt_state, grads, wave_delta, no_clip)
      del loss, grads, gin
      jax.block_until_ready(params)
      sample()
    x0 = stage_input()
    temps["forward_backward"] = st.forward_backward.lower(params, x0, labels).compile().memory_analysis()
  else:
    versions, vjps = [params], []
    zero = jax.tree.map(jnp.zeros_like, params)
    for _ in range(h):  # h forwards, each on the newest version; a minibatch completes between injections
      act, vjp = st.forward(versions[-1], stage_input())
      vjps.append(vjp)
      jax.block_until_ready(act)
      del act  # the next stage's input, counted there
      new, opt_state, wave_delta = st.update(versions[-1], opt_state, zero, wave_delta, no_clip)
      versions.append(new)
      jax.block_until_ready(new)
      sample()
    del zero
    grads_in = [jax.device_put(rng.standard_normal(shapes[end - 1]).astype(np.float32), device) for _ in range(h)]
    sample()
    x0 = stage_input()
    temps["forward"] = st.forward.lower(versions[0], x0).compile().memory_analysis()
    temps["backward"] = st.backward.lower(vjps[0], grads_in[0]).compile().memory_analysis()
    for k in range(h):
      grads, gin = st.backward(vjps[k], grads_in[k])
      vjps[k] = grads_in[k] = None
      jax.block_until_ready(grads)
      sample()
      new, opt_state, wave_delta = st.update(versions[-1], opt_state, grads, wave_delta, no_clip)
      versions[k] = None
      versions.append(new)
      del grads, gin
      jax.block_until_ready(new)
      sample()
  temp_bytes = max(int(getattr(m, "temp_size_in_bytes", 0) or 0) for m in temps.values())
  from hetpipe_jax.runtime import xla_memory
  one_minibatch = xla_memory.stage_memory(spec, (start, end), batch, is_last=is_last, optimizer="adam",
                                          device=device).peak_bytes
  stats = device.memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    measured = int(stats["peak_bytes_in_use"]) - int(stats0.get("bytes_in_use", 0))
    source = "memory_stats peak_bytes_in_use (XLA's allocator) minus the bytes in use before the stage was placed"
  else:
    measured = max(live) + temp_bytes
    source = "largest sum of the device's live arrays + the largest compiled temp buffer (no memory_stats here)"
  return {"stage": s, "layers": [start, end], "is_last": is_last, "held": h, "model_bytes": model_bytes,
          "measured_bytes": measured, "measured_source": source, "ratio": measured / model_bytes,
          "live_arrays_peak_bytes": max(live), "compiled_temp_bytes": temp_bytes,
          "xla_programs_one_minibatch_bytes": one_minibatch,
          "compiled": {k: {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
                           "temp": int(m.temp_size_in_bytes), "alias": int(m.alias_size_in_bytes)}
                       for k, m in temps.items()},
          "model_breakdown": breakdown}


def memory_summary(stages: list[dict], cpu: bool) -> dict:
  result = {"num_inflight": NUM_INFLIGHT, "partition": [list(r) for r in PARTITION], "stages": stages,
            "tolerance": MEMORY_TOLERANCE,
            "misses": [st["stage"] for st in stages if abs(st["ratio"] - 1) > MEMORY_TOLERANCE]}
  if not cpu:
    result["goal_met"] = not result["misses"]
  return result


def plot_memory(memory: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  stages = memory["stages"]
  fig, ax = plt.subplots(figsize=(6, 4))
  xs = range(len(stages))
  ax.bar([x - 0.2 for x in xs], [st["model_bytes"] / 2**30 for st in stages], 0.4, label="memory model")
  ax.bar([x + 0.2 for x in xs], [st["measured_bytes"] / 2**30 for st in stages], 0.4, label="measured (XLA)")
  for x, st in zip(xs, stages):
    ax.text(x, max(st["model_bytes"], st["measured_bytes"]) / 2**30, f"{st['ratio']:.2f}", ha="center",
            va="bottom", fontsize=8)
  ax.set_xticks(list(xs), [f"stage {st['stage']}\nlayers {st['layers'][0]}-{st['layers'][1]}" for st in stages])
  ax.set_ylabel("GiB")
  ax.set_title(f"Per-stage peak, Nm = {memory['num_inflight']} (labels: measured / model)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
