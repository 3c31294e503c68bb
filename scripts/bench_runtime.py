"""Runtime benchmarks (prints JSON): host overhead per task, and emulated-VW throughput vs the engine.

  .venv/bin/python scripts/bench_runtime.py [--minibatches=200] [--emulated_minibatches=60] [--stage_ms=40,80,60,50]
  .venv/bin/python scripts/bench_runtime.py --quick  # CI smoke (seconds): 2 + 3 waves, 20 launch repeats

* ``host_overhead_us_per_task``: scheduler + dispatch time per task (the VW loop's time outside sleeps divided by
  tasks), with trivial stage functions (the tiny MLP at batch 1, 4 stages on 4 CPU devices). Goal <= 100 µs.
* ``single_thread_launch``: per-call jit launch of a trivial stage forward/backward and one activation
  ``device_put``, measured on one thread (in the threaded run the executors' time per task also holds waiting
  for the GIL and the 2 cores).
* ``emulated_vs_engine``: a 4-stage heterogeneous VW with emulated task durations >= 20 ms; measured minibatches/s
  divided by the engine's prediction for the same task times, in the same run. Goal >= 0.93.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

_MINIBATCHES = flags.DEFINE_integer("minibatches", 200, "Minibatches per measurement (a multiple of Nm).")
_NUM_INFLIGHT = flags.DEFINE_integer("num_inflight", 4, "Nm.")
_EMULATED_MINIBATCHES = flags.DEFINE_integer("emulated_minibatches", 60,
                                             "Minibatches of the emulated-VW measurement (a multiple of Nm).")
_QUICK = flags.DEFINE_bool("quick", False, "A seconds-long smoke run: --minibatches=2 Nm, --emulated_minibatches=3 Nm "
                           "(one wave after the warm-up wave: noisy) and 20 launch repeats.")
_STAGE_MS = flags.DEFINE_list("stage_ms", ["40", "80", "60", "50"],
                              "Emulated per-stage ms of the 4-stage VW (half forward, half backward: every task of "
                              "a non-last stage lasts half its stage time, so >= 40 ms keeps every task >= 20 ms).")


def _build(data_dir, batch_size, num_inflight, task_time_s=None, stages=None):
  """A 4-stage tiny-MLP VW with an in-process PS; pass ``stages`` from an earlier VW to reuse its compilations."""
  import jax
  import optax
  from hetpipe_jax.data import fashion_mnist, sharding
  from hetpipe_jax import models
  from hetpipe_jax.ps import param_server
  from hetpipe_jax.runtime import virtual_worker
  from hetpipe_jax.runtime import stages as stages_lib
  from hetpipe_jax.runtime.param_layout import ParamLayout
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  layout = ParamLayout.from_layer_params(params0)
  tx = optax.sgd(0.01)
  if stages is None:
    stages = stages_lib.build_stages(spec, [(0, 1), (1, 2), (2, 3), (3, 4)], jax.devices()[:4], tx)
  dataset = fashion_mnist.load_fashion_mnist(data_dir, expected_counts=None)
  source = sharding.ShardedMinibatches(dataset, 1, 0, batch_size, 0)
  server = param_server.ParameterServer(layout.flatten(params0), 1)
  return virtual_worker.VirtualWorker(0, stages, layout, params0, tx, num_inflight, 0,
                                param_server.LocalPSClient(server, 0), source.get, num_virtual_workers=1,
                                task_time_s=task_time_s)


def host_overhead(data_dir, n, nm) -> dict:
  warm = _build(data_dir, 1, nm)
  warm.run(nm * 2)  # compiles every stage function
  stats = _build(data_dir, 1, nm, stages=warm.stages).run(n)
  per_task = lambda seconds: 1e6 * seconds / stats.num_tasks  # noqa: E731
  return {
      "host_overhead_us_per_task": per_task(stats.host_busy_s - stats.update_s - stats.sync_s - stats.inject_s),
      "scheduler_thread_busy_us_per_task": per_task(stats.host_busy_s),
      "weight_update_and_push_us_per_task": per_task(stats.update_s),
      "pull_install_us_per_task": per_task(stats.sync_s),
      "inject_us_per_task": per_task(stats.inject_s),
      "executor_dispatch_us_per_task": per_task(stats.dispatch_s),
      "wall_us_per_task": per_task(stats.wall_time_s),
      "num_tasks": stats.num_tasks,
      "note": "CPU backend: XLA runs small computations inline in the calling thread, so update/pull times include "
              "their compute; host_overhead excludes them (scheduling + handing tasks to stage executors)",
  }


def emulated_vs_engine(data_dir, n, nm, stage_ms) -> dict:
  """Steady minibatches/s of a 4-stage VW whose tasks are padded to ``uniform_task_times(stage_ms, 0.5)`` against
  the engine's prediction for the same task times (``engine_report.steady_rates``'s per-VW rule on both sides:
  completions after the first wave over the time from its end to the last completion)."""
  from hetpipe_jax.sim import engine
  from hetpipe_jax.sim import engine_report
  from hetpipe_jax.sim import task_times
  times = task_times.uniform_task_times([float(t) for t in stage_ms], fwd_fraction=0.5)
  warm = _build(data_dir, 32, nm)
  warm.run(nm * 2)  # compiles every stage function, the update and the pull rebase
  vw = _build(data_dir, 32, nm, task_time_s=times.task_duration_s, stages=warm.stages)
  stats = vw.run(n)
  measured_times = sorted(r.complete_time_s for r in vw.records)
  (measured,), _, _ = engine_report.steady_rates([measured_times], nm)
  report = engine.run([times], engine.EngineConfig(num_waves=n // nm, num_inflight=nm, staleness_bound=0))
  predicted = report.vws[0].minibatches_per_s
  return {
      "stage_ms": [float(t) for t in stage_ms],
      "fwd_fraction": 0.5,
      "shortest_task_ms": 1e3 * min(min(times.forward_s), min(times.backward_s), times.forward_backward_s),
      "num_inflight": nm,
      "num_minibatches": n,
      "measured_mb_per_s": measured,
      "predicted_mb_per_s": predicted,
      "ratio": measured / predicted,
      "goal_ratio": 0.93,
      "num_overruns": stats.num_overruns,
      "overrun_s": stats.overrun_s,
      "wall_s": stats.wall_time_s,
  }


def launch_costs(repeats: int = 300) -> dict:
  """Single-threaded per-call costs of the trivial stage functions: jit launch (with its tiny compute) and the
  explicit device_put of an activation (a transfer), so the threaded run's executor time can be read."""
  import time
  import jax
  import jax.numpy as jnp
  import optax
  from hetpipe_jax import models
  from hetpipe_jax.runtime import stages as stages_lib
  spec = models.get_model("mlp_tiny")
  params = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  ranges = [(0, 1), (1, 2), (2, 3), (3, 4)]
  stages = stages_lib.build_stages(spec, ranges, jax.devices()[:4], optax.sgd(0.1))
  p1 = jax.device_put(list(params[1:2]), stages[1].device)
  h = jax.device_put(jnp.ones((1, 784)), stages[1].device)
  out, vjp = stages[1].forward(p1, h)

  def per_call_us(fn):
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(repeats):
      r = fn()
    jax.block_until_ready(r)
    return 1e6 * (time.perf_counter() - t0) / repeats

  return {"forward_launch_us": per_call_us(lambda: stages[1].forward(p1, h)),
          "backward_launch_us": per_call_us(lambda: stages[1].backward(vjp, out)),
          "device_put_us": per_call_us(lambda: jax.device_put(out, stages[2].device))}


def main(argv):
  del argv
  from hetpipe_jax.data import synthetic
  nm = _NUM_INFLIGHT.value
  quick = _QUICK.value
  minibatches, emulated = (2 * nm, 3 * nm) if quick else (_MINIBATCHES.value, _EMULATED_MINIBATCHES.value)
  with tempfile.TemporaryDirectory(prefix="bench_runtime_") as tmp:
    data_dir = synthetic.write_synthetic_fashion_mnist(tmp, 2048, 64)
    result = {"quick": quick,
              "host_overhead": host_overhead(data_dir, minibatches, nm),
              "single_thread_launch": launch_costs(20 if quick else 300),
              "emulated_vs_engine": emulated_vs_engine(data_dir, emulated, nm, _STAGE_MS.value)}
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  app.run(main)
