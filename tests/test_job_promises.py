"""Promises of the job settings, each against a hand-computed or closed-form oracle: the cosine learning rate, the
whole-wave run length from ``num_epochs``, the evaluation cadence, emulated devices (``emulate_stage_ms`` overruns,
``emulate_plan`` through the cost model), ``stage_devices``, the task trace, and virtual time from a plan."""

import dataclasses
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import default, tiny
from hetpipe_jax import models
from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import profile_format
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.jobs import checkpoint, job_config, run_context, training_setup, virtual_job
from hetpipe_jax.jobs.job_config import ConfigError
from hetpipe_jax.planning import plan_format, planner
from hetpipe_jax.planning import plan_times
from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.runtime.param_layout import ParamLayout
from hetpipe_jax.runtime.stage_executor import OVERRUN_TOLERANCE_S
from hetpipe_jax.sim import engine
from tests.mpi_util import check_task_trace, excess_over_stage_ms, read_jsonl, run_job, vw_start_times
from tests.replay import read_applied_order, replay_final_weights

KINDS = {"F": TaskKind.FORWARD, "B": TaskKind.BACKWARD, "FB": TaskKind.FORWARD_BACKWARD}


def _make_optimizer(config, num_minibatches):
  return training_setup.make_optimizer(job_config.resolve_job(config).optim, num_minibatches)


def _config(base=tiny, **overrides):
  c = base.get_config()
  c.update({"check_counts": False, "progress": False, **overrides})
  return c


def _cosine_lr(lr: float, step: int, num_steps: int) -> float:
  """Cosine decay from ``lr`` at step 0 to 0 at step ``num_steps`` (and after)."""
  return lr * 0.5 * (1.0 + math.cos(math.pi * min(step, num_steps) / num_steps))


# ---------------------------------------------------------------- learning-rate schedule

@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("schedule", ["cosine", "constant", "warmup_cosine"])
def test_learning_rate_schedule_follows_its_closed_form(optimizer, schedule):
  """With a constant gradient of 1 the update of step k is ``-lr_k * base_k``: base 1 (SGD), the momentum trace
  ``sum_{j<=k} 0.9^j``, Adam's ``1 / (1 + eps)``; cosine ``lr_k`` reaches 0 after the VW's ``n`` minibatches."""
  n, lr = 8, 0.1
  warmup = 3 if schedule == "warmup_cosine" else 0
  tx = _make_optimizer(_config(optimizer=optimizer, learning_rate=lr, lr_schedule=schedule,
                                      warmup_minibatches=warmup), n)
  params = {"w": jnp.zeros((), jnp.float32)}
  state = tx.init(params)
  got = []
  for _ in range(n + 2):
    updates, state = tx.update({"w": jnp.ones((), jnp.float32)}, state, params)
    got.append(-float(updates["w"]))
  base = {"sgd": [1.0] * (n + 2), "momentum": [sum(0.9 ** j for j in range(k + 1)) for k in range(n + 2)],
          "adam": [1.0 / (1.0 + 1e-8)] * (n + 2)}[optimizer]
  rates = {"cosine": [_cosine_lr(lr, k, n) for k in range(n + 2)], "constant": [lr] * (n + 2),
           # linear from 0 over the warm-up, then cosine over the remaining n - warmup steps
           "warmup_cosine": [lr * k / warmup if k < warmup else _cosine_lr(lr, k - warmup, n - warmup)
                             for k in range(n + 2)]}[schedule]
  np.testing.assert_allclose(got, [r * b for r, b in zip(rates, base)], rtol=1e-5, atol=1e-8)
  if schedule != "constant":
    assert got[n - 1] > 0 and abs(got[n]) < 1e-8 and abs(got[n + 1]) < 1e-8


def test_adam_betas_and_gradient_clipping_follow_their_closed_form():
  """``adam_b1`` / ``adam_b2`` reach optax.adam: for gradients g_k the update is ``-lr * m_k / (sqrt(v_k) + eps)``
  with bias-corrected moments of decay b1, b2 (Kingma & Ba, Alg. 1); ``grad_clip_norm`` first scales a gradient of
  larger global norm down to that norm."""
  lr, b1, b2, eps = 0.1, 0.5, 0.99, 1e-8
  grads = [3.0, -1.0, 2.0, 0.5]
  tx = _make_optimizer(_config(learning_rate=lr, lr_schedule="constant", adam_b1=b1, adam_b2=b2), 10)
  params = {"w": jnp.zeros((), jnp.float32)}
  state = tx.init(params)
  m = v = 0.0
  for k, g in enumerate(grads, start=1):
    updates, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, params)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    want = -lr * (m / (1 - b1 ** k)) / (math.sqrt(v / (1 - b2 ** k)) + eps)
    assert float(updates["w"]) == pytest.approx(want, rel=1e-5)
  # Clipping to global norm 1 over two stages (grad_clip_norm, issue 23): stage A's gradient 3 and stage B's 4 make a
  # global norm of 5, so SGD's updates are -lr * (0.6, 0.8) on the two stages; a gradient already inside the norm
  # passes unchanged. make_optimizer itself does not clip (a per-stage chain would clip each stage by its own norm).
  from hetpipe_jax.runtime import grad_clip
  tx = _make_optimizer(_config(optimizer="sgd", learning_rate=lr, lr_schedule="constant",
                                      grad_clip_norm=1.0), 10)
  for g, want in (((3.0, 4.0), (0.06, 0.08)), ((0.3, 0.4), (0.03, 0.04))):
    norm = grad_clip.global_norm([float(grad_clip.stage_sq_norm({"w": jnp.asarray(x)})) for x in g])
    assert norm == pytest.approx(math.hypot(*g), rel=1e-6)
    got = []
    for x in g:
      params = {"w": jnp.zeros(())}
      updates, _ = tx.update(grad_clip.clip({"w": jnp.asarray(x)}, norm, 1.0), tx.init(params), params)
      got.append(-float(updates["w"]))
    np.testing.assert_allclose(got, want, rtol=1e-5)
  params = {"w": jnp.zeros(())}
  updates, _ = tx.update({"w": jnp.asarray(3.0)}, tx.init(params), params)
  assert -float(updates["w"]) == pytest.approx(0.3, rel=1e-6)  # no clip in the optimizer itself


# ---------------------------------------------------------------- run length and evaluation cadence

# (num_train, num_vws, batch_size, Nm, num_epochs, num_minibatches) -> minibatches per VW, worked by hand:
# a VW's shard is num_train // N examples, an epoch is shard // batch minibatches per VW, the run is
# int(num_epochs * that) rounded down to a multiple of Nm; num_minibatches > 0 replaces the epochs.
RUN_LENGTHS = [
    ((512, 2, 32, 3, 2.5, 0), 18),  # 256 // 32 = 8 per epoch, 2.5 epochs = 20, down to 18 (6 waves of 3)
    ((512, 2, 32, 2, 2.5, 0), 20),  # 20 is whole waves of 2
    ((1000, 3, 32, 4, 1.0, 0), 8),  # 333 // 32 = 10, down to 8
    ((512, 2, 32, 1, 0.3, 0), 2),  # int(8 * 0.3) = int(2.4) = 2
    ((512, 2, 32, 1, 0.7, 0), 5),  # int(5.6) = 5: truncated, not rounded
    ((512, 2, 32, 3, 0.375, 0), 3),  # exactly one wave
    ((60000, 2, 64, 2, 5.0, 0), 2340),  # the default config: 30000 // 64 = 468 per epoch, 5 epochs
    ((512, 2, 32, 4, 5.0, 10), 8),  # num_minibatches wins over num_epochs, rounded down to whole waves
    ((512, 2, 32, 3, 5.0, 40), 39),
]


@pytest.mark.parametrize("args,expected", RUN_LENGTHS)
def test_minibatches_per_vw_rounds_down_to_whole_waves(args, expected):
  num_train, num_vws, batch, nm, epochs, mb = args
  config = _config(num_virtual_workers=num_vws, batch_size=batch, num_inflight=nm, num_epochs=epochs,
                   num_minibatches=mb)
  got = run_context.minibatches_per_vw(job_config.resolve_job(config), num_train)
  assert got == expected


@pytest.mark.parametrize("epochs,mb", [(0.25, 0), (5.0, 2)])  # int(8 * 0.25) = 2 and 2 minibatches: under Nm = 3
def test_fewer_than_one_wave_is_an_error(epochs, mb):
  config = _config(num_virtual_workers=2, batch_size=32, num_inflight=3, num_epochs=epochs, num_minibatches=mb)
  with pytest.raises(ConfigError, match=r"fewer than one wave \(3 minibatches\) per VW"):
    run_context.minibatches_per_vw(job_config.resolve_job(config), 512)


@pytest.mark.parametrize("warmup,ok", [(5, True), (6, False), (7, False)])  # 6 minibatches per VW (Nm = 3)
def test_a_warmup_as_long_as_the_run_is_an_error(warmup, ok):
  config = _config(num_virtual_workers=2, batch_size=32, num_inflight=3, num_minibatches=6,
                   lr_schedule="warmup_cosine", warmup_minibatches=warmup)
  if ok:
    assert run_context.minibatches_per_vw(job_config.resolve_job(config), 512) == 6
    return
  with pytest.raises(ConfigError, match=rf"config.warmup_minibatches={warmup} is not shorter than the run's 6 "):
    run_context.minibatches_per_vw(job_config.resolve_job(config), 512)


# (num_train, num_vws, batch_size, Nm, eval_every_epochs) -> global-clock ticks between evaluations, by hand:
# an epoch is (num_train // N // batch) / Nm waves; round(eval_every_epochs * that), at least 1; 0 = only at the end.
EVAL_CADENCES = [
    ((512, 2, 32, 3, 0.6), 2),  # 8 / 3 waves per epoch; 0.6 * 8 / 3 = 1.6 -> 2
    ((512, 2, 32, 2, 1.0), 4),
    ((512, 2, 32, 2, 0.01), 1),  # 0.04 rounds to 0, raised to 1
    ((60000, 2, 64, 2, 1.0), 234),  # the default config: 468 / 2
    ((512, 2, 32, 2, 0.0), 0),
]


@pytest.mark.parametrize("args,expected", EVAL_CADENCES)
def test_eval_every_waves_from_epochs(args, expected):
  num_train, num_vws, batch, nm, every = args
  config = _config(num_virtual_workers=num_vws, batch_size=batch, num_inflight=nm, eval_every_epochs=every)
  got = run_context.eval_every_waves(job_config.resolve_job(config), num_train)
  assert got == expected


# ---------------------------------------------------------------- one MPI run, many promises

@pytest.mark.mpi
def test_mpi_run_length_eval_cadence_cosine_overruns_and_stage_devices(tmp_path, synthetic_data_dir):
  """2 VWs on 512 training examples, batch 32, Nm 3: 2.5 epochs are 18 minibatches per VW (6 waves); evaluations
  every round(0.6 * 8 / 3) = 2 waves; cosine SGD over the 18 minibatches; stage 0 on device 1; emulated tasks of
  1 microsecond, so every task that really takes over the tolerance is an overrun."""
  nm, mb, lr = 3, 18, 0.1
  workdir = tmp_path / "run"
  proc = run_job(workdir, 3, {"data_dir": synthetic_data_dir, "num_minibatches": 0, "num_epochs": 2.5,
                              "num_inflight": nm, "batch_size": 32, "eval_every_epochs": 0.6, "log_every_waves": 5,
                              "optimizer": "sgd", "learning_rate": lr, "lr_schedule": "cosine",
                              "stage_devices": "1,0", "emulate_stage_ms": "0.001,0.001", "save_task_trace": True})
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  config = json.loads((workdir / "config.json").read_text())
  assert summary["num_minibatches_per_vw"] == mb and summary["global_clock"] == mb // nm
  assert config["stage_devices"] == "1,0"
  assert [summary["per_vw"][v]["stage_devices"] for v in ("0", "1")] == [[1, 0], [1, 0]]  # where stages ran
  # Evaluation cadence: test accuracy exactly at global clocks 2, 4, 6, then the final evaluation; the line at
  # clock 5 is the log_every_waves line, without accuracy.
  metrics = read_jsonl(workdir / "metrics.jsonl")
  assert [(m["global_clock"], "test_accuracy" in m) for m in metrics] == [
      (2, True), (4, True), (5, False), (6, True), (6, True)]
  assert [e["global_clock"] for e in summary["evaluations"]] == [2, 4, 6]
  # Overruns: an overrun is real work beyond the emulated end by more than the tolerance; with 1 us durations no
  # task sleeps, so a task that ended far later than that overran (the first tasks compile), and an overrun task
  # ended more than the tolerance late.
  for v, times in enumerate(check_task_trace(workdir, 2, 2, mb)):
    excess = excess_over_stage_ms(times, [0.001, 0.001])
    stats = summary["per_vw"][str(v)]
    assert stats["num_tasks"] == len(excess) == 3 * mb
    late = sum(e > OVERRUN_TOLERANCE_S for e in excess)
    surely_late = sum(e > 0.1 for e in excess)  # 100 ms: beyond any thread wake-up delay (the compiling tasks)
    assert max(1, surely_late) <= stats["num_overruns"] <= late, stats
    assert stats["overrun_s"] > 0
  # Cosine learning rate: replaying the recorded versions with SGD at lr_k = cos-decay(k over 18 minibatches of
  # each VW) gives the run's final weights.
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, 2, v, 32, 0) for v in range(2)]
  tx = optax.sgd(lambda k: lr * 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.minimum(k, mb) / mb)))
  expected = replay_final_weights(read_jsonl(workdir / "minibatches.jsonl"), spec, params0, tx, sources, nm,
                                  read_applied_order(workdir))
  actual = ParamLayout.from_layer_params(params0).flatten(checkpoint.restore_weights(workdir / "checkpoint"))
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- plans: emulated in MPI, virtual time

def _slow_cpu_plan(tmp_path) -> str:
  """A plan for the default CNN on ``local_cpu`` with GPU types 5x below its nominal peak: roofline task times of
  about 70-190 ms, above the real work of 10-60 ms, so emulated tasks are visibly padded to the cost model."""
  spec = json.loads(pathlib.Path(cluster_lib.CLUSTER_DIR, "local_cpu.json").read_text())
  path = tmp_path / "slow_cpu.json"
  spec["name"] = str(path)  # the plan names its cluster; a path is loaded as it is
  for gpu_type in spec["gpu_types"]:
    gpu_type.pop("measured_device_kind")  # roofline from the profile's FLOPs and bytes, not the host's timings
    gpu_type["peak_fp32_flops_per_s"] = gpu_type["peak_fp16_flops_per_s"] = 1e10
  path.write_text(json.dumps(spec))
  profile = profile_format.load_profile(profile_format.default_profile_path("cnn", 64, "cpu", True))
  plan = planner.make_plan(cluster_lib.load_cluster(str(path)), profile, planner.PlannerConfig(policy="ED", num_vws=2))
  plan_path = str(tmp_path / "slow_plan.json")
  plan_format.write_plan(plan, plan_path)
  return plan_path


@pytest.mark.mpi
def test_emulate_plan_pads_every_task_to_the_plans_cost_model(tmp_path, synthetic_data_dir):
  """``emulate_plan=True``: every task lasts at least the cost model's time for the plan's GPU type, every stage at
  least the plan's stage time per minibatch, and the run at least the engine's makespan for those task times."""
  plan_path = _slow_cpu_plan(tmp_path)
  plan = plan_format.load_plan(plan_path, expected_model="cnn")
  num_vws, nm = len(plan.virtual_workers), plan.num_inflight
  mb = 2 * nm
  workdir = tmp_path / "run"
  proc = run_job(workdir, 1 + num_vws, {"data_dir": synthetic_data_dir, "num_minibatches": mb, "plan": plan_path,
                                        "emulate_plan": True, "save_task_trace": True},
                 config="experiments/configs/default.py")
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  times = plan_times.task_times_from_plan(plan, plan_times.profile_for_plan(plan),
                                          cluster_lib.load_cluster(plan.cluster))
  traces = check_task_trace(workdir, num_vws, times[0].num_stages, mb)
  for v, (vw_times, trace) in enumerate(zip(times, traces)):
    stage_ms = plan.virtual_workers[v].stage_time_ms
    for (s, kind, p), (start, end) in trace.items():  # each task lasts at least its cost-model duration
      assert end - start >= vw_times.task_duration_s(Task(s, KINDS[kind], p)) - 1e-9, (v, s, kind, p)
    for s, planned_ms in enumerate(stage_ms):  # a stage's tasks of one minibatch last at least the plan's stage time
      for p in range(mb):
        busy = sum(end - start for (st, _, q), (start, end) in trace.items() if st == s and q == p)
        assert busy >= planned_ms / 1000 - 1e-6, (v, s, p, busy, planned_ms)
    # A stage handles one minibatch at a time: the VW takes at least num_minibatches x its slowest stage time.
    assert summary["per_vw"][str(v)]["wall_time_s"] >= mb * max(stage_ms) / 1000
  # The whole run lasts at least the engine's makespan for the same task times (the runtime does not pad PS
  # transfers, so the engine gets none).
  no_ps = [dataclasses.replace(t, push_s=0.0, pull_s=0.0, push_legs=None, pull_legs=None) for t in times]
  report = engine.run(no_ps, engine.EngineConfig(num_waves=mb // nm, num_inflight=nm, staleness_bound=1))
  starts = vw_start_times(summary)
  span = (max(starts[v] + summary["per_vw"][str(v)]["wall_time_s"] for v in starts) - min(starts.values()))
  assert span >= report.makespan_s


def test_virtual_mode_from_a_plan_runs_the_engines_schedule_of_the_plans_task_times(tmp_path, synthetic_data_dir):
  """``--mode=virtual`` with a plan: every minibatch's simulated injection and completion time, and its weight
  version's clocks, are the engine's for the plan's cost-model task times (test_entry_points runs the CLI)."""
  config = _config(default, data_dir=str(synthetic_data_dir), num_minibatches=4, eval_every_epochs=0.0)
  settings = job_config.resolve_job(config, "virtual")
  plan = settings.plan
  summary = virtual_job.run(settings, str(tmp_path))
  times = plan_times.task_times_from_plan(plan, plan_times.profile_for_plan(plan),
                                          cluster_lib.load_cluster(plan.cluster))
  report = engine.run(times, engine.EngineConfig(num_waves=4 // plan.num_inflight, num_inflight=plan.num_inflight,
                                                 staleness_bound=config.staleness_bound))
  assert summary["simulated_time_s"] == report.makespan_s
  assert summary["simulated_time_s"] >= 4 * max(max(vw.stage_time_ms) for vw in plan.virtual_workers) / 1000
  keys = ("inject_time_s", "complete_time_s", "local_clock_at_injection", "version_global_clock")
  recorded = {(r["vw_id"], r["minibatch_id"]): [r[k] for k in keys] for r in read_jsonl(tmp_path / "minibatches.jsonl")}
  assert recorded == {(r.vw_id, r.minibatch_id): [getattr(r, k) for k in keys] for r in report.minibatch_records}
