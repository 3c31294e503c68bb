"""The one MPI wire format: the int64 header codec, the message kinds, the protocol error and the poll back-off.

Every message between ranks (a VW and a PS shard, a VW's driver and its stage ranks, two stage ranks) is one int64
header ``[HEADER_SIZE]`` (:func:`make_header`) followed, when its ``size`` is > 0, by one contiguous numpy payload
(upper-case mpi4py calls, nothing pickled). The receiver checks the header (:func:`check_header`: magic, wire
version, kind, and any field it knows the value of); one that does not match is a :class:`ProtocolError` naming the
receiving and the sending rank. Numpy only: no mpi4py, no jax.

Header fields (:data:`FIELDS`, int64 each): ``magic`` (:data:`MAGIC`, "HETP"), ``wire_version``
(:data:`WIRE_VERSION`), ``kind`` (:class:`Kind`), ``vw``, ``wave``, ``minibatch``, ``stage``, ``version`` (a
weight version), ``size`` (payload elements), ``arg0``, ``arg1``; a kind leaves the fields it does not use at 0.

============  ===================  ==============================  ===============================================
kind          direction            fields                          payload
============  ===================  ==============================  ===============================================
PUSH          VW rank → PS shard   ``wave``                        float32: the shard's slice (or the rank's part)
METRICS       VW → PS (lead)       ``wave``                        float64 ``[3]``: loss sum, minibatches, seconds
PULL          VW → PS shard        ``wave``: the required clock    none
WEIGHTS       PS shard → VW rank   ``wave``: the global clock      float32 slice (or part), then int64 ``[N]``
              or shard → rank 0                                    (to rank 0: the slice alone, on
              (an evaluation)                                      ``TAG_SHARD_EVAL``)
DONE          VW → PS shard        ``wave``: waves done            uint8 JSON: records, stats (lead; else empty)
SEGMENT       VW → PS shard        ``wave``: waves done            uint8 JSON (a checkpoint barrier; lead; else empty)
OPTSTATE      VW rank → PS (lead)  ``wave``: waves done            uint8: its stages' optimizer state by layer
ACTIVATION    stage s → s + 1      ``minibatch``, ``stage`` = s,   the activation (``size`` elements)
                                   ``version``
GRADIENT      stage s → s - 1      as ACTIVATION                   the gradient of stage s's input
START         driver → stage rank  ``minibatch``: the run's        float64 ``[1]``: the run's start, unix seconds
                                   minibatches
INJECT        driver → stage rank  ``minibatch``, ``version``      int32 labels (to the last stage's rank only)
TASK          driver → stage rank  ``minibatch``, ``stage``,       none
                                   ``version``, ``arg0``: task
                                   kind, ``arg1``: emulated ns
UPDATE        driver → stage rank  ``minibatch``, ``version``      none, or float64 ``[1]``: the global gradient
                                                                   norm (``grad_clip_norm`` > 0)
PULL_INSTALL  driver → stage rank  ``version``                     int64 ``[S]``: per shard, the VW's entry of its
                                                                   vector clock
END_WAVE      driver → stage rank  ``wave``                        none (the rank pushes its part of the wave)
STOP          driver → stage rank  ``arg0``: pulls requested       none
REPORT        stage rank → driver  ``minibatch``, ``stage``,       float64 ``[8]``: start, end, overrun, dispatch,
                                   ``arg0``: task kind             submit, device end, loss, grad sq norm (NaN:
                                                                   none)
STOPPED       stage rank → driver                                  uint8 JSON: trace counts, version waits
============  ===================  ==============================  ===============================================
"""

from __future__ import annotations

import enum
import time
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import numpy as np

MAGIC = 0x48455450  # "HETP"
WIRE_VERSION = 1
FIELDS = ("magic", "wire_version", "kind", "vw", "wave", "minibatch", "stage", "version", "size", "arg0", "arg1")
HEADER_SIZE = len(FIELDS)

# Tags: one per stream, so that a receive posted ahead on one never takes another's message.
TAG_PS_HEADER = 11  # VW <-> PS shard headers
TAG_PS_DATA = 12  # their payloads
TAG_SHARD_FINAL = 13  # a non-lead shard's cut (applied log and weights), to rank 0 at each checkpoint barrier and the end
TAG_SHARD_EVAL = 15  # a non-lead shard's slice at an evaluation clock, to rank 0 (a WEIGHTS header, then the slice)
TAG_CONTROL = 40  # driver -> stage rank, in order
TAG_REPORT = 41  # stage rank -> driver: task completions
TAG_REPLY = 42  # stage rank -> driver: the final report
TAG_STAGE_DATA = 100  # + 2 * receiving stage (+ 1 for gradients): activations and gradients

# The poll back-off while nothing arrives (MPICH's blocking calls spin; the pollers set a fine timer slack,
# :func:`hetpipe_jax.host_timers.fine_timer_slack`, so a sleep lasts what it asks): a message waits at most the
# longest pause to be noticed by an idle poller.
POLL_MIN_S, POLL_MAX_S = 2e-5, 1e-4


class Kind(enum.IntEnum):
  """Every message kind (the table above): the PS protocol's, then the stage ranks'."""
  PUSH = 1
  METRICS = 2
  PULL = 3
  WEIGHTS = 4
  DONE = 5
  SEGMENT = 6
  OPTSTATE = 7
  ACTIVATION = 21
  GRADIENT = 22
  START = 23
  INJECT = 24
  TASK = 25
  UPDATE = 26
  PULL_INSTALL = 27
  END_WAVE = 28
  STOP = 29
  REPORT = 30
  STOPPED = 31


CONTROL_KINDS = (Kind.START, Kind.INJECT, Kind.TASK, Kind.UPDATE, Kind.PULL_INSTALL, Kind.END_WAVE, Kind.STOP)


class ProtocolError(RuntimeError):
  """A message that does not match what its receiver expects (the message names both ranks where known)."""


class Header(NamedTuple):
  """A checked header's fields (:func:`check_header`)."""
  kind: Kind
  vw: int
  wave: int
  minibatch: int
  stage: int
  version: int
  size: int
  arg0: int
  arg1: int


def make_header(kind: Kind, vw: int, *, wave: int = 0, minibatch: int = 0, stage: int = 0, version: int = 0,
                size: int = 0, arg0: int = 0, arg1: int = 0) -> np.ndarray:
  """int64 ``[HEADER_SIZE]``: one message's header (the fields a kind does not use stay 0)."""
  return np.array([MAGIC, WIRE_VERSION, int(kind), vw, wave, minibatch, stage, version, size, arg0, arg1], np.int64)


def check_header(header: np.ndarray, *, source: int, dest: int | None, kinds: Sequence[Kind],
                 **expected: int | None) -> Header:
  """Decodes and checks a received header; returns its fields.

  Args:
    header: int64 ``[HEADER_SIZE]``, as received.
    source, dest: the sending and the receiving rank (named in the error; ``dest`` None: not named).
    kinds: the kinds the receiver accepts now.
    **expected: fields that must have these values (``vw``, ``wave``, ``minibatch``, ``stage``, ``version``,
      ``size``, ``arg0``, ``arg1``; None: not checked).

  Raises:
    ProtocolError: a header of another length, a bad magic (not this protocol), another wire version, an unknown
      or unexpected kind, or a field that differs from its expected value; the message names the receiving and the
      sending rank, each differing field with both values, and the header.
  """
  where = f"rank {dest} received from rank {source}" if dest is not None else f"received from rank {source}"
  if np.shape(header) != (HEADER_SIZE,):
    raise ProtocolError(f"{where} a header of shape {np.shape(header)}, expected ({HEADER_SIZE},)")
  values = dict(zip(FIELDS, (int(x) for x in header)))
  if values["magic"] != MAGIC:
    raise ProtocolError(f"{where} a message with bad magic {values['magic']:#x}, not a hetpipe_jax header "
                        f"(magic {MAGIC:#x}): {values}")
  if values["wire_version"] != WIRE_VERSION:
    raise ProtocolError(f"{where} a message of wire version {values['wire_version']}; this rank speaks version "
                        f"{WIRE_VERSION} (every rank must run the same hetpipe_jax)")
  try:
    kind = Kind(values["kind"])
  except ValueError:
    raise ProtocolError(f"{where} a message of unknown kind {values['kind']}: {values}") from None
  wrong = []
  if kind not in kinds:
    wrong.append(f"kind {kind.name} (expected {' or '.join(k.name for k in kinds)})")
  for field, want in expected.items():
    if field not in Header._fields or field == "kind":
      raise TypeError(f"check_header: {field!r} is not a header field ({', '.join(Header._fields[1:])})")
    if want is not None and values[field] != int(want):
      wrong.append(f"{field} {values[field]} (expected {int(want)})")
  if wrong:
    shown = {k: (Kind(v).name if k == "kind" else v) for k, v in values.items() if k not in ("magic", "wire_version")}
    raise ProtocolError(f"{where} a {kind.name} header that does not match: {', '.join(wrong)}; header {shown}")
  return Header(kind, *(values[f] for f in Header._fields[1:]))


# ---------------------------------------------------------------------------------------------- waiting
class Backoff:
  """A poll loop's pause while nothing arrives: ``min_s`` at first, doubling up to ``max_s``.

  Args:
    min_s: the first pause, seconds (also the pause after :meth:`reset`).
    max_s: the longest pause, seconds: how long a message may wait to be noticed by an idle poller.
  """

  def __init__(self, min_s: float = POLL_MIN_S, max_s: float = POLL_MAX_S):
    self.min_s, self.max_s = min_s, max_s
    self.pause_s = min_s

  def reset(self) -> None:
    """Something arrived: the next pause is the shortest again."""
    self.pause_s = self.min_s

  def wait(self, busy: bool = False) -> None:
    """Sleeps the current pause (``busy``: the shortest, e.g. while sends need this rank's MPI calls to progress),
    then doubles it up to ``max_s``."""
    time.sleep(self.min_s if busy else self.pause_s)
    self.pause_s = min(2 * self.pause_s, self.max_s)


T = TypeVar("T")


def poll_until(attempt: Callable[[], T], backoff: Backoff | None = None) -> T:
  """Calls ``attempt`` until it returns something truthy, which it returns, backing off between calls (MPICH's
  blocking waits spin, and the cores belong to the workers)."""
  backoff = backoff or Backoff()
  while not (result := attempt()):
    backoff.wait()
  return result


IDLE_COLLECTIVE_MAX_S = 0.02  # a rank waiting in a collective for a busy rank (start-up, the end) looks this often


def idle_collective(request: Any) -> None:
  """Waits for a non-blocking collective (``Ibarrier``, ``Ibcast``, ``Ireduce``) without spinning, backing off to
  :data:`IDLE_COLLECTIVE_MAX_S`: MPICH's blocking collectives busy-poll, so on an oversubscribed host the ranks that
  wait would starve the one they wait for (rank 0 compiling W0's initialisation, or evaluating at the end)."""
  poll_until(request.Test, Backoff(max_s=IDLE_COLLECTIVE_MAX_S))


def wait_all(requests: Sequence[Any], backoff: Backoff | None = None) -> None:
  """Polls MPI ``requests`` (``Test()``) until all completed, backing off while they do not."""
  backoff = backoff or Backoff()
  for request in requests:
    poll_until(request.Test, backoff)
