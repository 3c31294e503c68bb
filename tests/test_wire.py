"""The one MPI wire format (hetpipe_jax.mpi.wire): header round trip, the checks' errors, the poll back-off."""

import itertools

import numpy as np
import pytest

from hetpipe_jax.mpi import wire
from hetpipe_jax.mpi.wire import Kind, ProtocolError

FIELDS = dict(vw=3, wave=17, minibatch=41, stage=2, version=9, size=1234, arg0=-1, arg1=25_000_000)


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_round_trips_every_field(kind):
  h = wire.make_header(kind, **FIELDS)
  assert h.dtype == np.int64 and h.shape == (wire.HEADER_SIZE,) == (len(wire.FIELDS),)
  got = wire.check_header(h.copy(), source=1, dest=2, kinds=(kind,), **FIELDS)
  assert got == wire.Header(kind, **FIELDS) and got.kind is kind
  assert dict(zip(wire.FIELDS, h.tolist())) == {"magic": wire.MAGIC, "wire_version": wire.WIRE_VERSION,
                                                "kind": int(kind), **FIELDS}


def test_one_magic_one_version_one_kinds_enum():
  assert wire.MAGIC == int.from_bytes(b"HETP", "big") and wire.WIRE_VERSION >= 1
  assert len({int(k) for k in Kind}) == len(Kind)  # the PS and the stage ranks' kinds never share a value
  assert set(wire.CONTROL_KINDS) <= set(Kind) and Kind.PULL not in wire.CONTROL_KINDS
  a, b = wire.make_header(Kind.PUSH, 0), wire.make_header(Kind.ACTIVATION, 0)
  assert a[wire.FIELDS.index("magic")] == b[wire.FIELDS.index("magic")] == wire.MAGIC


def _raw(**changes):
  h = wire.make_header(Kind.WEIGHTS, 1, wave=4, size=7)
  for field, value in changes.items():
    h[wire.FIELDS.index(field)] = value
  return h


@pytest.mark.parametrize("changes, message", [
    ({"magic": 0x53544752}, r"^rank 5 received from rank 0 a message with bad magic 0x53544752, not a hetpipe_jax "
                            r"header \(magic 0x48455450\)"),
    ({"wire_version": wire.WIRE_VERSION + 1}, rf"^rank 5 received from rank 0 a message of wire version "
                                              rf"{wire.WIRE_VERSION + 1}; this rank speaks version "
                                              rf"{wire.WIRE_VERSION} \(every rank must run the same hetpipe_jax\)$"),
    ({"kind": 0}, r"^rank 5 received from rank 0 a message of unknown kind 0: "),
    ({"kind": 8}, r"^rank 5 received from rank 0 a message of unknown kind 8: "),
    ({"kind": int(Kind.PUSH)}, r"^rank 5 received from rank 0 a PUSH header that does not match: kind PUSH "
                               r"\(expected WEIGHTS\); header \{'kind': 'PUSH', 'vw': 1, 'wave': 4, "),
    ({"wave": 5}, r"^rank 5 received from rank 0 a WEIGHTS header that does not match: wave 5 \(expected 4\); "),
    ({"size": 6, "vw": 2}, r"^rank 5 received from rank 0 a WEIGHTS header that does not match: vw 2 \(expected "
                           r"1\), size 6 \(expected 7\); "),
])
def test_a_header_that_does_not_match_raises_the_one_protocol_error(changes, message):
  with pytest.raises(ProtocolError, match=message):
    wire.check_header(_raw(**changes), source=0, dest=5, kinds=(Kind.WEIGHTS,), vw=1, wave=4, size=7)
  assert issubclass(ProtocolError, RuntimeError)


def test_a_header_of_another_length_or_an_unknown_field_is_refused():
  with pytest.raises(ProtocolError, match=r"^rank 2 received from rank 1 a header of shape \(5,\), expected \(11,\)"):
    wire.check_header(np.zeros(5, np.int64), source=1, dest=2, kinds=tuple(Kind))
  with pytest.raises(TypeError, match="'clock' is not a header field"):
    wire.check_header(_raw(), source=0, dest=5, kinds=(Kind.WEIGHTS,), clock=4)
  # None: a field not checked; no dest: the receiver is not named
  assert wire.check_header(_raw(wave=99), source=0, dest=None, kinds=(Kind.WEIGHTS,), wave=None).wave == 99
  with pytest.raises(ProtocolError, match=r"^received from rank 0 a message with bad magic 0x0"):
    wire.check_header(_raw(magic=0), source=0, dest=None, kinds=(Kind.WEIGHTS,))


class _Request:
  def __init__(self, tests_to_complete):
    self.remaining = tests_to_complete

  def Test(self):  # noqa: N802 (mpi4py's name)
    self.remaining -= 1
    return self.remaining <= 0


def test_the_back_off_doubles_to_its_longest_pause_and_resets(monkeypatch):
  slept = []
  monkeypatch.setattr(wire.time, "sleep", slept.append)
  backoff = wire.Backoff(1e-5, 6e-5)
  for _ in range(5):
    backoff.wait()
  backoff.wait(busy=True)  # the shortest pause; the next idle one keeps growing
  backoff.wait()
  backoff.reset()
  backoff.wait()
  assert slept == pytest.approx([1e-5, 2e-5, 4e-5, 6e-5, 6e-5, 1e-5, 6e-5, 1e-5])
  slept.clear()
  calls = itertools.count()
  assert wire.poll_until(lambda: next(calls) == 3 and "reply") == "reply"  # returns the first truthy result
  assert slept == pytest.approx([wire.POLL_MIN_S, 2 * wire.POLL_MIN_S, 4 * wire.POLL_MIN_S])
  slept.clear()
  requests = [_Request(3), _Request(1), _Request(2)]
  wire.wait_all(requests)
  assert all(r.remaining <= 0 for r in requests) and len(slept) == 3  # one back-off across the requests
  assert max(slept) <= wire.POLL_MAX_S
