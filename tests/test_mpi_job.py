"""End-to-end MPI runs of ``hetpipe_jax.train``: outputs, WSP guarantees, the BSP oracle, and bad input."""

import json
import pathlib

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.jobs import checkpoint
from hetpipe_jax.rules import wsp
from hetpipe_jax.runtime.stage_executor import OVERRUN_TOLERANCE_S
from tests.mpi_util import (THREE_RANK_RUN, check_task_trace, excess_over_stage_ms, max_clock_distance, read_jsonl,
                             run_job, vw_start_times)
from tests.pipeline_util import assert_params_close, loss_and_grad

pytestmark = pytest.mark.mpi


def _check_wsp(workdir, num_vws, num_minibatches, num_inflight, bound, reach=True):
  """Checks the WSP guarantees of a finished run; ``reach``: the bound D was also reached, not only respected.

  Reached means some minibatch ran at global staleness exactly D (``local_clock_at_injection -
  version_global_clock``) and the fastest VW was D + 1 waves ahead of the slowest at some moment (from the
  records' wave-end completion times). Runs whose VWs keep the same pace pass ``reach=False``.
  """
  summary = json.loads((workdir / "summary.json").read_text())
  records = read_jsonl(workdir / "minibatches.jsonl")
  assert len(records) == num_vws * num_minibatches
  num_waves = num_minibatches // num_inflight
  # The PS applied every pushed wave exactly once, each VW's in wave order (clock_aligned: wave by wave, VW by VW).
  applied = [(a["wave_id"], a["vw_id"]) for a in read_jsonl(workdir / "ps_applied.jsonl")]
  assert sorted(applied) == [(w, v) for w in range(num_waves) for v in range(num_vws)]
  assert all([w for w, u in applied if u == v] == list(range(num_waves)) for v in range(num_vws))
  if summary["ps_apply"] == "clock_aligned":
    assert applied == [(w, v) for w in range(num_waves) for v in range(num_vws)]
  assert summary["applied_waves_count"] == num_waves * num_vws and summary["applied_waves_in_order"] is True
  assert summary["global_clock"] == num_waves
  for r in records:
    # The weights' vector clock: one entry per VW, its minimum the global clock, never ahead of the PS's log.
    vc = r["version_vector_clock"]
    assert len(vc) == num_vws and min(vc) == r["version_global_clock"] and max(vc) <= num_waves, r
    # Global bound: weights include every VW's waves 0..c-D-1 (pulled at global clock >= c - D).
    assert r["version_global_clock"] >= r["local_clock_at_injection"] - bound, r
    # Local bound: minibatch p includes the VW's own updates 0..p-Nm.
    assert r["version_local_updates"] >= r["minibatch_id"] - num_inflight + 1, r
    assert r["local_clock_at_injection"] >= (r["minibatch_id"] + 1) // num_inflight - 1
    assert r["wave_id"] == wsp.wave_of(r["minibatch_id"], num_inflight)
  staleness = [r["local_clock_at_injection"] - r["version_global_clock"] for r in records]
  distance = max_clock_distance(records, num_inflight, vw_start_times(summary))
  assert max(staleness) <= bound and distance <= bound + 1
  if reach:
    assert max(staleness) == bound, f"no minibatch ran at global staleness D={bound}: {sorted(set(staleness))}"
    assert distance == bound + 1, f"the clock distance reached {distance}, never D + 1 = {bound + 1}"
  return summary, records


def test_three_rank_run_writes_every_output(three_rank_run):
  assert THREE_RANK_RUN == {"num_minibatches": 24, "num_inflight": 2, "staleness_bound": 1, "eval_every_epochs": 1.0}
  workdir = three_rank_run  # tests/conftest.py's: 1 PS + 2 VWs
  for name in ["config.json", "metrics.jsonl", "minibatches.jsonl", "summary.json", "checkpoint"]:
    assert (workdir / name).exists(), name
  summary, _ = _check_wsp(workdir, 2, 24, 2, 1, reach=False)  # two VWs at the same pace
  for key in ["test_accuracy", "num_minibatches", "wall_time_s", "minibatches_per_s", "num_virtual_workers",
              "num_stages", "num_inflight", "staleness_bound", "wait_s", "idle_s"]:
    assert key in summary, key
  assert summary["num_minibatches"] == 48 and summary["num_virtual_workers"] == 2
  assert set(summary["wait_s"]) == set(summary["idle_s"]) == {"0", "1"}
  metrics = read_jsonl(workdir / "metrics.jsonl")
  assert metrics[-1]["test_accuracy"] == summary["test_accuracy"]
  for line in metrics[:-1]:
    assert {"minibatches", "wave", "global_clock", "loss", "wall_time_s", "minibatches_per_s"} <= set(line)
  # the run's final line (runtime/clock_log.py, every driver's): after the final evaluation, not a wave's end
  assert "wave" not in metrics[-1] and metrics[-1]["minibatches"] == 48 and metrics[-1]["global_clock"] == 12
  assert {"loss", "wall_time_s", "minibatches_per_s", "test_loss"} <= set(metrics[-1])
  # Every stage function compiled once on every VW.
  for vw_counts in summary["trace_counts"].values():
    assert all(c == 1 for stage in vw_counts.values() for c in stage.values()), vw_counts
  restored = checkpoint.restore_weights(workdir / "checkpoint")
  assert len(restored) == models.get_model("mlp_tiny").num_layers


@pytest.mark.parametrize("bound,pull_every_wave", [(1, False), (2, True)])
def test_wsp_bound_holds_and_is_reached_with_three_vws(tmp_path, synthetic_data_dir, bound, pull_every_wave):
  """VW 2 is 10x slower, so the fast VWs run D waves ahead and wait: staleness D and clock distance D + 1 occur.

  The same run backs the task trace (every task once, in order, padded to its emulated duration) and the overrun
  count (an overrun is a task whose real work outlasted its duration by more than the tolerance, so it ended more
  than the tolerance late: with these long durations only the first tasks, which compile, and scheduling jitter).
  """
  stage_ms = [[4, 4], [4, 4], [40, 40]]
  workdir = tmp_path / "run"
  proc = run_job(workdir, 4, {"data_dir": synthetic_data_dir, "num_virtual_workers": 3, "num_minibatches": 30,
                              "num_inflight": 3, "staleness_bound": bound, "pull_every_wave": pull_every_wave,
                              "batch_size": 16, "emulate_stage_ms": "4,4;4,4;40,40", "save_task_trace": True})
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary, _ = _check_wsp(workdir, 3, 30, 3, bound)
  for v, times in enumerate(check_task_trace(workdir, 3, 2, 30)):
    excess = excess_over_stage_ms(times, stage_ms[v])
    assert min(excess) >= -1e-9  # every task lasted at least its emulated duration
    stats = summary["per_vw"][str(v)]
    assert stats["num_tasks"] == len(excess) == 90
    assert stats["num_overruns"] <= sum(e > OVERRUN_TOLERANCE_S for e in excess), (stats, sorted(excess))


def test_oracle3_bsp_equals_synchronous_data_parallelism(tmp_path, synthetic_data_dir):
  num_vws, steps, lr, batch = 2, 8, 0.1, 16
  workdir = tmp_path / "run"
  proc = run_job(workdir, 1 + num_vws, {"data_dir": synthetic_data_dir, "num_virtual_workers": num_vws,
                                        "num_minibatches": steps, "num_inflight": 1, "staleness_bound": 0,
                                        "optimizer": "sgd", "learning_rate": lr, "batch_size": batch})
  assert proc.returncode == 0, proc.stderr[-3000:]
  _check_wsp(workdir, num_vws, steps, 1, 0)
  # Reference: every step, all VWs take gradients at the same weights; the N SGD updates are added in VW order.
  spec = models.get_model("mlp_tiny")
  params = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, num_vws, v, batch, 0) for v in range(num_vws)]
  grad_fn = loss_and_grad(spec)
  tx = optax.sgd(lr)
  for step in range(steps):
    updates = []
    for src in sources:
      _, g = grad_fn(params, *src.get(step))
      updates.append(tx.update(g, tx.init(params), params)[0])
    for u in updates:
      params = jax.device_get(optax.apply_updates(params, u))
  assert_params_close(checkpoint.restore_weights(workdir / "checkpoint"), params)


TINY, DEFAULT = "experiments/configs/tiny.py", "experiments/configs/default.py"
BAD_INPUTS = [
    ({"num_inflight": 0}, 3, "num_inflight", TINY),
    ({"staleness_bound": -1}, 3, "staleness_bound", TINY),
    ({"num_stages": 3, "num_cpu_devices": 2}, 3, "num_stages", TINY),
    ({"partition": "0:1,2:4"}, 3, "does not cover every layer exactly once", TINY),
    ({}, 2, "MPI world size is 2", TINY),
    ({"model": "no_such_model"}, 3, "unknown model 'no_such_model'", TINY),
    # A plan-decided setting that disagrees with the default config's plan names both values (it used to be
    # dropped silently).
    ({"partition": "0:3,3:7"}, 3,
     "config.partition='0:3,3:7' but the plan experiments/plans/local_cpu_cnn_b64.json has partition '0:2,2:7'",
     DEFAULT),
    ({"num_inflight": 65}, 3, "config.num_inflight=65 exceeds the plan's Max_m=64", DEFAULT),
    ({"num_virtual_workers": 3}, 4, "config.num_virtual_workers=3 but the plan", DEFAULT),
    # A plan made for another model, or for another batch size, through the job path.
    ({"model": "mlp_tiny"}, 3, "was made for model 'cnn', not for model 'mlp_tiny'", DEFAULT),
    ({"batch_size": 32}, 3, "the plan was made for batch size 64 but config.batch_size=32", DEFAULT),
    # Stage devices: one index per stage, and as many local devices as the largest index needs.
    ({"ps_apply": "eventually"}, 3, "config.ps_apply='eventually' must be 'on_receipt' (HetPipe §5", TINY),
    # A PS setting for an all-reduce method (no PS) is refused, not ignored and recorded (issue 23 defect 3).
    ({"method": "gpipe", "num_ps_shards": 2}, 2,
     "config.num_ps_shards=2 sets the parameter-server shards, which config.method='gpipe' does not use", TINY),
    # A PS shard that would hold no parameters (4 shards, mlp_tiny's 3 layers with parameters; issue 23 defect 6).
    ({"num_ps_shards": 4, "checkpoint_every_waves": 0}, 6,
     "config.num_ps_shards=4: PS shard 3 would hold no parameters (the model has 3 layers with parameters", TINY),
    # Muon for a model without 2-D hidden weights, refused before any work on every rank (sharded PS included;
    # issue 25 item 1).
    ({"model": "resnet", "optimizer": "muon", "num_ps_shards": 2, "checkpoint_every_waves": 0}, 4,
     "config.optimizer='muon': model 'resnet' has no 2-D hidden weights", TINY),
    ({"stage_devices": "0,-1"}, 3, "config.stage_devices='0,-1' must be non-negative device indices", TINY),
    ({"stage_devices": "0"}, 3, "config.stage_devices lists 1 devices for 2 stages", TINY),
    ({"stage_devices": "0,2", "num_cpu_devices": 2}, 3,
     "2 stages need 3 local devices per VW but only 2 cpu device(s) exist", TINY),
    # The all-reduce methods: one rank per VW and no PS; Horovod keeps the whole model on one device.
    ({"method": "gpipe", "num_inflight": 2}, 3, "MPI world size is 3 but the job has 2 virtual workers "
     "(config.num_virtual_workers): run `mpiexec -n 2 ...` (one rank per VW: config.method='gpipe' has no PS)", TINY),
    ({"method": "horovod", "num_stages": 2}, 2,
     "config.method='horovod' holds the whole model on one device per worker: num_stages must be 1", TINY),
]
# Virtual time runs in one process: under mpiexec it stops with one error on every rank.
BAD_INPUTS = [(*b, ()) for b in BAD_INPUTS] + [
    ({"emulate_stage_ms": "10,10"}, 3, "--mode=virtual runs in one process; launch it without mpiexec (world size "
     "is 3)", TINY, ("--mode=virtual",)),
]


# Under mpiexec: one case of each kind of check (the settings before jax starts, the world size, a sharded PS's
# layout after the data is read, the process's own device count, the mode). Every case of BAD_INPUTS runs on every
# rank of its world, in one process, in tests/test_train_checks.py.
MPI_BAD_INPUTS = [b for b in BAD_INPUTS if b[2] in (
    "num_inflight", "MPI world size is 2",
    "config.num_ps_shards=4: PS shard 3 would hold no parameters (the model has 3 layers with parameters",
    "2 stages need 3 local devices per VW but only 2 cpu device(s) exist",
    "--mode=virtual runs in one process; launch it without mpiexec (world size is 3)")]
assert len(MPI_BAD_INPUTS) == 5


@pytest.mark.parametrize("overrides,num_ranks,message,config,extra_args", MPI_BAD_INPUTS)
def test_bad_input_fails_fast_on_every_rank(tmp_path, synthetic_data_dir, overrides, num_ranks, message, config,
                                            extra_args):
  workdir = tmp_path / "run"
  proc = run_job(workdir, num_ranks, {"data_dir": synthetic_data_dir, **overrides}, config=config, timeout=120,
                 extra_args=extra_args)
  assert proc.returncode != 0
  assert message in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.count("error:") == 1  # one clear message, not one per rank
  assert not (workdir / "summary.json").exists()


@pytest.mark.parametrize("ps_apply", ["on_receipt", "clock_aligned"])
def test_multi_vw_run_equals_sequential_replay_of_its_versions(tmp_path, synthetic_data_dir, ps_apply):
  """N VWs of unequal speeds, Nm > 1, D > 0: the final global weights equal a one-device replay of the recorded
  versions (vector clocks) and the PS's logged order. on_receipt (HetPipe §5): some minibatches really used faster
  VWs' newer waves (extra updates); clock_aligned: none did."""
  from tests.replay import read_applied_order, replay_final_weights
  num_vws, nm, mb, batch = 3, 2, 16, 16
  workdir = tmp_path / "run"
  proc = run_job(workdir, 1 + num_vws, {"data_dir": synthetic_data_dir, "num_virtual_workers": num_vws,
                                        "num_minibatches": mb, "num_inflight": nm, "staleness_bound": 1,
                                        "optimizer": "momentum", "learning_rate": 0.05, "batch_size": batch,
                                        "emulate_stage_ms": "5,5;10,10;20,20", "ps_apply": ps_apply})
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary, records = _check_wsp(workdir, num_vws, mb, nm, 1, reach=False)  # D is reached in test_wsp_bound_...
  assert summary["ps_apply"] == ps_apply == json.loads((workdir / "config.json").read_text())["ps_apply"]
  assert any(r["version_global_clock"] < r["local_clock_at_injection"] for r in records)  # stale global weights
  extra = [wsp.extra_updates(r["version_vector_clock"], r["vw_id"]) for r in records]
  assert summary["extra_updates"]["minibatches_with_extra_updates"] == sum(e > 0 for e in extra)
  assert summary["extra_updates"]["max_extra_updates"] == max(extra)
  if ps_apply == "on_receipt":
    assert sum(e > 0 for e in extra) >= 2, extra  # the case under test happened
  else:
    assert max(extra) == 0 and summary["applied_clock_aligned"] is True
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, num_vws, v, batch, 0) for v in range(num_vws)]
  expected = replay_final_weights(read_jsonl(workdir / "minibatches.jsonl"), spec, params0,
                                  optax.sgd(0.05, momentum=0.9), sources, nm, read_applied_order(workdir))
  from hetpipe_jax.runtime.param_layout import ParamLayout
  actual = ParamLayout.from_layer_params(params0).flatten(checkpoint.restore_weights(workdir / "checkpoint"))
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_runs_from_a_planner_made_plan(tmp_path, synthetic_data_dir):
  from hetpipe_jax.planning import plan_format
  plan_path = "experiments/plans/local_cpu_cnn_b64.json"
  plan = plan_format.load_plan(plan_path, expected_model="cnn")
  workdir = tmp_path / "run"
  proc = run_job(workdir, 1 + len(plan.virtual_workers),
                 {"data_dir": synthetic_data_dir, "model": "cnn", "batch_size": 64,
                  "num_minibatches": 2 * plan.num_inflight, "plan": ""}, config=DEFAULT,
                 extra_args=(f"--plan={plan_path}",))
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["num_inflight"] == plan.num_inflight
  assert summary["partitions"] == {str(vw.vw_id): [list(r) for r in vw.partition] for vw in plan.virtual_workers}
  config = json.loads((workdir / "config.json").read_text())
  assert config["num_inflight"] == plan.num_inflight and config["setting_sources"]["num_inflight"] == "plan"


def test_num_inflight_given_with_a_plan_is_the_one_that_runs_and_is_recorded(tmp_path, synthetic_data_dir):
  """The value that runs is the value recorded: Nm = 4 over the plan's Nm = 2 (within its Max_m) runs with 4."""
  from hetpipe_jax.planning import plan_format
  plan_path = "experiments/plans/local_cpu_cnn_b64.json"
  plan = plan_format.load_plan(plan_path, expected_model="cnn")
  assert plan.num_inflight == 2
  nm, mb = 4, 8
  workdir = tmp_path / "run"
  proc = run_job(workdir, 1 + len(plan.virtual_workers),
                 {"data_dir": synthetic_data_dir, "model": "cnn", "batch_size": 64, "num_minibatches": mb,
                  "plan": plan_path, "num_inflight": nm}, config=DEFAULT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "overrides the plan's Nm=2" in proc.stderr
  summary = json.loads((workdir / "summary.json").read_text())
  config = json.loads((workdir / "config.json").read_text())
  assert summary["num_inflight"] == config["num_inflight"] == nm
  assert "overrides the plan's Nm=2" in config["setting_sources"]["num_inflight"]
  records = read_jsonl(workdir / "minibatches.jsonl")
  # Nm = 4 really ran: 4 minibatches per wave, and 4 in flight (minibatch 3 started before minibatch 0 completed).
  assert {r["wave_id"] for r in records if r["minibatch_id"] == 3} == {0}
  assert summary["global_clock"] == mb // nm
  for v in range(len(plan.virtual_workers)):
    by_id = {r["minibatch_id"]: r for r in records if r["vw_id"] == v}
    assert by_id[3]["inject_time_s"] < by_id[0]["complete_time_s"]
    assert by_id[3]["version_local_updates"] == 0


def test_an_exception_on_a_vw_rank_ends_the_job(tmp_path, synthetic_data_dir):
  workdir = tmp_path / "run"
  proc = run_job(workdir, 3, {"data_dir": synthetic_data_dir, "optimizer": "sgd", "learning_rate": 1e38,
                              "num_minibatches": 40}, timeout=120)
  assert proc.returncode != 0
  assert "training diverged" in proc.stderr, proc.stderr[-3000:]
  assert not (workdir / "summary.json").exists()


def test_a_launch_past_its_timeout_is_killed_and_its_error_holds_every_ranks_stacks(tmp_path, synthetic_data_dir):
  """The tests' launcher on a hang (here: a run much longer than its limit): every rank prints its threads' Python
  stacks (``hetpipe_jax.train`` registers faulthandler on SIGUSR1), the launch is killed, and the error carries the
  stacks, so a rare hang in CI can be read from its log; no rank outlives it."""
  from tests.mpi_util import descendants, run_job  # pylint: disable=g-import-not-at-top
  with pytest.raises(AssertionError, match=r"timed out after 12 s; its stderr, with the ranks' stacks") as e:
    run_job(tmp_path / "run", 3, {"data_dir": synthetic_data_dir, "num_minibatches": 2000, "num_inflight": 1,
                                  "emulate_stage_ms": "50,50", "checkpoint_every_waves": 0}, timeout=12)
  text = str(e.value)
  assert text.count("Current thread") + text.count("Thread 0x") >= 3, text[-3000:]  # at least one per rank
  assert "hetpipe_jax" in text and 'File "' in text
  assert not [p for p in descendants(1) if str(tmp_path / "run") in _cmdline(p)]  # this launch's ranks


def _cmdline(pid: int) -> str:
  """The command line of a live process ("" for a zombie or a process gone)."""
  try:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
      return ""
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
  except OSError:
    return ""
