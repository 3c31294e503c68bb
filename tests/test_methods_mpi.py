"""The all-reduce methods under MPI (one rank per VW, no PS): oracles against single-device training. Their refusals
of a PS world size and of stages for Horovod are cases of tests/test_mpi_job.BAD_INPUTS (tests/test_train_checks.py)."""

import json

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.jobs import checkpoint
from tests.mpi_util import read_jsonl, run_job
from tests.pipeline_util import assert_params_close, loss_and_grad

pytestmark = pytest.mark.mpi


def union_training(data_dir, num_vws, steps, batch, lr, model="mlp_tiny"):
  """Single-device SGD where step k's minibatch is the union of every VW's minibatch k (mean loss over it)."""
  spec = models.get_model(model)
  params = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, num_vws, v, batch, 0) for v in range(num_vws)]
  grad_fn = loss_and_grad(spec)
  tx = optax.sgd(lr)
  state = tx.init(params)
  losses = []
  for k in range(steps):
    parts = [src.get(k) for src in sources]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    loss, g = grad_fn(params, x, y)
    updates, state = tx.update(g, state, params)
    params = jax.device_get(optax.apply_updates(params, updates))
    losses.append(float(loss))
  return params, losses


@pytest.mark.parametrize("method,num_vws,stages,m", [
    ("horovod", 2, 1, 1),  # Horovod: N workers = single-device training on the union of their minibatches
    ("gpipe", 2, 2, 4),  # PP x DP: N VWs = single-device training on all N minibatches
    ("1f1b_flush", 2, 2, 2),
    ("gpipe", 1, 2, 4),  # one VW = single-device training on the whole minibatch
])
def test_allreduce_methods_equal_single_device_training(tmp_path, synthetic_data_dir, method, num_vws, stages, m):
  steps, lr, batch = 5, 0.1, 16
  workdir = tmp_path / "run"
  proc = run_job(workdir, num_vws, {"data_dir": synthetic_data_dir, "method": method, "num_virtual_workers": num_vws,
                                    "num_stages": stages, "num_inflight": m, "num_minibatches": steps,
                                    "optimizer": "sgd", "learning_rate": lr, "batch_size": batch,
                                    "log_every_waves": 1, "save_task_trace": True})
  assert proc.returncode == 0, proc.stderr[-3000:]
  want, losses = union_training(synthetic_data_dir, num_vws, steps, batch, lr)
  assert_params_close(checkpoint.restore_weights(workdir / "checkpoint"), want, rtol=1e-5)
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["method"] == method and summary["allreduce"]["replicas_identical"]
  assert summary["method_settings"]["num_microbatches"] == m
  assert summary["method_settings"]["micro_batch_size"] == batch // m
  assert summary["num_minibatches"] == num_vws * steps and summary["num_microbatches_per_vw"] == steps * m
  assert summary["checkpoint_every_waves"] == 0
  metrics = [l for l in read_jsonl(workdir / "metrics.jsonl") if "wave" in l]
  final = read_jsonl(workdir / "metrics.jsonl")[-1]  # the run's final line, the PS methods' form
  assert "wave" not in final and final["global_clock"] == steps and final["minibatches"] == num_vws * steps
  assert {"loss", "wall_time_s", "minibatches_per_s", "test_accuracy"} <= set(final)
  last = summary["evaluations"][-1]  # the all-reduce methods' list ends with the run's final evaluation
  assert (last["global_clock"], last["wall_time_s"]) == (steps, summary["wall_time_s"])
  assert (last["test_accuracy"], last["test_loss"]) == (final["test_accuracy"], final["test_loss"])
  np.testing.assert_allclose([l["loss"] for l in metrics], losses, rtol=1e-5)
  records = read_jsonl(workdir / "minibatches.jsonl")
  assert len(records) == num_vws * steps * m
  assert all(r["version_local_updates"] == r["minibatch_id"] // m for r in records)  # the previous steps' weights
  config = json.loads((workdir / "config.json").read_text())
  assert config["method"] == method and config["num_inflight"] == m
  assert summary["plan"] == config["plan"] == ""  # no plan: the same value in both files
  # The method's order ran: per stage, the tasks in StageOrder's order.
  from hetpipe_jax.rules import methods
  order = methods.stage_order(methods.get_method(method), stages, m, steps * m)
  tasks = read_jsonl(workdir / "tasks.jsonl")
  for v in range(num_vws):
    for s in range(stages):
      got = [t["task"] for t in tasks if t["vw_id"] == v and int(t["task"][0]) == s]
      assert got == [str(t) for t in order.stage_tasks(s)]


@pytest.mark.parametrize("vertical_sync", [False, True])
def test_pipedream_under_mpi_keeps_wsp_and_its_1f1b_order(tmp_path, synthetic_data_dir, vertical_sync):
  from tests.test_mpi_job import _check_wsp
  from hetpipe_jax.rules import methods
  workdir = tmp_path / "run"
  stages, mb = 3, 24
  proc = run_job(workdir, 3, {"data_dir": synthetic_data_dir, "method": "pipedream", "num_stages": stages,
                              "num_minibatches": mb, "staleness_bound": 1, "emulate_stage_ms": "6,6,6;18,18,18",
                              "num_cpu_devices": 3, "save_task_trace": True, "vertical_sync": vertical_sync})
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary, records = _check_wsp(workdir, 2, mb, stages, 1, reach=False)
  assert summary["method"] == "pipedream" and summary["num_inflight"] == stages  # NOAM
  assert summary["method_settings"]["vertical_sync"] is vertical_sync
  assert summary["setting_sources"]["num_inflight"].startswith("default (PipeDream's NOAM")
  for r in records:
    v = r["stage_versions"]
    assert len(v) == stages and min(v) >= 0
    if vertical_sync:
      assert len(set(v)) == 1
  order = methods.stage_order(methods.get_method("pipedream"), stages, stages, mb)
  tasks = read_jsonl(workdir / "tasks.jsonl")
  for vw in range(2):
    for s in range(stages):
      got = [t["task"] for t in tasks if t["vw_id"] == vw and int(t["task"][0]) == s]
      assert got == [str(t) for t in order.stage_tasks(s)]
