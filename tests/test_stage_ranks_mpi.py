"""Stage ranks under mpiexec: 2 VWs x 3 stages on separate ranks with 2 PS shards (the replay oracle, WSP, every
shard applies every wave once), the same plan in one process per VW (the same records and, with Nm = 1 and D = 0,
the same final weights), and a stage rank that dies ending the whole job."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.jobs import checkpoint
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.ps.shards import ShardLayout
from hetpipe_jax.runtime.param_layout import ParamLayout
from tests.mpi_util import max_clock_distance, mpiexec, read_jsonl, run_job, vw_start_times

pytestmark = pytest.mark.mpi

# 2 VWs x 3 stages, 2 PS shards: ranks 0-1 shards, 2-3 the VWs' drivers (stage 0), 4-5 VW 0's stages 1-2, 6-7 VW 1's
LAYOUT = {"num_virtual_workers": 2, "num_stages": 3, "partition": "0:2,2:3,3:4", "num_ps_shards": 2,
          "checkpoint_every_waves": 0, "optimizer": "momentum", "learning_rate": 0.05, "batch_size": 16}
RANKS = 8


def _params0_and_layout():
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  return spec, params0, ParamLayout.from_layer_params(params0)


def test_two_vws_of_three_stage_ranks_equal_the_per_shard_replay(stage_ranks_run, synthetic_data_dir):
  """Stage ranks + 2 PS shards (on receipt), VWs of unequal speed (emulated), Nm = 2, D = 1, the global-norm clip on
  (``tests/conftest.py``'s ``stage_ranks_run``): every shard applied every wave once, every WSP bound
  holds, each stage ran on its own rank, and the final global weights equal the sequential replay of the recorded
  versions (rtol 1e-5)."""
  from tests.mpi_util import STAGE_RANKS_RUN as run
  from tests.replay import read_applied_order, replay_final_weights
  nm, mb, d = run["num_inflight"], run["num_minibatches"], run["staleness_bound"]
  assert {k: run[k] for k in LAYOUT} == LAYOUT and run["emulate_stage_ms"] == "3,3,3;9,9,9"
  workdir = stage_ranks_run
  summary = json.loads((workdir / "summary.json").read_text())
  config = json.loads((workdir / "config.json").read_text())
  assert config["stage_ranks"] is True and config["stage_rank_grouping"] == "gpu"
  assert summary["stage_rank_of_stage"] == config["stage_rank_of_stage"] == [[2, 4, 5], [3, 6, 7]]
  stats = summary["stage_rank_stats"]
  assert [stats[v]["ranks"] for v in ("0", "1")] == [[2, 4, 5], [3, 6, 7]]
  assert all(stats[v]["remote_tasks"] == 3 * mb for v in ("0", "1"))  # stage 1: F + B, stage 2: FB
  assert all(set(c) == {"0", "1", "2"} and all(sum(k.values()) >= 2 for k in c.values())
             for c in summary["trace_counts"].values())
  num_waves = mb // nm
  assert summary["applied_waves_count_per_shard"] == [2 * num_waves] * 2
  assert summary["applied_waves_in_order_per_shard"] == [True, True]
  logs = [read_applied_order(workdir, s) for s in range(2)]
  for log in logs:
    assert sorted(log) == [(w, v) for w in range(num_waves) for v in range(2)]
  records = read_jsonl(workdir / "minibatches.jsonl")
  assert len(records) == 2 * mb
  for r in records:  # WSP: local and global bounds, vector clocks (the same checks as one process per VW)
    assert r["version_global_clock"] >= r["local_clock_at_injection"] - d, r
    assert r["version_local_updates"] >= r["minibatch_id"] - nm + 1, r
    assert r["version_vector_clock"] == [min(c[u] for c in r["version_shard_vector_clocks"]) for u in range(2)]
  assert max_clock_distance(records, nm, vw_start_times(summary)) <= d + 1
  # the task trace has the runtime's format: every task once, in order, on its stage's device timeline
  from tests.mpi_util import check_task_trace
  check_task_trace(workdir, 2, 3, mb)
  spec, params0, layout = _params0_and_layout()
  shard_layout = ShardLayout.build(layout.layer_offsets, summary["ps_shards"]["layer_shards"], 2)
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, 2, v, 16, 0) for v in range(2)]
  tx = optax.chain(optax.clip_by_global_norm(run["grad_clip_norm"]), optax.sgd(0.05, momentum=0.9))
  expected = replay_final_weights(records, spec, params0, tx, sources, nm, logs[0],
                                  shards=list(zip(shard_layout.index, logs)))
  actual = layout.flatten(checkpoint.restore_weights(workdir / "checkpoint"))
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_one_process_per_vw_and_one_rank_per_stage_agree(tmp_path, synthetic_data_dir):
  """The same 2 x 3-stage layout with Nm = 1, D = 0 and the clock-aligned PS (a fixed schedule of versions) as one
  process per VW (4 ranks) and as one rank per stage (8 ranks): the same records (versions, clocks, losses) and the
  same final weights."""
  common = {"data_dir": synthetic_data_dir, **LAYOUT, "num_minibatches": 8, "num_inflight": 1, "staleness_bound": 0,
            "ps_apply": "clock_aligned"}
  runs = {}
  for name, ranks, extra in (("one_process", 4, {}), ("stage_ranks", RANKS, {"stage_ranks": True})):
    proc = run_job(tmp_path / name, ranks, {**common, **extra}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs[name] = tmp_path / name
  fields = ("vw_id", "minibatch_id", "wave_id", "local_clock_at_injection", "version_local_updates",
            "version_global_clock", "version_vector_clock", "version_shard_vector_clocks")

  def semantics(workdir):
    return sorted([r[f] for f in fields] for r in read_jsonl(workdir / "minibatches.jsonl"))

  assert semantics(runs["one_process"]) == semantics(runs["stage_ranks"])
  losses = [sorted((r["vw_id"], r["minibatch_id"], r["loss"]) for r in read_jsonl(w / "minibatches.jsonl"))
            for w in runs.values()]
  np.testing.assert_allclose([x[2] for x in losses[0]], [x[2] for x in losses[1]], rtol=1e-6)
  a, b = (ParamLayout.from_layer_params(checkpoint.restore_weights(w / "checkpoint")).flatten(
      checkpoint.restore_weights(w / "checkpoint")) for w in runs.values())
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
  logs = [[(x["wave_id"], x["vw_id"], x.get("shard", 0)) for x in read_jsonl(w / "ps_applied.jsonl")]
          for w in runs.values()]
  assert logs[0] == logs[1]


def _rank_pids(workdir) -> dict[int, int]:
  """MPI rank -> pid of the job's Python processes (hydra gives each its rank in PMI_RANK)."""
  out = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
      if "hetpipe_jax.train" not in cmd or f"--workdir={workdir}" not in cmd or "mpiexec" in cmd:
        continue
      with open(f"/proc/{entry}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
      continue
    if b"PMI_RANK" in env:
      out[int(env[b"PMI_RANK"])] = int(entry)
  return out


def test_a_stage_rank_that_dies_ends_the_job_within_ten_seconds(tmp_path, synthetic_data_dir):
  workdir = tmp_path / "run"
  args = [mpiexec(), "-n", str(RANKS), sys.executable, "-m", "mpi4py", "-m", "hetpipe_jax.train",
          "--config=experiments/configs/tiny.py", f"--workdir={workdir}"]
  overrides = {"data_dir": synthetic_data_dir, **LAYOUT, "num_minibatches": 4000, "num_inflight": 2,
               "stage_ranks": True, "emulate_stage_ms": "10,10,10", "check_counts": False, "progress": False,
               "log_every_waves": 1}
  args += [f"--config.{k}={v}" for k, v in overrides.items()]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 180
    while not (workdir / "metrics.jsonl").exists() or len((workdir / "metrics.jsonl").read_text().splitlines()) < 2:
      assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:] if proc.poll() else "slow"
      time.sleep(0.05)
    pids = _rank_pids(workdir)
    assert sorted(pids) == list(range(RANKS)), pids
    os.kill(pids[5], signal.SIGKILL)  # VW 0's stage 2 (its last stage)
    killed = time.time()
    proc.wait(timeout=60)
    assert time.time() - killed < 10 and proc.returncode != 0, (time.time() - killed, proc.returncode)
    assert not (workdir / "summary.json").exists()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
