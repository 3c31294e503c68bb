"""Stage ranks without mpiexec: the rank layout and settings, the header check, the version wait, and a VW whose
stages run on separate (in-process, threaded) ranks through the real protocol, checked by the replay oracle and
against the same VW in one process."""

import dataclasses
import re
import threading
import time
import types

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.jobs import job_config
from hetpipe_jax.mpi import rank_layout
from hetpipe_jax.mpi import stage_client
from hetpipe_jax.mpi import stage_link
from hetpipe_jax.mpi import stage_server
from hetpipe_jax.mpi import wire
from hetpipe_jax.mpi.ps_client import MPIPSClient, StageRankPSClient
from hetpipe_jax.mpi.ps_server import ParameterServerService
from hetpipe_jax.ps import param_server
from hetpipe_jax.ps.shards import ShardLayout, VWParts
from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.runtime import placement
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime import virtual_worker
from hetpipe_jax.runtime.param_layout import ParamLayout
from hetpipe_jax.runtime.stage_executor import Completion
from tests import replay
from tests.fake_mpi import FakeWorld
from tests.pipeline_util import build_vw, tiny_config

THREE_STAGES = [[0, 2], [2, 3], [3, 4]]


def _settings(**overrides):
  c = tiny_config(**overrides)
  s = job_config.with_ps_shards(c, job_config.resolve_settings(c))
  return job_config.with_stage_ranks(c, s)


# ------------------------------------------------------------------------------------------------ layout, settings
def test_stage_groups_and_the_rank_layout():
  assert rank_layout.stage_groups(["a", "b", "a"], "gpu") == ((0,), (1,), (2,))
  assert rank_layout.stage_groups(["a", "a", "b", "b"], "node") == ((0, 1), (2, 3))
  assert rank_layout.stage_groups(["a", "b", "a"], "node") == ((0, 2), (1,))
  groups = [((0,), (1,), (2,)), ((0, 1), (2,))]
  # shards 0-1, drivers 2-3 (each VW's group 0), then VW 0's further groups, then VW 1's
  assert rank_layout.stage_rank_layout(2, groups) == [(2, 0, (0,)), (3, 1, (0, 1)), (4, 0, (1,)), (5, 0, (2,)),
                                                   (6, 1, (2,))]
  assert rank_layout.stage_ranks_of_vw(2, groups, 0) == [2, 4, 5]
  assert rank_layout.stage_ranks_of_vw(2, groups, 1) == [3, 3, 6]
  with pytest.raises(rank_layout.LaunchError, match="grouping 'rack'"):
    rank_layout.stage_groups(["a"], "rack")


def test_stage_rank_settings_world_size_and_refusals():
  s = _settings(num_stages=3, num_ps_shards=2, stage_ranks=True, checkpoint_every_waves=0)
  assert s.stage_groups == (((0,), (1,), (2,)),) * 2
  assert s.num_stage_ranks == 4 and s.world_size == 8  # 2 shards + 2 drivers + 4 stage ranks
  with pytest.raises(job_config.ConfigError, match="MPI world size is 6 .* ranks 4..7 = the VWs' further stages"):
    job_config.check_world_size(s, 6)
  off = _settings(num_stages=3, num_ps_shards=2, checkpoint_every_waves=0)
  assert off.stage_groups == () and off.world_size == 4
  # "node" grouping without a plan: every stage on one node, so no stage ranks
  assert _settings(num_stages=3, stage_ranks=True, stage_rank_grouping="node",
                   checkpoint_every_waves=0).world_size == 3
  assert _settings(stage_ranks=True, num_stages=3).stage_groups  # with checkpoints (the default, every 100 waves)
  with pytest.raises(job_config.ConfigError, match="config.stage_ranks=True runs HetPipe's pipeline"):
    _settings(stage_ranks=True, method="gpipe", checkpoint_every_waves=0)
  with pytest.raises(job_config.ConfigError, match="config.stage_rank_grouping='rack'"):
    _settings(stage_rank_grouping="rack")
  assert job_config.resolve_job(tiny_config(stage_ranks=True, num_stages=3), resume=True).resume  # and resume


# ------------------------------------------------------------------------------------------------ the header
def test_a_header_that_does_not_match_is_an_error_naming_both_ranks():
  h = wire.make_header(wire.Kind.ACTIVATION, 1, minibatch=5, stage=0, version=7, size=64)
  ok = dict(source=2, dest=6, kinds=(wire.Kind.ACTIVATION,), vw=1, minibatch=5, stage=0, version=7, size=64)
  assert wire.check_header(h, **ok).kind is wire.Kind.ACTIVATION
  for field, value, words in (("version", 8, "version 7 (expected 8)"), ("size", 32, "size 64 (expected 32)"),
                              ("minibatch", 4, "minibatch 5 (expected 4)"), ("vw", 0, "vw 1 (expected 0)"),
                              ("stage", 1, "stage 0 (expected 1)")):
    with pytest.raises(wire.ProtocolError, match=rf"rank 6 received from rank 2 a ACTIVATION header that "
                                                rf"does not match: {re.escape(words)}"):
      wire.check_header(h, **{**ok, field: value})
  with pytest.raises(wire.ProtocolError, match=r"rank 6 received from rank 2 a ACTIVATION header that does "
                                              r"not match: kind ACTIVATION \(expected GRADIENT\)"):
    wire.check_header(h, **{**ok, "kinds": (wire.Kind.GRADIENT,)})
  bad = h.copy()
  bad[0] = 1234
  with pytest.raises(wire.ProtocolError, match="rank 6 received from rank 2 a message with bad magic"):
    wire.check_header(bad, **ok)



@pytest.mark.parametrize("field, value, words", [("version", 99, "version 99 (expected 3)"),
                                                 ("kind", int(wire.Kind.GRADIENT), "kind GRADIENT"),
                                                 ("size", 7, "size 7 (expected 64)")])
def test_a_link_refuses_an_activation_whose_header_does_not_match(field, value, words):
  """Stage 0 on rank 1 sends minibatch 0's activation to stage 1 on rank 2; a header altered in flight (weight
  version, kind, size) is refused by the receiving stage with both ranks named."""
  world = FakeWorld()
  boundaries = [((4, 3), np.dtype(np.float32)), ((4, 16), np.dtype(np.float32))]
  sender = stage_link.StageLink(world.comm(1), 0, [1, 2], boundaries, 4, ahead=2)
  receiver = stage_link.StageLink(world.comm(2), 0, [1, 2], boundaries, 4, ahead=2)

  def tamper(src, dst, tag, data):
    if data.dtype == np.int64 and data.size == wire.HEADER_SIZE:
      data[wire.FIELDS.index(field)] = value
    return data

  world.tamper = tamper
  sender.send_activation(0, 0, 3, np.ones((4, 16), np.float32)).block_until_ready()
  with pytest.raises(wire.ProtocolError, match=rf"rank 2 received from rank 1 .*{re.escape(words)}"):
    receiver.recv_activation(1, 0, 3)
  world.tamper = None  # an unaltered message goes through
  sender.send_activation(0, 1, 3, np.full((4, 16), 2.0, np.float32)).block_until_ready()
  np.testing.assert_array_equal(receiver.recv_activation(1, 1, 3), np.full((4, 16), 2.0, np.float32))


def test_control_messages_from_two_threads_arrive_whole():
  """The driver sends its control stream from the scheduler's thread (pulls: header + payload) and from the local
  executors' threads (a remote stage's task, started by a completion booked there). Every header reaches the stage
  rank directly followed by its own payload: no other message between them (CI once saw a TASK header land in a
  PULL's payload buffer: MPI's truncation error). The world pauses after each send to widen the window."""
  world = FakeWorld()
  driver = world.comm(0)
  isend = driver.Isend

  def slow_isend(buf, dest, tag):
    request = isend(buf, dest, tag)
    time.sleep(2e-4)  # another thread may send now
    return request

  driver.Isend = slow_isend
  remote = stage_client.RemoteStages(driver, 0, types.SimpleNamespace(stage_ranks=[0, 1], is_local=lambda s: s == 0))
  rounds = 150

  def send_pulls():
    for v in range(rounds):
      remote.on_pull(v, [v, v + 1])
      time.sleep(1e-4)  # between messages too, so the threads take turns

  pulls = threading.Thread(target=send_pulls)
  pulls.start()
  for p in range(rounds):
    remote.start_task(Task(1, TaskKind.FORWARD, p), 0, None)
    time.sleep(1e-4)
  pulls.join()
  stream = list(world.messages[(0, 1, wire.TAG_CONTROL)])
  kinds, i = [], 0
  while i < len(stream):
    header = stream[i]
    assert header.dtype == np.int64 and header.size == wire.HEADER_SIZE, (i, header)
    kind = wire.check_header(header, source=0, dest=1, kinds=(wire.Kind.PULL_INSTALL, wire.Kind.TASK), vw=0).kind
    kinds.append(kind)
    if kind is wire.Kind.PULL_INSTALL:
      version = header[wire.FIELDS.index("version")]
      np.testing.assert_array_equal(stream[i + 1], [version, version + 1])  # its own payload, next
      i += 1
    i += 1
  assert kinds.count(wire.Kind.PULL_INSTALL) == kinds.count(wire.Kind.TASK) == rounds
  switches = sum(a is not b for a, b in zip(kinds, kinds[1:]))
  assert switches >= rounds // 4, switches  # the two threads did send side by side


# ------------------------------------------------------------------------------------------------ the version wait
def test_a_task_waits_until_its_version_has_been_applied():
  """A stage rank's executor asks for version 2 while the rank holds only version 1 (its weights still arriving):
  it waits, and runs on version 2's weights once they are installed, never on version 1's."""
  v = virtual_worker.WeightVersion(("w1",), 1, (0,), 1)
  store = stage_server.VersionStore(v)
  got = []
  t = threading.Thread(target=lambda: got.append(store.get(2).params))
  t.start()
  time.sleep(0.3)
  assert not got and t.is_alive()  # still waiting
  store.install(dataclasses.replace(v, params=("w2",), version_id=2))
  t.join(5)
  assert got == [("w2",)] and store.num_waits == 1 and store.wait_s >= 0.25
  assert store.get(1).params == ("w1",)
  store.keep_only({2})
  with pytest.raises(wire.ProtocolError, match="weight version 1 was dropped"):
    store.get(1)


# ------------------------------------------------------------------------------------------------ a linked VW
class _PullLog(MPIPSClient):
  """The driver's client, logging per pull reply ``(vector clock, waves the VW had pushed when it took the reply)``."""

  vw = None

  def poll_pull(self):
    reply = super().poll_pull()
    if reply is not None:
      self.pulls.append((reply[0], self.vw.stats.num_pushes))
    return reply


def _linked_vw(data_dir, *, ranks, num_inflight, staleness_bound, tx, num_vws, ps_apply, batch_size=16, num_mb,
               peer_rank=None, grad_clip_norm=0.0):
  """VW 0 with its stages on ``ranks`` (threads of this process over :class:`FakeWorld`), the real PS service loop
  on rank 0 (one shard) and, with ``num_vws = 2``, VW 1 on ``peer_rank`` (scripted by :func:`_run_linked`):
  ``(driver VirtualWorker, stage-rank servers, source, params0, world, job)``."""
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  layout = ParamLayout.from_layer_params(params0)
  dataset = fashion_mnist.load_fashion_mnist(data_dir, expected_counts=None)
  source = sharding.ShardedMinibatches(dataset, num_vws, 0, batch_size, 0)
  world = FakeWorld()
  devices = jax.devices()[:len(THREE_STAGES)]
  boundaries = stage_link.stage_boundaries(spec, THREE_STAGES, batch_size)
  offsets = layout.layer_offsets
  ranges = [(offsets[a], offsets[b]) for a, b in THREE_STAGES]
  shard_layout = ShardLayout.single(layout.num_params, spec.num_layers)
  parts = [VWParts.build(shard_layout, 0, ranks, ranges)]
  if num_vws == 2:
    parts.append(VWParts.build(shard_layout, 1, [peer_rank] * 3, ranges))
  server = param_server.ParameterServer(layout.flatten(params0), num_vws, ps_apply)
  service = ParameterServerService(world.comm(0), server, num_minibatches_per_vw=num_mb, num_inflight=num_inflight,
                                   evaluate=None, eval_every_waves=0, log_every_waves=1,
                                   log_metrics=lambda line: None, progress=False, first_vw_rank=1, parts=parts)
  client = _PullLog(world.comm(ranks[0]), 0, layout.num_params, num_vws, parts=parts[0])
  client.pulls = []

  def make(rank):
    comm = world.comm(rank)
    link = stage_link.StageLink(comm, 0, ranks, boundaries, num_mb, ahead=num_inflight + 1)
    driver = rank == ranks[0]
    remote = stage_client.RemoteStages(comm, 0, link) if driver else None
    stages = stages_lib.build_stages(spec, THREE_STAGES, devices, tx, grad_clip_norm=grad_clip_norm)
    return virtual_worker.VirtualWorker(
        stages, layout, params0, virtual_worker.WSPSettings(0, num_vws, num_inflight, staleness_bound),
        virtual_worker.UpdateSettings(tx),
        virtual_worker.VWHooks(source.get, client) if driver else virtual_worker.VWHooks(),
        placement.LinkedStages(link, remote))

  driver = make(ranks[0])
  client.vw = driver
  servers = []
  for r in sorted(set(ranks) - {ranks[0]}):
    vw = make(r)
    ps = StageRankPSClient(world.comm(r), parts[0], stage_server.StageRankServer.local_index_of(vw), num_vws)
    servers.append(stage_server.StageRankServer(world.comm(r), vw, ranks[0], source.get(0)[1], ps,
                                               shard_layout.index))
  job = {"server": server, "service": service, "client": client, "parts": parts, "world": world}
  return driver, servers, source, params0, world, job


def _run_linked(driver, servers, num_mb, job, peer_waves=(), lag=1):
  """Runs the driver, its stage ranks, the PS service and (with ``peer_waves``) VW 1, which pushes its wave
  ``c - lag`` once VW 0's wave ``c`` is whole at the PS (all its parts arrived), so pulls lack VW 0's last waves."""
  errors, reports = [], []
  nm = driver.num_inflight
  num_waves = num_mb // nm
  server = job["server"]

  def serve(server):
    try:
      server.serve()
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
      # under MPI a failing rank aborts the world; here the driver's run gets the error as a failed task
      remote = driver.placement.remote
      while remote._done is None:  # pylint: disable=protected-access
        time.sleep(0.01)
      remote._done.put(Completion(Task(-1, TaskKind.FORWARD, -1), 0.0, 0.0, error=e))  # pylint: disable=protected-access

  def ps():
    try:
      job["service"].run()
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  def peer():
    vw1 = MPIPSClient(job["world"].comm(job["parts"][1].driver), 1, server.weights.size, 2, parts=job["parts"][1])
    for k, wave in enumerate(peer_waves):
      while server.state.pushed_waves[0] < min(k + lag + 1, num_waves) and not errors:
        time.sleep(1e-3)
      vw1.push(k, wave, 0.0, nm)
    vw1.finish(num_waves, {})

  threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in servers]
  threads.append(threading.Thread(target=ps, daemon=True))
  if peer_waves:
    threads.append(threading.Thread(target=peer, daemon=True))
  for t in threads:
    t.start()
  driver.run(num_mb)
  reports.append(driver.placement.remote.stop(job["client"].num_pulls_requested))
  job["client"].finish(num_waves, {})
  for t in threads:
    t.join(30)
  assert not errors, errors
  assert not any(t.is_alive() for t in threads)
  return reports[0]


def _layer_params(driver, servers):
  """The VW's current per-layer weights, each stage's from the rank that holds it."""
  out = []
  for s in range(len(THREE_STAGES)):
    holder = driver if s in driver.local_stages else next(x.vw for x in servers if s in x.local)
    out.extend(jax.device_get(holder.version.params[s]))
  return out


@pytest.mark.parametrize("ranks", [[1, 3, 4], [1, 3, 3], [1, 1, 3]])
def test_stage_ranks_equal_the_replay_of_recorded_versions_with_lagging_pulls(synthetic_data_dir, ranks):
  """VW 0 (Nm = 2, D = 1, clock-aligned PS) beside a scripted VW 1 (rank 2) one wave behind, its 3 stages on 3 ranks
  (or 2: stages 1-2 sharing one, or 0-1 on the driver), through the real PS service loop: each stage rank pushes its
  stages' part of every wave to the shard and takes its part of every pull from it; pulls lack VW 0's last pushed
  wave, which every rank must re-add to its stages. The VW's final weights (each stage from its rank) and the final
  global weights equal the sequential replay of the records; every stage rank ran its tasks; the stage ranks'
  versions are the driver's; no wave delta and no pulled weight of a stage rank's layers passed through the
  driver."""
  nm, num_waves = 2, 5
  n = nm * num_waves
  tx = optax.sgd(0.05, momentum=0.9)
  driver, servers, source, params0, world, job = _linked_vw(synthetic_data_dir, ranks=ranks, num_inflight=nm,
                                                            staleness_bound=1, tx=tx, num_vws=2,
                                                            ps_apply="clock_aligned", num_mb=n, peer_rank=2)
  server, client = job["server"], job["client"]
  rng = np.random.default_rng(7)
  peer = [(0.01 * rng.standard_normal(server.weights.size)).astype(np.float32) for _ in range(num_waves)]
  reports = _run_linked(driver, servers, n, job, peer_waves=peer, lag=1)
  assert any(pushed > vc[0] for vc, pushed in client.pulls), client.pulls  # the case under test happened
  remote = [s for s in range(3) if ranks[s] != ranks[0]]
  assert sum(r["tasks"] for r in reports.values()) == sum(n if s == 2 else 2 * n for s in remote)
  for x in servers:
    assert x.vw.version.version_id == driver.version.version_id  # the same changes, in the same order
    assert len(x.store) <= 2  # only versions an in-flight minibatch holds, and the latest
    assert world.sent[(x.rank, 0, 12)] == num_waves  # its wave parts, straight to the shard (PUSH payloads)
  # activations / gradients went rank to rank, never through the driver for stages it does not hold
  data = {(src, dst) for (src, dst, tag) in world.sent if tag >= wire.TAG_STAGE_DATA}
  assert data == {(ranks[s], ranks[s + 1]) for s in range(2) if ranks[s] != ranks[s + 1]} | \
      {(ranks[s + 1], ranks[s]) for s in range(2) if ranks[s] != ranks[s + 1]}
  assert not any(tag == wire.TAG_REPLY and src != ranks[0] and world.sent[(src, dst, tag)] > 2
                 for (src, dst, tag) in world.sent)  # only the final report (header, payload) goes to the driver
  records = [dataclasses.asdict(r) for r in driver.records]
  result = replay.replay(records, spec_of(), params0, tx, [source], nm, fixed_waves=[peer],
                         applied_order=server.state.applied)
  _assert_weights_equal_replay(driver, servers, server, result)


def _assert_weights_equal_replay(driver, servers, server, result):
  """The driver's and its stage ranks' final local weights, and the PS's global weights, equal the replay's."""
  final_local = result.local_weights(0, driver.version.vector_clock, driver.version.local_updates)
  np.testing.assert_allclose(driver.layout.flatten(_layer_params(driver, servers)), final_local, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(server.weights, result.final_global_weights(server.state.applied), rtol=1e-5, atol=1e-6)


def spec_of():
  return models.get_model("mlp_tiny")


@pytest.mark.parametrize("ranks", [[1, 3, 4], [1, 1, 3]])
def test_stage_ranks_clip_by_the_global_norm_over_every_rank(synthetic_data_dir, ranks):
  """``grad_clip_norm`` with the VW's stages on 3 (or 2) ranks, Nm = 2, D = 1, a scripted VW 1 one wave behind: each
  stage rank reports its stages' squared gradient norms, the driver sends the minibatch's global norm with its
  UPDATE, and the final local and global weights equal the replay of the records with a whole-model optax
  ``clip_by_global_norm`` (issue 23). A rank clipping by its own stages' norm would not match."""
  nm, num_waves, clip = 2, 5, 0.5
  n = nm * num_waves
  tx = optax.sgd(0.05, momentum=0.9)
  driver, servers, source, params0, world, job = _linked_vw(synthetic_data_dir, ranks=ranks, num_inflight=nm,
                                                            staleness_bound=1, tx=tx, num_vws=2,
                                                            ps_apply="clock_aligned", num_mb=n, peer_rank=2,
                                                            grad_clip_norm=clip)
  server = job["server"]
  rng = np.random.default_rng(8)
  peer = [(0.01 * rng.standard_normal(server.weights.size)).astype(np.float32) for _ in range(num_waves)]
  _run_linked(driver, servers, n, job, peer_waves=peer, lag=1)
  records = [dataclasses.asdict(r) for r in driver.records]
  whole = optax.chain(optax.clip_by_global_norm(clip), tx)
  result = replay.replay(records, spec_of(), params0, whole, [source], nm, fixed_waves=[peer],
                         applied_order=server.state.applied)
  _assert_weights_equal_replay(driver, servers, server, result)
  # the clip was active: SGD's first update, -0.05 x the clipped gradient, has norm 0.05 x clip
  first = result.updates[0][0]
  assert float(np.linalg.norm(first)) == pytest.approx(0.05 * clip, rel=1e-4)


def test_stage_ranks_train_exactly_as_one_process(synthetic_data_dir):
  """Nm = 1, D = 0, one VW: the schedule of versions is fixed, so the VW on 3 stage ranks (each pushing and pulling
  its own part at the PS service) and the same VW in one process push the same wave updates bit for bit (the same
  records, the same final global weights)."""
  nm, n = 1, 6
  tx = optax.sgd(0.05, momentum=0.9)
  one, _, params0, _, server_one = build_vw(synthetic_data_dir, partition=THREE_STAGES, num_inflight=nm,
                                            staleness_bound=0, optimizer=tx, batch_size=16)
  one.run(n)
  layout = ParamLayout.from_layer_params(params0)
  driver, servers, _, _, _, job = _linked_vw(synthetic_data_dir, ranks=[1, 2, 3], num_inflight=nm,
                                             staleness_bound=0, tx=tx, num_vws=1, ps_apply="on_receipt", num_mb=n)
  _run_linked(driver, servers, n, job)
  fields = ("minibatch_id", "wave_id", "local_clock_at_injection", "version_local_updates", "version_global_clock",
            "version_vector_clock")
  assert [[getattr(r, f) for f in fields] for r in driver.records] == [[getattr(r, f) for f in fields]
                                                                        for r in one.records]
  np.testing.assert_allclose([r.loss for r in driver.records], [r.loss for r in one.records], rtol=1e-6)
  np.testing.assert_array_equal(job["server"].weights, server_one.weights)
  np.testing.assert_array_equal(layout.flatten(_layer_params(driver, servers)), layout.flatten(one.layer_params()))


def test_a_remote_stage_task_is_a_command_with_its_version(synthetic_data_dir):
  """The driver decides: a remote stage's task reaches its rank as TASK (stage, kind, minibatch, version, emulated
  nanoseconds) on the control stream, after the minibatch's INJECT."""
  world = FakeWorld()
  link = stage_link.StageLink(world.comm(1), 0, [1, 2], [None, ((2, 3), np.dtype(np.float32))], 4, ahead=2)
  remote = stage_client.RemoteStages(world.comm(1), 0, link)
  remote.on_inject(3, 7, np.arange(2, dtype=np.int32))
  remote.start_task(Task(1, TaskKind.FORWARD_BACKWARD, 3), 7, 0.025)
  got = []
  for _ in range(3):
    buf = np.empty(wire.HEADER_SIZE if len(got) != 1 else 2, np.int64 if len(got) != 1 else np.int32)
    req = world.comm(2).Irecv(buf, source=1, tag=wire.TAG_CONTROL)
    assert req.Test()
    got.append(buf)
  assert wire.check_header(got[0], source=1, dest=2, kinds=(wire.Kind.INJECT,), vw=0, minibatch=3, version=7,
                           size=2)
  np.testing.assert_array_equal(got[1], [0, 1])  # the labels, to the last stage's rank
  wire.check_header(got[2], source=1, dest=2, kinds=(wire.Kind.TASK,), vw=0, minibatch=3, stage=1, version=7,
                    arg0=stage_link.TASK_CODES[TaskKind.FORWARD_BACKWARD], arg1=25_000_000)


def test_a_gpu_rank_table_must_give_every_rank_its_stages_gpus():
  """On GPU the launcher's table is checked against the job's layout on every rank before any work: the 4-node ED
  plan with stage ranks (VW v on GPU v of every node) accepts the launcher's table and refuses one that gives a stage
  rank another GPU, naming HETPIPE_RANK_DEVICES and the rank."""
  from hetpipe_jax import launch
  from hetpipe_jax.mpi import rank_devices
  from hetpipe_jax.jobs import rank_setup
  plan_path = "experiments/plans/local_cpu_4node_mlp_tiny_ed.json"
  settings = _settings(plan=plan_path, platform="gpu", stage_ranks=True, checkpoint_every_waves=0)
  _, _, argv = launch.build_command(plan_path, "", "experiments/configs/tiny.py", "/tmp/x", None, [],
                                    stage_rank_grouping="gpu")
  table = rank_devices.parse_table(argv[argv.index("-genv") + 2])
  rank_setup.check_rank_devices(settings, table)  # the launcher's own table fits
  bad = list(table)
  bad[5] = (0,)  # VW 1's driver (stage 0 on GPU 1 of node 0) told to see GPU 0
  with pytest.raises(job_config.ConfigError, match=r"HETPIPE_RANK_DEVICES: rank 5 runs stages on GPUs \[1\] but may "
                     r"see only \[0\]"):
    rank_setup.check_rank_devices(settings, bad)
