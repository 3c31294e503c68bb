"""The PS protocol over MPI (header check, payload receive, VW client) against a fake communicator, without mpiexec."""

import collections
import json
import sys
import types

import numpy as np
import pytest

from hetpipe_jax.mpi import ps_client
from hetpipe_jax.mpi import wire
from hetpipe_jax.mpi.wire import Kind, ProtocolError

NUM_PARAMS = 7
VW_ID = 2
VW_RANK = VW_ID + 1  # rank r hosts VW r - 1; rank 0 is the PS
NUM_VWS = 4
ALL_KINDS = tuple(Kind)


def header(magic=wire.MAGIC, kind=Kind.PUSH, vw_id=VW_ID, wave=0, size=NUM_PARAMS):
  """A raw int64 header, built by hand (not by ``make_header``) so that any field can be malformed."""
  h = np.zeros(wire.HEADER_SIZE, np.int64)
  for field, value in (("magic", magic), ("wire_version", wire.WIRE_VERSION), ("kind", int(kind)), ("vw", vw_id),
                       ("wave", wave), ("size", size)):
    h[wire.FIELDS.index(field)] = value
  return h


def check(h, source_rank=VW_RANK, expect_kinds=ALL_KINDS):
  return ps_client.check_header(h, source_rank, num_params=NUM_PARAMS, expect_kinds=expect_kinds).kind


# ---------------------------------------------------------------- make_header / check_header


def test_make_header_layout():
  assert wire.MAGIC == int.from_bytes(b"HETP", "big")
  h = wire.make_header(Kind.METRICS, 4, wave=9, size=3)
  assert h.dtype == np.int64 and h.shape == (wire.HEADER_SIZE,) == (11,)
  assert h.tolist() == [0x48455450, 1, 2, 4, 9, 0, 0, 0, 3, 0, 0]


@pytest.mark.parametrize("kind, source_rank, vw_id, wave, size", [
    (Kind.PUSH, VW_RANK, VW_ID, 0, NUM_PARAMS),
    (Kind.METRICS, VW_RANK, VW_ID, 5, 3),
    (Kind.PULL, VW_RANK, VW_ID, 2, 0),
    (Kind.DONE, VW_RANK, VW_ID, 10, 123),  # DONE carries JSON of any length
    (Kind.DONE, VW_RANK, VW_ID, 0, 0),
    (Kind.WEIGHTS, 0, 5, 4, NUM_PARAMS),  # from the PS the VW id names the destination, any value
    (Kind.PUSH, 1, 0, 3, NUM_PARAMS),  # VW 0 on rank 1
])
def test_good_header_returns_its_kind(kind, source_rank, vw_id, wave, size):
  h = header(kind=kind, vw_id=vw_id, wave=wave, size=size)
  assert check(h, source_rank, expect_kinds=(kind,)) is kind
  assert check(h, source_rank) is kind
  # make_header builds the same message.
  assert check(wire.make_header(kind, vw_id, wave=wave, size=size), source_rank) is kind


def test_errors_are_runtime_errors():
  assert issubclass(ProtocolError, RuntimeError)


@pytest.mark.parametrize("magic, text", [(wire.MAGIC + 1, "0x48455451"), (0, "0x0"), (0x50544548, "0x50544548")])
def test_bad_magic(magic, text):
  with pytest.raises(ProtocolError, match=f"^received from rank {VW_RANK} a message with bad magic {text}, not a "
                     "hetpipe_jax header"):
    check(header(magic=magic))


@pytest.mark.parametrize("kind_value", [0, 8, -1, 99])
def test_unknown_kind(kind_value):
  with pytest.raises(ProtocolError, match=f"^received from rank {VW_RANK} a message of unknown kind {kind_value}: "):
    check(header(kind=kind_value))


def test_unexpected_kind():
  with pytest.raises(ProtocolError, match=r"^received from rank 0 a PULL header that does not match: kind PULL "
                                          r"\(expected WEIGHTS\);"):
    check(header(kind=Kind.PULL, size=0), source_rank=0, expect_kinds=(Kind.WEIGHTS,))
  # The PS accepts everything a VW sends but WEIGHTS.
  ps_kinds = (Kind.PUSH, Kind.METRICS, Kind.PULL, Kind.DONE)
  expected = r"\(expected PUSH or METRICS or PULL or DONE\)"
  with pytest.raises(ProtocolError, match=f"^received from rank 3 a WEIGHTS header that does not match: kind WEIGHTS "
                     f"{expected};"):
    check(header(kind=Kind.WEIGHTS), expect_kinds=ps_kinds)


@pytest.mark.parametrize("source_rank, vw_id", [(3, 3), (3, 1), (3, 0), (1, 1), (2, -1)])
def test_vw_id_must_match_sender_rank(source_rank, vw_id):
  with pytest.raises(ProtocolError, match=f"rank {source_rank} claims to be VW {vw_id} "):
    check(header(vw_id=vw_id), source_rank=source_rank)


@pytest.mark.parametrize("kind, size", [(Kind.PUSH, NUM_PARAMS), (Kind.PULL, 0), (Kind.WEIGHTS, NUM_PARAMS)])
def test_negative_wave(kind, size):
  source_rank, vw_id = (0, 0) if kind is Kind.WEIGHTS else (VW_RANK, VW_ID)
  with pytest.raises(ProtocolError, match=f"{kind.name} from rank {source_rank} has negative wave -1$"):
    check(header(kind=kind, vw_id=vw_id, wave=-1, size=size), source_rank)


@pytest.mark.parametrize("kind, size, expected", [
    (Kind.PUSH, NUM_PARAMS + 1, NUM_PARAMS),
    (Kind.PUSH, NUM_PARAMS - 1, NUM_PARAMS),
    (Kind.PUSH, 0, NUM_PARAMS),
    (Kind.WEIGHTS, 3, NUM_PARAMS),
    (Kind.METRICS, 2, 3),
    (Kind.METRICS, 4, 3),
    (Kind.METRICS, NUM_PARAMS, 3),
    (Kind.PULL, 1, 0),
])
def test_wrong_size_for_kind(kind, size, expected):
  source_rank, vw_id = (0, 0) if kind is Kind.WEIGHTS else (VW_RANK, VW_ID)
  with pytest.raises(ProtocolError, match=f"{kind.name} from rank {source_rank} carries {size} elements, expected "
                     f"{expected}$"):
    check(header(kind=kind, vw_id=vw_id, size=size), source_rank)


@pytest.mark.parametrize("kind", [Kind.DONE, Kind.PUSH, Kind.PULL])
def test_negative_size(kind):
  with pytest.raises(ProtocolError, match=f"{kind.name} from rank {VW_RANK} has negative size -1$"):
    check(header(kind=kind, size=-1))


# ---------------------------------------------------------------- a fake communicator


class FakeRequest:
  """A non-blocking request that completes on its ``tests_to_complete``-th ``Test()``, then runs ``on_complete``."""

  def __init__(self, tests_to_complete=1, on_complete=None):
    self.remaining = tests_to_complete
    self.on_complete = on_complete
    self.done = False

  def Test(self):  # noqa: N802 (mpi4py's name)
    if not self.done:
      self.remaining -= 1
      if self.remaining <= 0 and (self.on_complete is None or self.on_complete()):
        self.done = True
    return self.done


class FakeComm:
  """Just enough of an mpi4py communicator: records sends, serves receives from an inbox keyed by (source, tag)."""

  def __init__(self, send_tests=1):
    self.send_tests = send_tests  # Test() calls before a send completes
    self.sent = []  # (dest, tag, copy of the buffer)
    self.send_requests = []
    self.inbox = collections.defaultdict(collections.deque)
    self.num_recv = 0

  def Isend(self, buf, dest, tag):  # noqa: N802
    self.sent.append((dest, tag, np.array(buf, copy=True)))
    req = FakeRequest(self.send_tests)
    self.send_requests.append(req)
    return req

  def _deliver(self, buf, source, tag):
    msg = self.inbox[(source, tag)].popleft()
    assert buf.dtype == msg.dtype and buf.shape == msg.shape, (buf.dtype, buf.shape, msg.dtype, msg.shape)
    buf[...] = msg

  def Recv(self, buf, source, tag):  # noqa: N802
    self.num_recv += 1
    self._deliver(buf, source, tag)

  def Irecv(self, buf, source, tag):  # noqa: N802
    def arrived():
      if not self.inbox[(source, tag)]:
        return False
      self._deliver(buf, source, tag)
      return True
    return FakeRequest(1, arrived)


@pytest.fixture
def fake_mpi(monkeypatch):
  """``from mpi4py import MPI`` gets a stub, so no MPI library is initialised."""
  module = types.ModuleType("mpi4py")
  # MPI_THREAD_SERIALIZED = 2, MPI_THREAD_MULTIPLE = 3 (mpi4py's values): the client asks the thread level
  module.MPI = types.SimpleNamespace(THREAD_SERIALIZED=2, Query_thread=lambda: 3)
  monkeypatch.setitem(sys.modules, "mpi4py", module)
  return module


# ---------------------------------------------------------------- recv_payload


@pytest.mark.parametrize("kind, dtype", [(Kind.PUSH, np.float32), (Kind.WEIGHTS, np.float32),
                                         (Kind.METRICS, np.float64), (Kind.DONE, np.uint8)])
def test_recv_payload_dtype_per_kind(kind, dtype):
  comm = FakeComm()
  sent = (np.arange(5) * 3 + 1).astype(dtype)
  comm.inbox[(4, wire.TAG_PS_DATA)].append(sent)
  comm.inbox[(1, wire.TAG_PS_DATA)].append(np.zeros(5, dtype))  # another sender's payload stays queued
  got = ps_client.recv_payload(comm, 4, kind, 5)
  assert got.dtype == dtype
  np.testing.assert_array_equal(got, [1, 4, 7, 10, 13])
  assert len(comm.inbox[(1, wire.TAG_PS_DATA)]) == 1 and not comm.inbox[(4, wire.TAG_PS_DATA)]


def test_recv_payload_of_size_zero_receives_nothing():
  comm = FakeComm()
  got = ps_client.recv_payload(comm, 1, Kind.DONE, 0)
  assert got.shape == (0,) and got.dtype == np.uint8
  assert comm.num_recv == 0


# ---------------------------------------------------------------- MPIPSClient


def test_client_push_sends_delta_then_metrics(fake_mpi):
  comm = FakeComm()
  client = ps_client.MPIPSClient(comm, VW_ID, NUM_PARAMS, NUM_VWS)
  delta = np.linspace(-1.0, 1.0, NUM_PARAMS)  # float64 in, float32 on the wire
  client.push(3, delta, loss_sum=2.5, num_minibatches=4)
  assert [(dest, tag) for dest, tag, _ in comm.sent] == [(0, wire.TAG_PS_HEADER), (0, wire.TAG_PS_DATA)] * 2
  (_, _, h_push), (_, _, data), (_, _, h_metrics), (_, _, metrics) = comm.sent
  assert h_push.tolist() == [wire.MAGIC, wire.WIRE_VERSION, 1, VW_ID, 3, 0, 0, 0, NUM_PARAMS, 0, 0]
  assert h_metrics.tolist() == [wire.MAGIC, wire.WIRE_VERSION, 2, VW_ID, 3, 0, 0, 0, 3, 0, 0]
  assert data.dtype == np.float32
  np.testing.assert_array_equal(data, delta.astype(np.float32))
  assert metrics.dtype == np.float64 and metrics[:2].tolist() == [2.5, 4.0] and 0.0 <= metrics[2] < 60.0
  # What the PS accepts from this VW's rank.
  ps_kinds = (Kind.PUSH, Kind.METRICS, Kind.PULL, Kind.DONE)
  assert ps_client.check_header(h_push, VW_RANK, num_params=NUM_PARAMS, expect_kinds=ps_kinds).kind is Kind.PUSH
  assert ps_client.check_header(h_metrics, VW_RANK, num_params=NUM_PARAMS, expect_kinds=ps_kinds).kind is Kind.METRICS


def test_client_pull_round_trip(fake_mpi):
  comm = FakeComm()
  client = ps_client.MPIPSClient(comm, VW_ID, NUM_PARAMS, NUM_VWS)
  assert client.poll_pull() is None  # nothing requested
  client.request_pull(5)
  assert len(comm.sent) == 1  # a header only, no payload
  dest, tag, h = comm.sent[0]
  assert (dest, tag, h.tolist()) == (0, wire.TAG_PS_HEADER, [wire.MAGIC, wire.WIRE_VERSION, 3, VW_ID, 5, 0, 0, 0, 0, 0,
                                                            0])
  with pytest.raises(RuntimeError, match="a pull is already outstanding"):
    client.request_pull(6)
  assert client.poll_pull() is None  # no reply yet
  weights = np.arange(NUM_PARAMS, dtype=np.float32) / 4
  comm.inbox[(0, wire.TAG_PS_HEADER)].append(wire.make_header(Kind.WEIGHTS, VW_ID, wave=8, size=NUM_PARAMS))
  comm.inbox[(0, wire.TAG_PS_DATA)].append(weights)
  comm.inbox[(0, wire.TAG_PS_DATA)].append(np.array([9, 8, 11, 8], np.int64))  # the weights' vector clock
  clock, got = client.poll_pull()
  assert clock == (9, 8, 11, 8)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, weights)
  assert client.poll_pull() is None
  client.request_pull(9)  # a new pull may be requested once the reply is in
  assert comm.sent[-1][2].tolist() == [wire.MAGIC, wire.WIRE_VERSION, 3, VW_ID, 9, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("reply, match", [
    (wire.make_header(Kind.PUSH, VW_ID, wave=8, size=NUM_PARAMS),
     r"^rank 3 received from rank 0 a PUSH header that does not match: kind PUSH \(expected WEIGHTS\);"),
    (wire.make_header(Kind.WEIGHTS, VW_ID, wave=8, size=NUM_PARAMS + 1), "WEIGHTS from rank 0 carries 8 elements"),
    (header(magic=1, kind=Kind.WEIGHTS), "^rank 3 received from rank 0 a message with bad magic 0x1, "),
])
def test_client_rejects_bad_reply(fake_mpi, reply, match):
  comm = FakeComm()
  client = ps_client.MPIPSClient(comm, VW_ID, NUM_PARAMS, NUM_VWS)
  client.request_pull(1)
  comm.inbox[(0, wire.TAG_PS_HEADER)].append(reply)
  with pytest.raises(ProtocolError, match=match):
    client.poll_pull()


def test_client_rejects_a_vector_clock_that_disagrees_with_the_global_clock(fake_mpi):
  comm = FakeComm()
  client = ps_client.MPIPSClient(comm, VW_ID, NUM_PARAMS, NUM_VWS)
  client.request_pull(1)
  comm.inbox[(0, wire.TAG_PS_HEADER)].append(wire.make_header(Kind.WEIGHTS, VW_ID, wave=3, size=NUM_PARAMS))
  comm.inbox[(0, wire.TAG_PS_DATA)].append(np.zeros(NUM_PARAMS, np.float32))
  comm.inbox[(0, wire.TAG_PS_DATA)].append(np.array([4, 3, 5, 4], np.int64))  # min 3: fine
  assert client.poll_pull()[0] == (4, 3, 5, 4)
  client.request_pull(4)
  comm.inbox[(0, wire.TAG_PS_HEADER)].append(wire.make_header(Kind.WEIGHTS, VW_ID, wave=4, size=NUM_PARAMS))
  comm.inbox[(0, wire.TAG_PS_DATA)].append(np.zeros(NUM_PARAMS, np.float32))
  comm.inbox[(0, wire.TAG_PS_DATA)].append(np.array([5, 5, 5, 5], np.int64))  # min 5, header says 4
  with pytest.raises(ProtocolError, match=r"global clock 4 carry vector clock \[5, 5, 5, 5\]"):
    client.poll_pull()


def test_client_finish_sends_report_and_waits(fake_mpi):
  comm = FakeComm(send_tests=3)  # every send needs three Test() calls
  client = ps_client.MPIPSClient(comm, VW_ID, NUM_PARAMS, NUM_VWS)
  client.push(0, np.zeros(NUM_PARAMS), 1.0, 2)
  client.request_pull(1)
  # The PS's reply to the pull is already on its way; finish must drain it.
  comm.inbox[(0, wire.TAG_PS_HEADER)].append(wire.make_header(Kind.WEIGHTS, VW_ID, wave=1, size=NUM_PARAMS))
  comm.inbox[(0, wire.TAG_PS_DATA)].append(np.ones(NUM_PARAMS, np.float32))
  comm.inbox[(0, wire.TAG_PS_DATA)].append(np.array([1, 1, 2, 1], np.int64))
  report = {"records": [1, 2], "vw": "é"}
  client.finish(4, report)
  assert all(r.done for r in comm.send_requests)
  assert not comm.inbox[(0, wire.TAG_PS_HEADER)] and not comm.inbox[(0, wire.TAG_PS_DATA)]
  (_, tag_h, h), (_, tag_d, payload) = comm.sent[-2:]
  expected_bytes = json.dumps(report).encode()
  assert (tag_h, tag_d) == (wire.TAG_PS_HEADER, wire.TAG_PS_DATA)
  assert h.tolist() == [wire.MAGIC, wire.WIRE_VERSION, 5, VW_ID, 4, 0, 0, 0, len(expected_bytes), 0, 0]
  assert payload.dtype == np.uint8 and payload.tobytes() == expected_bytes
  assert json.loads(payload.tobytes().decode()) == report
