"""``grad_clip_norm`` clips each minibatch's gradient by its GLOBAL norm over every stage (issue 23, defect 2).

The oracle is a plain jax/optax whole-model loop with ``optax.chain(optax.clip_by_global_norm(c), tx)`` (or, for
PipeDream's per-stage optimizers, the whole gradient clipped by ``optax.clip_by_global_norm`` and then each stage's
optimizer on its part): none of it calls the runtime's stages, clipping or norms. Each case runs two different
partitions of the same model; both must equal the oracle, and a per-stage clip (what the runtime did before) must
not, so the case really exercises the clip.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime import virtual_worker
from hetpipe_jax.runtime.param_layout import ParamLayout
from tests.pipeline_util import assert_params_close, build_vw, loss_and_grad

CLIP = 1.5  # mlp_tiny on the synthetic data, SGD with momentum: gradient norms 2.6 down to 0.5 over 12 minibatches
PARTITIONS = ([(0, 2), (2, 4)], [(0, 3), (3, 4)])  # 2:2 and 3:1 of mlp_tiny's layers (layer 0 has no parameters)


def _tx():
  return optax.sgd(0.1, momentum=0.9)


def _whole_model_clip(grads):
  """optax's ``clip_by_global_norm`` on the whole model's gradient."""
  clipped, _ = optax.clip_by_global_norm(CLIP).update(grads, optax.EmptyState())
  return clipped


def _replay(spec, params0, batches, versions, partition=None, per_stage_clip=False):
  """Sequential whole-model replay: minibatch p's gradient at the weights after ``versions[p]`` updates, clipped by
  its global norm (``per_stage_clip``: each stage's part by its own norm, the old behaviour), then the optimizer.
  Returns ``(final params, global norms)``."""
  grad_fn = loss_and_grad(spec)
  tx = optax.chain(optax.clip_by_global_norm(CLIP), _tx())
  state = tx.init(params0) if not per_stage_clip else [tx.init(list(params0[i:j])) for i, j in partition]
  history, params, norms = [params0], params0, []
  for (x, y), m in zip(batches, versions):
    _, g = grad_fn(history[m], x, y)
    norms.append(float(optax.tree.norm(g)))
    if per_stage_clip:
      new = []
      for s, (i, j) in enumerate(partition):
        u, state[s] = tx.update(list(g[i:j]), state[s], list(params[i:j]))
        new.extend(optax.apply_updates(list(params[i:j]), u))
      params = new
    else:
      u, state = tx.update(g, state, params)
      params = optax.apply_updates(params, u)
    params = jax.device_get(params)
    history.append(params)
  return params, norms



def _replay_two_vw_union(data_dir, batch, steps):
  """The whole-model replay of 2 VWs' all-reduce steps: each step trains on the union of both VWs' minibatches k."""
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, 2, v, batch, 0) for v in range(2)]
  batches = []
  for k in range(steps):
    parts = [s.get(k) for s in sources]
    batches.append((np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])))
  return _replay(spec, params0, batches, list(range(steps)))

def _pipedream_replay(spec, partition, params0, batches, stage_versions):
  """PipeDream's per-stage updates (tests.pipeline_util.pipedream_replay) with the whole gradient of each minibatch
  first clipped by its global norm (optax), then each stage's own optimizer on its part."""
  grad_fn = loss_and_grad(spec)
  tx = _tx()
  hist = [[list(params0[i:j])] for i, j in partition]
  states = [tx.init(list(params0[i:j])) for i, j in partition]
  for (x, y), versions in zip(batches, stage_versions):
    used = [layer for s, v in enumerate(versions) for layer in hist[s][v]]
    _, g = grad_fn(used, x, y)
    g = _whole_model_clip(g)
    for s, (i, j) in enumerate(partition):
      u, states[s] = tx.update(list(g[i:j]), states[s], hist[s][-1])
      hist[s].append(jax.device_get(optax.apply_updates(hist[s][-1], u)))
  return [layer for h in hist for layer in h[-1]]


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a),
                                                                                  jax.tree.leaves(b)))


def _clipping_stages(partition):
  spec = models.get_model("mlp_tiny")
  return stages_lib.build_stages(spec, partition, jax.devices()[:len(partition)], _tx(), grad_clip_norm=CLIP)


@pytest.mark.parametrize("method", ["hetpipe", "pipedream", "pipedream_vertical_sync"])
@pytest.mark.parametrize("num_inflight", [1, 3])
def test_pipelines_clip_by_the_global_norm_whatever_the_partition(synthetic_data_dir, method, num_inflight):
  """One VW, 12 minibatches, D = 0, partitions 2:2 and 3:1: the VW's weights equal the whole-model optax replay with
  ``clip_by_global_norm`` (HetPipe: at the recorded versions; PipeDream, with and without vertical sync: each stage
  at its recorded version, the update of minibatch p applied when p completes), and differ from a per-stage clip."""
  spec = models.get_model("mlp_tiny")
  n = 12
  finals = []
  vertical_sync = method == "pipedream_vertical_sync"
  method = "pipedream" if vertical_sync else method
  for partition in PARTITIONS:
    vw, source, params0, _, _ = build_vw(synthetic_data_dir, partition=partition, num_inflight=num_inflight,
                                         optimizer=_tx(), method=method, stages=_clipping_stages(partition),
                                         vertical_sync=vertical_sync)
    vw.run(n)
    recs = sorted(vw.records, key=lambda r: r.minibatch_id)
    batches = [source.get(p) for p in range(n)]
    got = vw.layer_params()
    if method == "hetpipe":
      versions = [r.version_local_updates for r in recs]
      want, norms = _replay(spec, params0, batches, versions)
      per_stage, _ = _replay(spec, params0, batches, versions, partition, per_stage_clip=True)
      if num_inflight > 1:
        assert any(m < p for p, m in enumerate(versions))  # stale weights: the norm is the minibatch's own
    else:
      versions = [r.stage_versions for r in recs]
      if vertical_sync:
        assert all(len(set(v)) == 1 for v in versions)  # every stage used the version stage 0 used
      want = _pipedream_replay(spec, partition, params0, batches, versions)
      _, norms = _replay(spec, params0, batches, list(range(n)))
      per_stage = None
    assert sum(g > CLIP for g in norms) >= 2 and sum(g < CLIP for g in norms) >= 2, norms  # both branches ran
    assert_params_close(got, want, rtol=1e-5, atol=1e-6)
    if per_stage is not None:
      assert _max_diff(got, per_stage) > 1e-3  # the old per-stage clip gives other weights
    finals.append(got)
  if num_inflight == 1:  # the same sequence of versions: the partition does not change the numerics
    assert_params_close(finals[0], finals[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method,partition,m", [
    ("gpipe", [(0, 2), (2, 4)], 2),
    ("1f1b_flush", [(0, 3), (3, 4)], 4),
    ("horovod", [(0, 4)], 2),
])
def test_flush_methods_clip_the_mean_gradient_by_its_global_norm(synthetic_data_dir, method, partition, m):
  """A flush step's update is the mean gradient over its M micro-batches (the whole minibatch), clipped by its
  global norm over the whole model: single-device optax training with ``clip_by_global_norm``."""
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  layout = ParamLayout.from_layer_params(params0)
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  source = sharding.ShardedMinibatches(dataset, 1, 0, 16, 0)
  micro = sharding.MicroBatches(source.get, m)
  vw = virtual_worker.VirtualWorker(_clipping_stages(partition), layout, params0, virtual_worker.WSPSettings(0, 1, m),
                                    virtual_worker.UpdateSettings(_tx(), method, reducer=lambda step, buf: buf),
                                    virtual_worker.VWHooks(micro.get))
  steps = 10
  vw.run(steps * m)
  batches = [source.get(k) for k in range(steps)]
  want, norms = _replay(spec, params0, batches, list(range(steps)))
  assert sum(g > CLIP for g in norms) >= 2 and sum(g < CLIP for g in norms) >= 2, norms
  assert_params_close(vw.layer_params(), want, rtol=1e-5, atol=1e-6)


def test_virtual_time_allreduce_with_a_partition_per_vw_clips_globally_and_keeps_replicas_identical(
    tmp_path, synthetic_data_dir):
  """GPipe, 2 VWs with different partitions (2:2 and 3:1), ``grad_clip_norm`` set: the replicas stay identical (bit
  for bit) and equal single-device optax training on the union of both VWs' minibatches with
  ``clip_by_global_norm``. Before, each stage clipped by its own norm: the replicas diverged."""
  from experiments.configs import tiny
  from hetpipe_jax.jobs import checkpoint, job_config, virtual_job
  steps, batch = 8, 16
  c = tiny.get_config()
  c.update({"data_dir": str(synthetic_data_dir), "check_counts": False, "progress": False, "method": "gpipe",
            "num_virtual_workers": 2, "num_stages": 2, "num_inflight": 2, "num_minibatches": steps,
            "partition": "0:2,2:4;0:3,3:4", "optimizer": "momentum", "momentum": 0.9, "learning_rate": 0.1,
            "batch_size": batch, "emulate_stage_ms": "20,40", "grad_clip_norm": CLIP})
  summary = virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path))
  assert summary["allreduce"]["replicas_identical"]
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["grad_clip_norm"] == CLIP
  want, norms = _replay_two_vw_union(synthetic_data_dir, batch, steps)
  assert sum(g > CLIP for g in norms) >= 2 and sum(g < CLIP for g in norms) >= 1, norms
  assert_params_close(checkpoint.restore_weights(tmp_path / "checkpoint"), want, rtol=1e-5, atol=1e-6)


def test_virtual_time_hetpipe_two_vws_clip_globally(tmp_path, synthetic_data_dir):
  """HetPipe in virtual time, 2 VWs with different partitions (Nm = 2, D = 1, clock-aligned PS), clipping on: the
  final global weights equal the multi-VW replay of the records (tests/replay.py) with a whole-model optax
  ``clip_by_global_norm`` optimizer."""
  from experiments.configs import tiny
  from hetpipe_jax.jobs import checkpoint, job_config, virtual_job
  from tests import replay
  c = tiny.get_config()
  c.update({"data_dir": str(synthetic_data_dir), "check_counts": False, "progress": False,
            "num_virtual_workers": 2, "num_stages": 2, "num_inflight": 2, "staleness_bound": 1,
            "num_minibatches": 10, "partition": "0:2,2:4;0:3,3:4", "optimizer": "momentum", "momentum": 0.9,
            "learning_rate": 0.1, "batch_size": 16, "emulate_stage_ms": "10,30;30,10", "grad_clip_norm": CLIP,
            "ps_apply": "clock_aligned"})
  virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path))
  records = [json.loads(l) for l in (tmp_path / "minibatches.jsonl").read_text().splitlines()]
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, 2, v, 16, 0) for v in range(2)]
  tx = optax.chain(optax.clip_by_global_norm(CLIP), _tx())
  want = replay.replay_final_weights(records, spec, params0, tx, sources, 2, replay.read_applied_order(tmp_path))
  layout = ParamLayout.from_layer_params(params0)
  np.testing.assert_allclose(layout.flatten(checkpoint.restore_weights(tmp_path / "checkpoint")), want, rtol=1e-5,
                             atol=1e-6)


def _diverging_vw1(monkeypatch):
  """VW 1's all-reduced gradients perturbed: its replica diverges (tests/diverging_replica.py under MPI)."""
  from hetpipe_jax.runtime import flush_step
  apply_reduced = flush_step.FlushUpdate.apply_reduced

  def diverging(self, step, summed):
    if self.vw.vw_id == 1:
      summed = summed.copy()
      summed[0] += 1.0
    return apply_reduced(self, step, summed)

  monkeypatch.setattr(flush_step.FlushUpdate, "apply_reduced", diverging)


def test_virtual_time_replicas_that_diverge_fail_the_run(tmp_path, synthetic_data_dir, monkeypatch):
  """All-reduce in virtual time whose VW 1 applies a different step: the run raises ReplicasDivergedError naming
  both groups of VWs (it used to log a warning and finish), after writing its outputs (summary.json records
  ``replicas_identical: false`` and each replica's digest). The same run without the perturbation passes."""
  from experiments.configs import tiny
  from hetpipe_jax.jobs import job_config, virtual_job
  from hetpipe_jax.jobs.outputs import ReplicasDivergedError
  c = tiny.get_config()
  c.update({"data_dir": str(synthetic_data_dir), "check_counts": False, "progress": False, "method": "horovod",
            "num_virtual_workers": 2, "num_stages": 1, "num_inflight": 1, "num_minibatches": 3,
            "emulate_stage_ms": "10"})
  summary = virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path / "ok"))
  assert summary["allreduce"]["replicas_identical"]
  assert len(set(summary["allreduce"]["replica_sha256"].values())) == 1
  last = summary["evaluations"][-1]  # the all-reduce methods' list ends with the run's final evaluation
  assert (last["global_clock"], last["simulated_time_s"]) == (3, summary["simulated_time_s"])
  assert last["test_accuracy"] == summary["test_accuracy"] and "wall_time_s" not in last
  _diverging_vw1(monkeypatch)
  with pytest.raises(ReplicasDivergedError, match=r"replicas' final weights differ \(VWs \[0\] \w+; VWs \[1\]"):
    virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path / "bad"))
  summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
  assert summary["allreduce"]["replicas_identical"] is False
  assert len(set(summary["allreduce"]["replica_sha256"].values())) == 2


@pytest.mark.mpi
def test_mpi_replicas_that_diverge_exit_non_zero_with_an_error(tmp_path, synthetic_data_dir):
  """Under MPI (Horovod, 2 ranks) a replica that diverges ends the job with a non-zero exit and one ``error:`` line
  naming the divergence (issue 23: it used to exit 0 with a warning)."""
  import os
  import subprocess
  import sys
  from hetpipe_jax.paths import REPO_ROOT
  from tests.mpi_util import mpiexec
  args = [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "tests/diverging_replica.py",
          "--config=experiments/configs/tiny.py", f"--workdir={tmp_path / 'run'}", "--config.check_counts=False",
          "--config.progress=False", f"--config.data_dir={synthetic_data_dir}", "--config.method=horovod",
          "--config.num_virtual_workers=2", "--config.num_stages=1", "--config.num_inflight=1",
          "--config.num_minibatches=3"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  proc = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode != 0, proc.stderr[-3000:]
  assert "error: the data-parallel replicas' final weights differ" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.mpi
def test_mpi_stage_ranks_clip_by_the_global_norm(stage_ranks_run, synthetic_data_dir):
  """Under mpiexec: 2 VWs whose 3 stages run on separate ranks (2 PS shards: 8 ranks), Nm = 2, D = 1, clipping on
  (``tests/conftest.py``'s ``stage_ranks_run``, also read by ``tests/test_stage_ranks_mpi.py``): the squared norms
  travel from the stage ranks to their drivers and the norm back with each UPDATE; the final global weights equal the
  per-shard replay of the records with a whole-model optax ``clip_by_global_norm``."""
  from hetpipe_jax.jobs import checkpoint
  from hetpipe_jax.ps.shards import ShardLayout
  from tests.mpi_util import STAGE_RANKS_RUN as run, read_jsonl
  from tests.replay import read_applied_order, replay_final_weights
  nm, batch, lr = run["num_inflight"], run["batch_size"], run["learning_rate"]
  assert run["grad_clip_norm"] == CLIP and run["optimizer"] == "momentum" and run["momentum"] == 0.9
  workdir = stage_ranks_run
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["stage_rank_of_stage"] == [[2, 4, 5], [3, 6, 7]]
  records = read_jsonl(workdir / "minibatches.jsonl")
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  layout = ParamLayout.from_layer_params(params0)
  logs = [read_applied_order(workdir, s) for s in range(2)]
  shard_layout = ShardLayout.build(layout.layer_offsets, summary["ps_shards"]["layer_shards"], 2)
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, 2, v, batch, 0) for v in range(2)]
  tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(lr, momentum=0.9))
  expected = replay_final_weights(records, spec, params0, tx, sources, nm, logs[0],
                                  shards=list(zip(shard_layout.index, logs)))
  actual = layout.flatten(checkpoint.restore_weights(workdir / "checkpoint"))
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
  unclipped = replay_final_weights(records, spec, params0, optax.sgd(lr, momentum=0.9), sources, nm, logs[0],
                                   shards=list(zip(shard_layout.index, logs)))
  assert np.max(np.abs(actual - unclipped)) > 1e-3  # the clip was active


@pytest.mark.mpi
def test_mpi_allreduce_with_a_partition_per_vw_clips_globally(tmp_path, synthetic_data_dir):
  """The issue's case under mpiexec: GPipe, 2 VWs partitioned 2:2 and 3:1, ``grad_clip_norm`` set. It used to end
  with ``replicas_identical: false`` and exit 0; now the replicas are identical and equal single-device optax training
  on the union of the VWs' minibatches with ``clip_by_global_norm``."""
  from hetpipe_jax.jobs import checkpoint
  from tests.mpi_util import run_job
  steps, batch = 6, 16
  workdir = tmp_path / "run"
  proc = run_job(workdir, 2, {"data_dir": synthetic_data_dir, "method": "gpipe", "num_virtual_workers": 2,
                              "num_stages": 2, "num_inflight": 2, "partition": "0:2,2:4;0:3,3:4",
                              "optimizer": "momentum", "momentum": 0.9, "learning_rate": 0.1, "batch_size": batch,
                              "num_minibatches": steps, "grad_clip_norm": CLIP})
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["allreduce"]["replicas_identical"] and summary["partitions"] == {"0": [[0, 2], [2, 4]],
                                                                                  "1": [[0, 3], [3, 4]]}
  want, norms = _replay_two_vw_union(synthetic_data_dir, batch, steps)
  assert sum(g > CLIP for g in norms) >= 2, norms
  assert_params_close(checkpoint.restore_weights(workdir / "checkpoint"), want, rtol=1e-5, atol=1e-6)
