"""Runtime numerics of the methods (in process): GPipe / 1F1B-flush / Horovod steps equal single-device training."""

import dataclasses
import threading

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime import virtual_worker
from hetpipe_jax.runtime.param_layout import ParamLayout
from tests.pipeline_util import assert_params_close, loss_and_grad


def build_flush_vw(data_dir, *, method, partition, num_microbatches, batch_size=16, optimizer=None, remat=False,
                   model="mlp_tiny", seed=0):
  spec = models.get_model(model)
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(seed)))
  layout = ParamLayout.from_layer_params(params0)
  tx = optimizer or optax.sgd(0.1)
  stages = stages_lib.build_stages(spec, partition, jax.devices()[:len(partition)], tx, remat=remat)
  dataset = fashion_mnist.load_fashion_mnist(data_dir, expected_counts=None)
  source = sharding.ShardedMinibatches(dataset, 1, 0, batch_size, seed)
  micro = sharding.MicroBatches(source.get, num_microbatches)
  steps = []
  vw = virtual_worker.VirtualWorker(stages, layout, params0, virtual_worker.WSPSettings(0, 1, num_microbatches),
                                    virtual_worker.UpdateSettings(
                                        tx, method, reducer=lambda step, buf: buf,
                                        on_step=lambda step, loss: steps.append((step, loss))),
                                    virtual_worker.VWHooks(micro.get))
  return vw, source, params0, tx, spec, steps


def single_device(spec, params0, tx, batches):
  grad_fn = loss_and_grad(spec)
  params, state = params0, tx.init(params0)
  losses = []
  for x, y in batches:
    loss, g = grad_fn(params, x, y)
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  return jax.device_get(params), losses


@pytest.mark.parametrize("method,partition,m,remat", [
    ("gpipe", [(0, 2), (2, 4)], 4, False),
    ("gpipe", [(0, 1), (1, 3), (3, 4)], 2, True),
    ("1f1b_flush", [(0, 2), (2, 4)], 4, False),
    ("1f1b_flush", [(0, 1), (1, 2), (2, 4)], 8, False),
    ("horovod", [(0, 4)], 1, False),
    ("horovod", [(0, 4)], 4, False),
])
def test_flush_methods_in_one_vw_equal_single_device_training(synthetic_data_dir, method, partition, m, remat):
  steps = 3
  vw, source, params0, tx, spec, logged = build_flush_vw(synthetic_data_dir, method=method, partition=partition,
                                                         num_microbatches=m, remat=remat,
                                                         optimizer=optax.adam(1e-2))
  vw.run(steps * m)
  want, losses = single_device(spec, params0, tx, [source.get(k) for k in range(steps)])
  assert_params_close(vw.layer_params(), want, rtol=1e-5)
  assert [s for s, _ in logged] == list(range(steps))
  np.testing.assert_allclose([l for _, l in logged], losses, rtol=1e-5)
  recs = vw.records
  assert [r.minibatch_id for r in recs] == list(range(steps * m))
  assert [r.wave_id for r in recs] == [p // m for p in range(steps * m)]
  assert [r.version_local_updates for r in recs] == [p // m for p in range(steps * m)]  # the previous steps'
  assert vw.stats.peak_inflight_per_stage[-1] == 1


def test_flush_method_needs_a_reducer(synthetic_data_dir):
  with pytest.raises(ValueError, match="needs a reducer"):
    spec = models.get_model("mlp_tiny")
    params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
    layout = ParamLayout.from_layer_params(params0)
    tx = optax.sgd(0.1)
    stages = stages_lib.build_stages(spec, [(0, 4)], jax.devices()[:1], tx)
    virtual_worker.VirtualWorker(stages, layout, params0, virtual_worker.WSPSettings(0, 1, 2),
                                 virtual_worker.UpdateSettings(tx, "gpipe"), virtual_worker.VWHooks(lambda p: None))


def test_micro_batches_split_each_minibatch_in_order(synthetic_data_dir):
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  source = sharding.ShardedMinibatches(dataset, 2, 1, 16, 0)
  micro = sharding.MicroBatches(source.get, 4)
  x = np.concatenate([micro.get(p)[0] for p in range(4, 8)])
  np.testing.assert_array_equal(x, source.get(1)[0])


class _ThreadAllReduce:
  """In-process all-reduce of N VWs running in threads: each VW's step buffer is summed over every VW in VW order
  (as ``MPI.Allreduce`` gives every rank the same sum) and returned to each."""

  def __init__(self, num_vws):
    self.barrier = threading.Barrier(num_vws, timeout=60)
    self.bufs = [None] * num_vws

  def reducer(self, vw_id):
    def reduce(step, buf):
      del step
      self.bufs[vw_id] = buf.copy()
      self.barrier.wait()
      total = self.bufs[0].copy()
      for b in self.bufs[1:]:
        total += b
      self.barrier.wait()  # every VW has its sum before the next step's buffers land
      return total
    return reduce


@pytest.mark.parametrize("method,partition,m", [("gpipe", [(0, 2), (2, 4)], 2), ("1f1b_flush", [(0, 1), (1, 4)], 4)])
def test_flush_methods_with_two_vws_report_the_mean_loss_over_every_micro_batch(synthetic_data_dir, method,
                                                                                partition, m):
  """Two VWs (threads of this process, their step buffers summed in VW order): each step's reported loss is the mean
  over both VWs' M micro-batches, which equals the loss of single-device SGD on the union of both VWs' minibatches
  (rtol 1e-5), as do both replicas' weights."""
  from tests.test_methods_mpi import union_training
  steps, lr, batch, n = 3, 0.1, 16, 2
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  layout = ParamLayout.from_layer_params(params0)
  tx = optax.sgd(lr)
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  allreduce = _ThreadAllReduce(n)
  logged = [[] for _ in range(n)]
  vws = []
  for v in range(n):
    devices = jax.devices()[v * len(partition):(v + 1) * len(partition)]
    source = sharding.ShardedMinibatches(dataset, n, v, batch, 0)
    micro = sharding.MicroBatches(source.get, m)
    vws.append(virtual_worker.VirtualWorker(
        stages_lib.build_stages(spec, partition, devices, tx), layout, params0, virtual_worker.WSPSettings(v, n, m),
        virtual_worker.UpdateSettings(tx, method, reducer=allreduce.reducer(v),
                                      on_step=lambda step, loss, v=v: logged[v].append((step, loss))),
        virtual_worker.VWHooks(micro.get)))
  errors = []

  def train(vw):
    try:
      vw.run(steps * m)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
      allreduce.barrier.abort()

  threads = [threading.Thread(target=train, args=(vw,)) for vw in vws]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  assert not errors and not any(t.is_alive() for t in threads), errors
  want, losses = union_training(synthetic_data_dir, n, steps, batch, lr)
  for v in range(n):
    assert [s for s, _ in logged[v]] == list(range(steps))
    np.testing.assert_allclose([l for _, l in logged[v]], losses, rtol=1e-5)
    assert_params_close(vws[v].layer_params(), want, rtol=1e-5)


# ----------------------------------------------------------------------------------------- virtual time
@pytest.mark.parametrize("method,stages,m,stage_ms", [
    ("gpipe", 2, 4, "20,40;40,80"),  # heterogeneous VWs: the slow one holds every step
    ("1f1b_flush", 2, 2, "20,40"),
    ("horovod", 1, 1, "30;60"),
])
def test_virtual_time_allreduce_methods_equal_union_training(tmp_path, synthetic_data_dir, method, stages, m,
                                                             stage_ms):
  from experiments.configs import tiny
  from hetpipe_jax.jobs import checkpoint, job_config, virtual_job
  from tests.test_methods_mpi import union_training
  steps, lr, batch = 4, 0.1, 16
  c = tiny.get_config()
  c.update({"data_dir": str(synthetic_data_dir), "check_counts": False, "progress": False, "method": method,
            "num_virtual_workers": 2, "num_stages": stages, "num_inflight": m, "num_minibatches": steps,
            "optimizer": "sgd", "learning_rate": lr, "batch_size": batch, "emulate_stage_ms": stage_ms,
            "log_every_waves": 1})
  summary = virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path))
  want, losses = union_training(synthetic_data_dir, 2, steps, batch, lr)
  assert_params_close(checkpoint.restore_weights(tmp_path / "checkpoint"), want, rtol=1e-5)
  assert summary["allreduce"]["replicas_identical"] and summary["method"] == method
  # Simulated time: the slowest VW's step, (M + S - 1) micro-batch tasks of its slowest stage on equal-share
  # stages here: sum of stage times + (M - 1) x the slowest, per step (no all-reduce time in synthetic emulation).
  rows = [[float(x) / m for x in r.split(",")] for r in stage_ms.split(";")]
  step_s = max(sum(r) + (m - 1) * max(r) for r in rows) / 1e3
  assert summary["simulated_time_s"] == pytest.approx(steps * step_s, rel=1e-9)
  import json
  metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"wave"' in l]
  np.testing.assert_allclose([l["loss"] for l in metrics], losses, rtol=1e-5)


# ----------------------------------------------------------------------------------------- PipeDream
@pytest.mark.parametrize("vertical_sync", [False, True])
@pytest.mark.parametrize("partition,nm,pull_every_wave", [
    ([(0, 1), (1, 2), (2, 4)], 3, True),  # NOAM = S, a pull (rebase) at every wave end
    ([(0, 2), (2, 4)], 3, False),  # Nm > S
])
def test_pipedream_weight_stashing_equals_sequential_replay(synthetic_data_dir, vertical_sync, partition, nm,
                                                            pull_every_wave):
  from tests.pipeline_util import build_vw, pipedream_replay
  vw, source, params0, tx, _ = build_vw(synthetic_data_dir, partition=partition, num_inflight=nm,
                                        method="pipedream", vertical_sync=vertical_sync,
                                        pull_every_wave=pull_every_wave, staleness_bound=0)
  total = 6 * nm
  vw.run(total)
  recs = sorted(vw.records, key=lambda r: r.minibatch_id)
  versions = [r.stage_versions for r in recs]
  s_count = len(partition)
  for q, v in enumerate(versions):
    if vertical_sync:
      assert len(set(v)) == 1  # every stage used the version stage 0 used
    else:  # 1F1B: stage s runs forward q after its backward q - K_s (K_s = max(1, Nm - s)), never earlier
      for s in range(s_count):
        k = 1 if s == s_count - 1 else max(1, nm - s)
        assert v[s] == max(0, q - k + 1), (q, s, v)
  assert any(len(set(v)) > 1 for v in versions) != vertical_sync
  spec = __import__("hetpipe_jax.models", fromlist=["get_model"]).get_model("mlp_tiny")
  want = pipedream_replay(spec, partition, params0, tx, [source.get(q) for q in range(total)], versions)
  assert_params_close(vw.layer_params(), want, rtol=1e-5, atol=1e-6)
  assert vw.stats.num_pushes == 6


def test_pipedream_in_virtual_time_one_vw_equals_replay_and_two_vws_keep_the_bound(tmp_path, synthetic_data_dir):
  from experiments.configs import tiny
  from hetpipe_jax.jobs import checkpoint, job_config, virtual_job
  from tests.pipeline_util import pipedream_replay
  import json
  spec = models.get_model("mlp_tiny")
  for n, stage_ms in ((1, "10,20,10"), (2, "10,20,10;30,30,30")):
    c = tiny.get_config()
    c.update({"data_dir": str(synthetic_data_dir), "check_counts": False, "progress": False, "method": "pipedream",
              "num_virtual_workers": n, "num_stages": 3, "num_minibatches": 18, "staleness_bound": 1,
              "emulate_stage_ms": stage_ms, "lr_schedule": "constant"})
    out = tmp_path / f"n{n}"
    summary = virtual_job.run(job_config.resolve_job(c, "virtual"), str(out))
    records = [json.loads(l) for l in (out / "minibatches.jsonl").read_text().splitlines()]
    assert summary["method"] == "pipedream" and summary["num_inflight"] == 3
    assert max(r["local_clock_at_injection"] - r["version_global_clock"] for r in records) <= 1
    assert summary["max_clock_distance"] <= 2
    if n == 1:
      params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
      dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
      source = sharding.ShardedMinibatches(dataset, 1, 0, c.batch_size, 0)
      partition = [tuple(r) for r in summary["partitions"]["0"]]
      want = pipedream_replay(spec, partition, params0, optax.adam(c.learning_rate),
                              [source.get(q) for q in range(18)], [r["stage_versions"] for r in records])
      assert_params_close(checkpoint.restore_weights(out / "checkpoint"), want, rtol=1e-5, atol=1e-6)


def _pipedream_oracle(events, applied, partitions, w0, layout, spec, tx, sources, nm, vertical_sync):
  """Replays a multi-VW PipeDream run from its event order alone (written apart from the runtime).

  ``events``: in the order they happened, ``("task", v, task)`` (a task's computation: a forward reads its stage's
  weights, a backward applies the stage's own optimizer step), ``("pull", v, vector clock)`` (pulled weights
  installed) and ``("push", v, wave)``; ``applied``: the PS's ``(wave, vw)`` log. The rule checked: stage s of VW v
  holds ``latest = G(vc) + its own updates of waves >= vc[v]`` (G: W0 plus the log's first sum(vc) waves, vc the
  last installed pull), a pull rebasing every stage and keeping the own waves the PS lacks; a forward uses the
  stage's weights after k own updates: ``latest - its updates k..n-1`` (k = n, the stage's count now; with vertical
  sync on stages > 0, k = stage 0's count at its forward of the minibatch: the stashed version, rebased by every
  pull since). Each minibatch's gradient is taken at its stages' forward weights; each stage's update follows its
  own momentum state, in minibatch order.

  Returns:
    ``(final global weights, per VW per stage its latest weights, per (v, q) the k of each stage, counts)``.
  """
  from tests.pipeline_util import loss_and_grad
  grad_fn = loss_and_grad(spec)
  offsets = layout.layer_offsets
  n = len(partitions)
  slices = [[slice(offsets[i], offsets[j]) for i, j in part] for part in partitions]
  upd = [[{} for _ in part] for part in partitions]  # v, s -> q -> float32 update of the stage's elements
  count = [[0] * len(part) for part in partitions]
  states = [[tx.init(np.zeros(sl.stop - sl.start, np.float32)) for sl in vw] for vw in slices]
  clocks = [(0,) * n for _ in range(n)]
  fw, k_used, grads, k0 = {}, {}, {}, {}
  seen = {"own_kept": 0, "peer_carried": 0, "stash_rebased": 0}
  pushed = [0] * n
  last_pull = [-1] * n  # per VW, the event index of its last installed pull
  reached = {}  # (v, s, k) -> event index at which stage s of VW v reached k own updates

  def wave(v, c):
    total = np.zeros_like(w0)
    for s, sl in enumerate(slices[v]):
      for q in range(c * nm, (c + 1) * nm):
        total[sl] += upd[v][s][q]
    return total

  def global_at(vc):
    counts = [0] * n
    w = w0.copy()
    for c, u in applied[:sum(vc)]:
      assert c == counts[u], f"PS log applies VW {u}'s wave {c} before its wave {counts[u]}"
      counts[u] += 1
      w += wave(u, c)
    assert counts == list(vc), (counts, vc)
    return w

  def weights(v, s, k):
    own = clocks[v][v]
    w = global_at(clocks[v])[slices[v][s]].copy()
    for q in range(count[v][s]):
      if q < k and q // nm >= own:
        w += upd[v][s][q]
      elif q >= k and q // nm < own:
        w -= upd[v][s][q]
    return w

  for index, ev in enumerate(events):
    v = ev[1]
    if ev[0] == "push":
      pushed[v] += 1
      continue
    if ev[0] == "pull":
      clocks[v] = tuple(ev[2])
      last_pull[v] = index
      seen["own_kept"] += pushed[v] > clocks[v][v]
      seen["peer_carried"] += any(c > 0 for u, c in enumerate(clocks[v]) if u != v)
      continue
    task = ev[2]
    s, q, kind = task.stage_id, task.minibatch_id, task.kind.name
    last = s == len(slices[v]) - 1
    if kind in ("FORWARD", "FORWARD_BACKWARD"):
      if s == 0:
        k0[(v, q)] = count[v][0]
      k = k0[(v, q)] if vertical_sync and s > 0 else count[v][s]
      k_used.setdefault((v, q), {})[s] = k
      if k < count[v][s] and reached.get((v, s, k), -1) < last_pull[v]:
        seen["stash_rebased"] += 1  # an older version, kept from before the last pull
      fw.setdefault((v, q), {})[s] = weights(v, s, k)
    if kind == "FORWARD_BACKWARD":
      assert last
      full = np.concatenate([fw[(v, q)][t] for t in range(len(slices[v]))])
      _, g = grad_fn(layout.unflatten(full), *sources[v].get(q))
      grads[(v, q)] = layout.flatten(jax.device_get(g))
    if kind in ("BACKWARD", "FORWARD_BACKWARD"):
      u, states[v][s] = tx.update(grads[(v, q)][slices[v][s]], states[v][s])
      upd[v][s][q] = np.asarray(u, np.float32)
      count[v][s] += 1
      reached[(v, s, count[v][s])] = index
  final = global_at([sum(1 for _, u in applied if u == v) for v in range(n)])
  latest = [[weights(v, s, count[v][s]) for s in range(len(slices[v]))] for v in range(n)]
  return final, latest, k_used, seen


@pytest.mark.parametrize("ps_apply", ["on_receipt", "clock_aligned"])
@pytest.mark.parametrize("vertical_sync", [False, True])
def test_pipedream_with_two_vws_and_pulls_equals_an_event_order_replay(tmp_path, synthetic_data_dir, monkeypatch,
                                                                       ps_apply, vertical_sync):
  """PipeDream, two heterogeneous VWs in virtual time, D = 1, a pull at every wave end, pushes of 5 ms and pull
  replies of 100 ms: pulls carry the other VW's waves, and VWs have pushed waves the pulled weights lack (the pull
  must keep them) — and with vertical sync, stage versions stashed before a pull are read after it (the pull must
  rebase them). The global and each VW's final weights, and every stage version the records claim, equal
  :func:`_pipedream_oracle` (rtol 1e-5)."""
  import json
  from experiments.configs import tiny
  from hetpipe_jax.jobs import checkpoint, emulation, job_config, virtual_job
  from tests.replay import read_applied_order
  events, vws = [], {}
  dispatch, install, end_wave = (virtual_worker.VirtualWorker.dispatch, virtual_worker.VirtualWorker.install_pull,
                                 virtual_worker.VirtualWorker.end_wave)

  def logged_dispatch(self, task, mb):
    vws[self.vw_id] = self
    events.append(("task", self.vw_id, task))
    return dispatch(self, task, mb)

  def logged_install(self, vector_clock, flat, shard_vector_clocks=None):
    events.append(("pull", self.vw_id, tuple(vector_clock)))
    return install(self, vector_clock, flat, shard_vector_clocks)

  def logged_end_wave(self, wave_id):
    events.append(("push", self.vw_id, wave_id))
    return end_wave(self, wave_id)

  monkeypatch.setattr(virtual_worker.VirtualWorker, "dispatch", logged_dispatch)
  monkeypatch.setattr(virtual_worker.VirtualWorker, "install_pull", logged_install)
  monkeypatch.setattr(virtual_worker.VirtualWorker, "end_wave", logged_end_wave)
  plain_times = emulation.virtual_task_times

  def with_ps_times(job):  # pushes and pull replies take time: waves land while a reply travels
    times, emulate_plan = plain_times(job)
    return [dataclasses.replace(t, push_s=0.005, pull_s=0.1) for t in times], emulate_plan

  monkeypatch.setattr(emulation, "virtual_task_times", with_ps_times)
  lr, batch, num_mb = 0.05, 16, 18
  c = tiny.get_config()
  c.update({"data_dir": str(synthetic_data_dir), "check_counts": False, "progress": False, "method": "pipedream",
            "num_virtual_workers": 2, "num_stages": 3, "num_minibatches": num_mb, "staleness_bound": 1,
            "emulate_stage_ms": "10,20,10;30,30,30", "optimizer": "momentum", "learning_rate": lr,
            "batch_size": batch, "ps_apply": ps_apply, "vertical_sync": vertical_sync, "pull_every_wave": True,
            "checkpoint_every_waves": 0})
  summary = virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path))
  nm = summary["num_inflight"]
  assert nm == 3 and sorted(vws) == [0, 1]
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  layout = ParamLayout.from_layer_params(params0)
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, 2, v, batch, 0) for v in range(2)]
  partitions = [[tuple(r) for r in summary["partitions"][str(v)]] for v in range(2)]
  final, latest, k_used, seen = _pipedream_oracle(
      events, read_applied_order(tmp_path), partitions, layout.flatten(params0), layout, spec,
      optax.sgd(lr, momentum=0.9), sources, nm, vertical_sync)
  # the cases under test happened
  assert seen["peer_carried"] >= 4 and seen["own_kept"] >= 2, seen
  assert (seen["stash_rebased"] > 0) == vertical_sync, seen
  records = [json.loads(l) for l in (tmp_path / "minibatches.jsonl").read_text().splitlines()]
  assert len(records) == 2 * num_mb
  for r in records:
    assert r["stage_versions"] == [k_used[(r["vw_id"], r["minibatch_id"])][s] for s in range(3)], r
  actual = layout.flatten(checkpoint.restore_weights(tmp_path / "checkpoint"))
  np.testing.assert_allclose(actual, final, rtol=1e-5, atol=1e-6)
  for v, vw in vws.items():
    np.testing.assert_allclose(layout.flatten(vw.layer_params()), np.concatenate(latest[v]), rtol=1e-5, atol=1e-6)
