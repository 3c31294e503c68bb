"""Sharded parameter servers (HetPipe §8.1 "Parameter Placement"): the layer -> shard rule, the settings, and MPI runs
whose final weights equal a per-shard sequential replay and whose PS traffic matches the planner's prediction
(evaluation during a sharded run: tests/test_ps_shard_eval.py; scripts/bench_ps.py: tests/test_scripts_smoke.py)."""

import json

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.jobs import checkpoint, job_config
from hetpipe_jax.mpi import wire
from hetpipe_jax.planning import plan_format, ps_placement
from hetpipe_jax.ps.shards import ShardLayout, VWParts, WaveAssembler
from tests.mpi_util import SHARDED_RUN, read_jsonl
from tests.pipeline_util import tiny_config

ED_DEFAULT = "experiments/plans/local_cpu_2node_mlp_tiny_ed_default.json"
ED_LOCAL = "experiments/plans/local_cpu_2node_mlp_tiny_ed_local.json"  # run end to end in tests/test_launch.py
MLP_TINY_OFFSETS = (0, 0, 25120, 26176, 26506)  # mlp_tiny's flat layer offsets: Flatten, then 3 Dense layers


def _settings(**overrides):
  c = tiny_config(**overrides)
  return job_config.with_ps_shards(c, job_config.resolve_settings(c))


def test_shard_layout_gathers_and_scatters_every_element_once():
  layout = ShardLayout.build([0, 0, 5, 7, 10], [None, 0, 1, 0], 2)
  assert [i.tolist() for i in layout.index] == [[0, 1, 2, 3, 4, 7, 8, 9], [5, 6]]
  flat = np.arange(10, dtype=np.float32)
  out = np.full(10, -1, np.float32)
  for s in range(2):
    layout.scatter(out, s, layout.gather(flat, s))
  np.testing.assert_array_equal(out, flat)
  assert layout.params_in_range(0, 5, 10) == 3 and layout.params_in_range(1, 0, 5) == 0
  with pytest.raises(ValueError, match="layer 1 has 5 parameters but no PS shard"):
    ShardLayout.build([0, 0, 5], [None, None], 1)


def test_runtime_placement_is_the_planners():
  """The runtime's layer -> shard comes from the same rule as the plan's prediction, for both policies."""
  for path, policy in ((ED_DEFAULT, "default"), (ED_LOCAL, "local")):
    s = _settings(plan=path, checkpoint_every_waves=0)
    assert s.num_ps_shards == 2 and s.ps_placement == policy and s.shard_nodes == ("n0", "n1")
    assert s.world_size == 4 and s.sources["num_ps_shards"].startswith("plan")
    plan = plan_format.load_plan(path)
    shards = job_config.ps_layer_shards(s, [vw.partition for vw in plan.virtual_workers], [False, True, True, True])
    assert [None if x is None else s.shard_nodes[x] for x in shards] == plan.ps_placement["layer_to_node"]
  # default is round-robin over parameterised layers; local follows the stages' nodes
  assert ps_placement.assign_layers("default", ["a", "b"], [False, True, True, True], []) == [None, "a", "b", "a"]
  assert ps_placement.assign_layers("local", ["a", "b"], [True, True], [["b", "a"], ["b", "b"]]) == ["b", "a"]


def test_a_shard_without_parameters_is_refused_under_default_placement():
  """Issue 23 defect 6: more shards than layers with parameters left a shard empty and the run went on silently.
  Under ``default`` placement (round-robin over the parameterised layers) it is refused naming the empty shards and
  the most that can hold some; ``local`` placement keeps one shard per node, empty where the node's stages have no
  parameters (the 4-node ED plan on mlp_tiny: node n2 runs only the parameterless Flatten layer)."""
  has_params = [b > a for a, b in zip(MLP_TINY_OFFSETS, MLP_TINY_OFFSETS[1:])]
  assert has_params == [False, True, True, True]
  parts = [((0, 2), (2, 4))] * 2
  for num in (1, 2, 3):  # round-robin by hand: every shard holds a parameterised layer
    s = _settings(num_ps_shards=num, checkpoint_every_waves=0, eval_every_epochs=0.0)
    assert job_config.ps_layer_shards(s, parts, has_params) == [None] + [i % num for i in range(3)]
  for num, empty in ((4, "shard 3"), (6, "shards 3, 4, 5")):
    s = _settings(num_ps_shards=num, checkpoint_every_waves=0, eval_every_epochs=0.0)
    with pytest.raises(job_config.ConfigError,
                       match=rf"^config.num_ps_shards={num}: PS {empty} would hold no parameters \(the model has 3 "
                             r"layers with parameters.*set --config.num_ps_shards to at most 3"):
      job_config.ps_layer_shards(s, parts, has_params)
  path = "experiments/plans/local_cpu_4node_mlp_tiny_ed.json"
  s = _settings(plan=path, checkpoint_every_waves=0, eval_every_epochs=0.0)
  assert s.ps_placement == "local" and s.shard_nodes == ("n0", "n1", "n2", "n3")
  plan = plan_format.load_plan(path)
  shards = job_config.ps_layer_shards(s, [vw.partition for vw in plan.virtual_workers], has_params)
  assert [None if x is None else s.shard_nodes[x] for x in shards] == plan.ps_placement["layer_to_node"]
  assert 2 not in shards  # n2's shard is empty, and accepted


@pytest.mark.parametrize("overrides, message", [
    ({"num_ps_shards": 0}, "config.num_ps_shards=0"),
    ({"ps_placement": "local"}, "config.ps_placement='local' needs a plan"),
    ({"ps_placement": "nearest"}, "config.ps_placement='nearest'"),
])
def test_bad_shard_settings_are_refused_naming_the_setting(overrides, message):
  with pytest.raises(job_config.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    _settings(**overrides)


def test_checkpoints_and_evaluation_during_the_run_are_accepted_with_several_shards():
  assert _settings(num_ps_shards=2, checkpoint_every_waves=100, eval_every_epochs=1.0).num_ps_shards == 2


def test_one_shard_is_the_default_without_a_plan():
  s = _settings()
  assert (s.num_ps_shards, s.ps_placement, s.world_size) == (1, "default", 3)
  assert s.sources["num_ps_shards"].startswith("default")


@pytest.mark.mpi
def test_sharded_run_equals_per_shard_replay_and_moves_the_predicted_bytes(sharded_run, synthetic_data_dir):
  """ED plan on two mapped nodes, default placement, 2 shards, VWs of unequal speed, on_receipt: every shard
  applied every wave once (its own order), the final weights equal a replay that follows each shard's log, the
  WSP bound holds, and the transport's cross-node PS bytes equal ps_placement's prediction (within 1%)."""
  from tests.replay import read_applied_order, replay_final_weights
  nm, mb, batch = 2, 16, 32
  assert SHARDED_RUN == {"plan": ED_DEFAULT, "num_minibatches": mb, "staleness_bound": 1, "optimizer": "momentum",
                         "learning_rate": 0.05, "checkpoint_every_waves": 0, "emulate_stage_ms": "5,5;15,15"}
  workdir = sharded_run  # tests/conftest.py's: 2 PS shards + 2 VWs
  summary = json.loads((workdir / "summary.json").read_text())
  config = json.loads((workdir / "config.json").read_text())
  assert summary["num_ps_shards"] == config["num_ps_shards"] == 2
  assert summary["ps_placement"] == config["ps_placement"] == "default"
  assert config["setting_sources"]["num_ps_shards"].startswith("plan")
  num_waves = mb // nm
  assert summary["applied_waves_count_per_shard"] == [2 * num_waves] * 2
  assert summary["applied_waves_in_order_per_shard"] == [True, True]
  records = read_jsonl(workdir / "minibatches.jsonl")
  assert len(records) == 2 * mb
  for r in records:
    assert len(r["version_shard_vector_clocks"]) == 2
    assert r["version_vector_clock"] == [min(c[u] for c in r["version_shard_vector_clocks"]) for u in range(2)]
    assert r["local_clock_at_injection"] - 1 <= r["version_global_clock"] <= r["local_clock_at_injection"], r
  logs = [read_applied_order(workdir, s) for s in range(2)]
  for log in logs:
    assert sorted(log) == [(w, v) for w in range(num_waves) for v in range(2)]
  # bytes: the transport's counts per rank pair (ranks 0-1 shards, 2-3 VWs) and the part crossing nodes
  ps_bytes = summary["ps_bytes"]
  floats = summary["ps_shards"]["floats_per_shard"]
  assert ps_bytes["by_rank_pair"]["2->0"] == ps_bytes["by_rank_pair"]["3->1"] // floats[1] * floats[0] == \
      num_waves * 4 * floats[0]
  assert ps_bytes["predicted_crossing_nodes_per_wave"] == 5280  # layer 3 (1,320 bytes) on n0, run on n1
  assert ps_bytes["crossing_nodes_per_wave"] == pytest.approx(ps_bytes["predicted_crossing_nodes_per_wave"], rel=0.01)
  assert ps_bytes["crossing_nodes"] >= num_waves * 2 * 1320  # every VW pushed layer 3 across nodes every wave
  # the oracle: a per-shard sequential replay of the recorded versions
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  from hetpipe_jax.runtime.param_layout import ParamLayout
  layout = ParamLayout.from_layer_params(params0)
  shard_layout = ShardLayout.build(layout.layer_offsets, summary["ps_shards"]["layer_shards"], 2)
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, 2, v, batch, 0) for v in range(2)]
  expected = replay_final_weights(records, spec, params0, optax.sgd(0.05, momentum=0.9), sources, nm, logs[0],
                                  shards=list(zip(shard_layout.index, logs)))
  actual = layout.flatten(checkpoint.restore_weights(workdir / "checkpoint"))
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


class _LaggingShardClient:
  """VW 0's client of two in-process PS shards (each an on-receipt :class:`ParameterServer` over its slice) where
  shard 1 receives each of VW 0's waves ``lag`` waves late, and a scripted VW 1 pushes wave ``c - 1`` to both shards
  right after VW 0 pushes wave ``c``. So pulls see the shards at different vector clocks, and VW 0 must re-add an own
  wave on shard 1's layers only (with ``lag = 2``, at two pulls in a row)."""

  def __init__(self, servers, shards, peer_waves, lag=1):
    self.servers, self.shards, self.peer_waves, self.lag = servers, shards, peer_waves, lag
    self.late: list[tuple[int, np.ndarray]] = []  # VW 0's waves shard 1 has not received yet
    self.peer_pushed = 0
    self.outstanding = False
    self.replies: list[tuple] = []

  def _serve(self):
    for s in self.servers:
      s.state.serve_pending_pulls()

  def _peer_push(self, wave):
    for i, s in enumerate(self.servers):
      s.push(1, wave, self.shards.gather(self.peer_waves[wave], i))
    self.peer_pushed = wave + 1

  def push(self, wave_id, flat_delta, loss_sum, num_minibatches):
    del loss_sum, num_minibatches
    self.servers[0].push(0, wave_id, self.shards.gather(flat_delta, 0))
    self.late.append((wave_id, self.shards.gather(flat_delta, 1).copy()))
    while len(self.late) > self.lag:
      self.servers[1].push(0, *self.late.pop(0))
    if wave_id >= 1:
      self._peer_push(wave_id - 1)
    self._serve()

  def request_pull(self, required_clock):
    for s in self.servers:
      s.state.request_pull(0, required_clock)
    self.outstanding = True

  def poll_pull(self):
    if not self.outstanding or any(0 in s.state.pending_pulls for s in self.servers):
      return None
    self.outstanding = False
    snaps = [s.snapshot() for s in self.servers]
    flat = np.empty(self.shards.num_params, np.float32)
    for i, (_, part) in enumerate(snaps):
      self.shards.scatter(flat, i, part)
    per_shard = tuple(vc for vc, _ in snaps)
    vc = tuple(min(c[u] for c in per_shard) for u in range(2))
    self.replies.append(per_shard)
    return vc, flat, per_shard

  def finish(self):
    for w, part in self.late:
      self.servers[1].push(0, w, part)
    self.late = []
    while self.peer_pushed < len(self.peer_waves):
      self._peer_push(self.peer_pushed)


def _lagging_shard_run(data_dir, lag, staleness_bound, num_waves):
  """VW 0 (Nm 2, momentum) over :class:`_LaggingShardClient` with shard 1 ``lag`` waves late: checks its final local
  weights and the shards' final weights against the per-shard sequential replay (rtol 1e-5); returns the client."""
  from hetpipe_jax.ps import param_server
  from tests import replay
  from tests.pipeline_util import build_vw
  nm = 2
  vw, source, params0, tx, _ = build_vw(data_dir, partition=[(0, 2), (2, 4)], num_inflight=nm,
                                        staleness_bound=staleness_bound, optimizer=optax.sgd(0.05, momentum=0.9),
                                        num_vws=2)
  layout = vw.layout
  shards = ShardLayout.build(layout.layer_offsets, [None, 0, 1, 0], 2)
  w0 = layout.flatten(params0)
  servers = [param_server.ParameterServer(shards.gather(w0, s), 2) for s in range(2)]
  rng = np.random.default_rng(3)
  peer = [(0.01 * rng.standard_normal(w0.size)).astype(np.float32) for _ in range(num_waves)]
  client = _LaggingShardClient(servers, shards, peer, lag=lag)
  vw.ps, vw.ps_shards = client, shards
  vw.run(nm * num_waves)
  # the case under test happened: pulls whose shards held different numbers of VW 0's waves
  assert any(a[0] != b[0] for a, b in client.replies), client.replies
  records = [r.__dict__ for r in vw.records]
  assert any(r["version_shard_vector_clocks"][0] != r["version_shard_vector_clocks"][1] for r in records)
  logs = [list(s.state.applied) for s in servers]
  result = replay.replay(records, models.get_model("mlp_tiny"), params0, tx, [source], nm, fixed_waves=[peer],
                         shards=list(zip(shards.index, logs)))
  np.testing.assert_allclose(layout.flatten(vw.layer_params()),
                             result.local_weights(0, vw.version.shard_vector_clocks, vw.version.local_updates),
                             rtol=1e-5, atol=1e-6)
  client.finish()
  final = np.empty_like(w0)
  for s, server in enumerate(servers):
    shards.scatter(final, s, server.weights)
  result = replay.ShardedReplay([replay.Replay(w0, result.updates, [peer], nm, list(s.state.applied))
                                 for s in servers], shards.index)
  np.testing.assert_allclose(final, result.final_global_weights(), rtol=1e-5, atol=1e-6)
  return client


def test_pull_from_shards_at_different_clocks_equals_per_shard_replay(synthetic_data_dir):
  """The shards of one pull hold different waves of VW 0 (shard 1 receives them a wave late): the VW's weights
  re-add each own wave only on the shards that lack it, so its final local weights and the shards' final weights
  equal the per-shard sequential replay (rtol 1e-5)."""
  _lagging_shard_run(synthetic_data_dir, lag=1, staleness_bound=2, num_waves=5)


def test_own_waves_survive_a_shard_lagging_behind_two_pulls_in_a_row(synthetic_data_dir):
  """Shard 1 receives VW 0's waves two waves late, so an own wave is missing from shard 1's slice at two pulls in a
  row: the first pull must keep it (re-added on shard 1's layers, and kept for the next pull), the second re-add it
  again. The VW's and the shards' final weights equal the per-shard replay (rtol 1e-5)."""
  client = _lagging_shard_run(synthetic_data_dir, lag=2, staleness_bound=3, num_waves=6)
  # the case under test: some pull's shard 1 still lacks an own wave that shard 0 already held at the pull before
  twice = [i for i, (a, b) in enumerate(zip(client.replies, client.replies[1:])) if b[1][0] < a[0][0]]
  assert len(twice) >= 2, client.replies


def test_headers_from_shard_and_vw_ranks_are_checked_naming_the_ranks():
  """With S shards, rank r hosts VW r - S; a mismatched VW id or a slice of the wrong size names the ranks."""
  from hetpipe_jax.mpi import ps_client
  from hetpipe_jax.mpi.wire import Kind
  ok = wire.make_header(Kind.PUSH, 1, wave=0, size=7)
  assert ps_client.check_header(ok, 3, num_params=7, expect_kinds=(Kind.PUSH,), first_vw_rank=2).kind is Kind.PUSH
  with pytest.raises(ps_client.ProtocolError, match="rank 3 claims to be VW 0 \\(rank r hosts VW r-2\\)"):
    ps_client.check_header(wire.make_header(Kind.PUSH, 0, size=7), 3, num_params=7, expect_kinds=(Kind.PUSH,),
                           first_vw_rank=2)
  with pytest.raises(ps_client.ProtocolError, match="PUSH from rank 2 carries 9 elements, expected 7"):
    ps_client.check_header(wire.make_header(Kind.PUSH, 0, size=9), 2, num_params=7, expect_kinds=(Kind.PUSH,),
                           first_vw_rank=2)
  # a shard's reply (rank 1 < S) is not a VW: its VW field names the receiver
  weights = wire.make_header(Kind.WEIGHTS, 1, wave=0, size=7)
  assert ps_client.check_header(weights, 1, num_params=7, expect_kinds=(Kind.WEIGHTS,), first_vw_rank=2).kind \
      is Kind.WEIGHTS


class _FakeComm:
  """Just enough of an MPI communicator for one rank's code paths: Isend records (completed at once), Recv serves
  queued arrays in order."""

  class _Done:
    def Test(self):  # noqa: N802 (mpi4py's name)
      return True

  def __init__(self, incoming=()):
    self.sent, self.incoming = [], list(incoming)

  def Isend(self, buf, dest, tag):  # noqa: N802
    self.sent.append((dest, tag, np.array(buf, copy=True)))
    return self._Done()

  def Recv(self, buf, source, tag):  # noqa: N802
    src, data = self.incoming.pop(0)
    assert src == source, (src, source)
    buf[...] = np.asarray(data).reshape(buf.shape)


def test_served_pulls_are_counted_per_destination_rank():
  """The PS bytes of a pull reply are counted for the VW's rank (rank first_vw_rank + vw)."""
  from hetpipe_jax.mpi import ps_client
  from hetpipe_jax.ps.param_server import ParameterServer
  from hetpipe_jax.mpi.ps_server import ParameterServerService
  server = ParameterServer(np.zeros(5, np.float32), 2)
  comm = _FakeComm()
  service = ParameterServerService(comm, server, num_minibatches_per_vw=0, num_inflight=1, evaluate=None,
                                   eval_every_waves=0, log_every_waves=1, log_metrics=lambda line: None,
                                   progress=False, first_vw_rank=3, lead=False)
  before = dict(ps_client.PS_BYTES.sent)
  service._serve_pulls([1])  # pylint: disable=protected-access
  assert [(d, t) for d, t, _ in comm.sent] == [(4, wire.TAG_PS_HEADER), (4, wire.TAG_PS_DATA),
                                                (4, wire.TAG_PS_DATA)]
  assert ps_client.PS_BYTES.sent.get(4, 0) - before.get(4, 0) == 5 * 4


class _LiveSendComm:
  """A communicator whose ``Isend`` keeps a reference to its buffer, as MPI may read it until the send completes:
  ``complete()`` ends every outstanding send and returns ``(dest, tag, buffer contents then)``."""

  class _Request:
    def __init__(self):
      self.done = False

    def Test(self):  # noqa: N802 (mpi4py's name)
      return self.done

  def __init__(self):
    self.outstanding = []

  def Isend(self, buf, dest, tag):  # noqa: N802
    request = self._Request()
    self.outstanding.append((dest, tag, buf, request))
    return request

  def complete(self):
    out = [(d, t, np.array(b, copy=True)) for d, t, b, _ in self.outstanding]
    for *_, request in self.outstanding:
      request.done = True
    self.outstanding = []
    return out


@pytest.mark.parametrize("ps_apply", ["on_receipt", "clock_aligned"])
def test_a_pull_reply_carries_the_weights_as_answered_while_later_pushes_land(ps_apply):
  """The PS answers VW 1's pull, then applies more pushes before the reply's send completes (MPI may read a send's
  buffer until then; in virtual time the reply is installed pull_s later): the reply must carry the global weights
  and vector clock of the moment it was answered, not the live weights."""
  from hetpipe_jax.ps.param_server import ParameterServer
  from hetpipe_jax.mpi.ps_server import ParameterServerService
  server = ParameterServer(np.zeros(4, np.float32), 2, ps_apply)
  server.push(0, 0, np.full(4, 1.0, np.float32))
  server.push(1, 0, np.full(4, 2.0, np.float32))
  comm = _LiveSendComm()
  service = ParameterServerService(comm, server, num_minibatches_per_vw=0, num_inflight=1, evaluate=None,
                                   eval_every_waves=0, log_every_waves=1, log_metrics=lambda line: None,
                                   progress=False, first_vw_rank=1, lead=False)
  service._serve_pulls([1])  # pylint: disable=protected-access
  server.push(0, 1, np.full(4, 100.0, np.float32))
  server.push(1, 1, np.full(4, 1000.0, np.float32))
  assert server.weights.tolist() == [1103.0] * 4  # the pushes landed before the reply left
  sent = comm.complete()
  assert [(d, t) for d, t, _ in sent] == [(2, wire.TAG_PS_HEADER), (2, wire.TAG_PS_DATA), (2, wire.TAG_PS_DATA)]
  assert int(sent[0][2][wire.FIELDS.index("wave")]) == 1  # the header's global clock
  np.testing.assert_array_equal(sent[1][2], [3.0] * 4)
  assert sent[2][2].tolist() == [1, 1]


def test_a_sharded_pull_holds_the_element_wise_minimum_of_its_shards_vector_clocks():
  """VW 0's client of two PS shards whose replies carry different vector clocks: the pull's vector clock is, per VW,
  the minimum over shards (what every layer holds); each shard's own vector clock and slice are kept apart."""
  from hetpipe_jax.mpi.ps_client import MPIPSClient
  from hetpipe_jax.mpi.wire import Kind
  from tests.fake_mpi import FakeWorld
  shards = ShardLayout.build([0, 2, 5, 6], [0, 1, 0], 2)  # shard 0: elements 0, 1, 5; shard 1: 2, 3, 4
  world = FakeWorld()
  client = MPIPSClient(world.comm(2), 0, 6, 2, shards=shards, first_vw_rank=2)
  client.request_pull(1)
  assert client.poll_pull() is None
  replies = {0: ((3, 1), [0.0, 1.0, 5.0]), 1: ((2, 4), [2.0, 3.0, 4.0])}
  for shard, (vc, part) in replies.items():
    comm = world.comm(shard)
    comm.Isend(wire.make_header(Kind.WEIGHTS, 0, wave=min(vc), size=len(part)), dest=2,
               tag=wire.TAG_PS_HEADER)
    comm.Isend(np.array(part, np.float32), dest=2, tag=wire.TAG_PS_DATA)
    comm.Isend(np.array(vc, np.int64), dest=2, tag=wire.TAG_PS_DATA)
    if shard == 0:
      assert client.poll_pull() is None  # shard 1 has not answered
  vector_clock, flat, per_shard = client.poll_pull()
  assert vector_clock == (2, 1)
  assert per_shard == ((3, 1), (2, 4))
  np.testing.assert_array_equal(flat, np.arange(6, dtype=np.float32))


def test_rank0_assembles_the_final_weights_from_every_shard():
  from hetpipe_jax.mpi import ps_shards
  shards = ShardLayout.build([0, 3, 5, 9], [0, 1, 2], 3)
  w0 = np.zeros(9, np.float32)
  comm = _FakeComm([(1, [2]), (1, [[0, 1], [0, 0]]), (1, [4, 5]), (2, [2]), (2, [[0, 0], [0, 1]]), (2, [6, 7, 8, 9])])
  flat, logs = ps_shards.gather_shards(comm, shards, w0, np.array([1, 2, 3], np.float32),
                                         [(0, 1), (0, 0)])
  np.testing.assert_array_equal(flat, np.arange(1, 10, dtype=np.float32))
  assert logs == [[(0, 1), (0, 0)], [(0, 1), (0, 0)], [(0, 0), (0, 1)]]


def test_stage_ranks_parts_and_a_wave_counted_once_all_parts_arrived():
  """VWParts: each rank's part of a shard is its stages' elements of that shard's slice; a shard holding none of a
  VW's elements still gets the wave from the driver (an empty part); the driver receives every shard's reply.
  WaveAssembler: a wave is whole (and returned once, assembled in slice order) only when its last sender's part
  arrived; a part from a rank that is not a sender, of the wrong size or sent twice is refused."""
  # 3 layers of 2, 3 and 1 floats; shard 0 holds layers 0 and 2, shard 1 layer 1, shard 2 nothing
  shards = ShardLayout.build([0, 2, 5, 6], [0, 1, 0], 3)
  parts = VWParts.build(shards, 0, [7, 9, 9], [(0, 2), (2, 5), (5, 6)])  # stage 0 on the driver (7), 1-2 on rank 9
  assert parts.senders(0) == [7, 9] and parts.senders(1) == [9] and parts.senders(2) == [7]
  assert parts.receivers(1) == [7, 9] and parts.receivers(2) == [7]
  assert parts.flat_index[(7, 0)].tolist() == [0, 1] and parts.flat_index[(9, 0)].tolist() == [5]
  assert parts.shard_pos[(9, 0)].tolist() == [2] and parts.part_size(7, 1) == 0 and parts.part_size(7, 2) == 0
  assert parts.shards_of(9) == [0, 1] and parts.shards_of(7) == [0, 2]
  assembler = WaveAssembler([parts], 0, shards.size(0))
  assert assembler.add(0, 0, 9, np.array([3.0], np.float32)) is None  # the driver's part still missing
  assert assembler.incomplete() == [(0, 0)]
  np.testing.assert_array_equal(assembler.add(0, 0, 7, np.array([1.0, 2.0], np.float32)), [1.0, 2.0, 3.0])
  assert assembler.incomplete() == []
  assert assembler.add(0, 1, 7, np.array([1.0, 2.0], np.float32)) is None
  with pytest.raises(ValueError, match="rank 7 pushed its part of VW 0's wave 1 to shard 0 twice"):
    assembler.add(0, 1, 7, np.array([1.0, 2.0], np.float32))
  with pytest.raises(ValueError, match="rank 8 pushed VW 0's wave 1 to shard 0, whose senders for that VW are"):
    assembler.add(0, 1, 8, np.array([1.0], np.float32))
  with pytest.raises(ValueError, match="rank 9 pushed 2 floats of VW 0's wave 1 to shard 0; its part holds 1"):
    assembler.add(0, 1, 9, np.array([1.0, 2.0], np.float32))
  empty = WaveAssembler([parts], 2, shards.size(2))
  assert empty.add(0, 0, 7, np.zeros(0, np.float32)).size == 0  # the driver alone: whole at once
