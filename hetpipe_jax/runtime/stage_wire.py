"""The stage-rank wire: message kinds, the checked int64 header, and the activation/gradient link between a VW's
stages on different MPI ranks (HetPipe §4's pipeline across nodes).

Runtime layer. Every message is one int64 header (:func:`make_header`: magic, kind, VW, minibatch, stage, weight
version, size, two arguments) then, when ``size`` > 0, one contiguous numpy payload; non-blocking upper-case mpi4py
calls, nothing pickled. The receiver checks the header (:func:`check_header`); one that does not match is a
:class:`ProtocolError` naming both ranks. :class:`StageLink` carries activations and gradients stage rank to stage
rank with receives posted ahead (each stream carries minibatches 0, 1, ... in order: forwards and backwards run in
minibatch order on every stage), so a send completes when the data is in its consumer's buffer, which is when the
sending task completes. The control stream and the reports that use the same header are
:mod:`hetpipe_jax.runtime.stage_ranks`'.

Wire kinds (``stage`` field: the sending stage for data, the task's stage for TASK / REPORT):

===========  =====================  ===========================================================================
kind         direction              payload
===========  =====================  ===========================================================================
ACTIVATION   stage s → s + 1        the activation (its dtype, ``size`` elements)
GRADIENT     stage s → s - 1        the gradient of stage s's input
START        driver → stage rank    float64 ``[run start, unix seconds]``; ``minibatch``: minibatches in the run
INJECT       driver → stage rank    the labels (int32), to the rank of the last stage only
TASK         driver → stage rank    none; ``arg0`` task kind, ``arg1`` emulated nanoseconds (-1: none)
UPDATE       driver → stage rank    none: apply minibatch p's update; ``version`` = the new version; with
                                    ``grad_clip_norm`` > 0, float64 ``[1]``: p's global gradient norm
PULL         driver → stage rank    int64 ``[S]``: per shard, the VW's entry of its vector clock; ``version`` = new
END_WAVE     driver → stage rank    none; ``minibatch`` = the wave (the rank pushes its part to the shards)
STOP         driver → stage rank    none; ``arg0`` = pulls the driver requested (the rank drains their replies)
REPORT       stage rank → driver    float64 ``[start, end, overrun, dispatch, submit, device end, loss,
                                    grad sq norm]``: loss of a last stage's FB, else NaN; the squared norm
                                    of a backward's parameter gradient with ``grad_clip_norm`` > 0, else NaN
STOPPED      stage rank → driver    uint8 JSON: its trace counts and version-wait statistics
===========  =====================  ===========================================================================
"""

from __future__ import annotations

import collections
import enum
import time
from typing import Any, Sequence

import jax
import numpy as np

from hetpipe_jax import models
from hetpipe_jax.rules.schedule import TaskKind

MAGIC = 0x53544752  # "STGR"
HEADER_FIELDS = ("magic", "kind", "vw", "minibatch", "stage", "version", "size", "arg0", "arg1")
HEADER_SIZE = len(HEADER_FIELDS)
TAG_CONTROL = 40  # driver -> stage rank, in order
TAG_REPORT = 41  # stage rank -> driver: task completions
TAG_REPLY = 42  # stage rank -> driver: the final report
TAG_DATA = 100  # + 2 * receiving stage (+ 1 for gradients)
REPORT_SIZE = 8
RECEIVES_AHEAD = 4  # completion reports posted ahead per stage rank
# Polling back-off while nothing arrives (MPICH's blocking calls spin; the pollers set a fine timer slack, so a sleep
# lasts what it asks): a message waits at most POLL_MAX_S to be noticed by an idle poller.
POLL_MIN_S, POLL_MAX_S = 2e-5, 1e-4
TASK_CODES = {TaskKind.FORWARD: 0, TaskKind.BACKWARD: 1, TaskKind.FORWARD_BACKWARD: 2}
TASK_KINDS = {v: k for k, v in TASK_CODES.items()}


class Kind(enum.IntEnum):
  ACTIVATION = 1
  GRADIENT = 2
  START = 3
  INJECT = 4
  TASK = 5
  UPDATE = 6
  PULL = 7
  END_WAVE = 8
  STOP = 9
  REPORT = 10
  STOPPED = 12


CONTROL_KINDS = (Kind.START, Kind.INJECT, Kind.TASK, Kind.UPDATE, Kind.PULL, Kind.END_WAVE, Kind.STOP)


class ProtocolError(RuntimeError):
  """A stage-rank message that does not match what its receiver expects (the message names both ranks)."""


def make_header(kind: Kind, vw: int, minibatch: int = 0, stage: int = 0, version: int = 0, size: int = 0,
                arg0: int = 0, arg1: int = 0) -> np.ndarray:
  return np.array([MAGIC, int(kind), vw, minibatch, stage, version, size, arg0, arg1], np.int64)


def check_header(header: np.ndarray, *, source: int, dest: int, kinds: Sequence[Kind], vw: int,
                 **expected: int | None) -> Kind:
  """Checks a received header; returns its kind.

  Args:
    header: the int64 header.
    source, dest: the sending and the receiving rank (named in the error).
    kinds: the kinds the receiver accepts now.
    vw: the VW both ranks serve.
    **expected: fields that must have these values (``minibatch``, ``stage``, ``version``, ``size``, ``arg0``,
      ``arg1``; None: not checked).

  Raises:
    ProtocolError: bad magic, an unknown or unexpected kind, or a field that differs from the expected value; the
      message names the receiving and the sending rank, each differing field with both values, and the header.
  """
  values = dict(zip(HEADER_FIELDS, (int(x) for x in header)))
  where = f"rank {dest} received from rank {source}"
  if values["magic"] != MAGIC:
    raise ProtocolError(f"{where} a message with bad magic {values['magic']:#x}, not a stage-rank header: {values}")
  try:
    kind = Kind(values["kind"])
  except ValueError:
    raise ProtocolError(f"{where} a message of unknown kind {values['kind']}: {values}") from None
  wrong = []
  if kind not in kinds:
    wrong.append(f"kind {kind.name} (expected {' or '.join(k.name for k in kinds)})")
  for field, want in (("vw", vw), *expected.items()):
    if want is not None and values[field] != int(want):
      wrong.append(f"{field} {values[field]} (expected {int(want)})")
  if wrong:
    shown = {k: (Kind(v).name if k == "kind" else v) for k, v in values.items() if k != "magic"}
    raise ProtocolError(f"{where} a {kind.name} header that does not match: {', '.join(wrong)}; header {shown}")
  return kind


def wait_all(requests: Sequence[Any]) -> None:
  """Polls ``requests`` until all completed, backing off while they do not (MPICH's blocking waits spin)."""
  pause = POLL_MIN_S
  for request in requests:
    while not request.Test():
      time.sleep(pause)
      pause = min(2 * pause, POLL_MAX_S)


class SentMarker:
  """What a task whose output leaves for another rank returns: ready once the output is in its consumer's buffer."""

  def __init__(self, requests: list, buffers: list):
    self._requests = requests
    self._buffers = buffers  # alive until sent

  def block_until_ready(self) -> "SentMarker":
    wait_all(self._requests)
    self._buffers = []
    return self


class PostedReceive:
  """A receive of one header + payload posted ahead; ``index`` is its place in the stream (the minibatch)."""

  def __init__(self, comm, source: int, tag: int, index: int, shape: tuple, dtype):
    self.index = index
    self.header = np.empty(HEADER_SIZE, np.int64)
    self.payload = np.empty(shape, dtype)
    self.header_request = comm.Irecv(self.header, source=source, tag=tag)
    self.payload_request = comm.Irecv(self.payload, source=source, tag=tag)


class _InStream:
  """One stream of activations (or gradients) into a stage from the adjacent stage's rank, minibatch by minibatch."""

  def __init__(self, comm, source: int, tag: int, shape: tuple, dtype, total: int, ahead: int):
    self.comm, self.source, self.tag, self.shape, self.dtype = comm, source, tag, shape, dtype
    self.total, self.ahead = total, ahead
    self.posted: collections.deque[PostedReceive] = collections.deque()
    self.next_index = 0
    self._refill()

  def _refill(self) -> None:
    while len(self.posted) < self.ahead and self.next_index < self.total:
      self.posted.append(PostedReceive(self.comm, self.source, self.tag, self.next_index, self.shape, self.dtype))
      self.next_index += 1

  def take(self) -> PostedReceive:
    if not self.posted:
      raise ProtocolError(f"rank {self.comm.Get_rank()} was asked for message {self.next_index} of the stream from "
                          f"rank {self.source} (tag {self.tag}), which carries {self.total}")
    return self.posted.popleft()

  def cancel(self) -> None:
    for posted in self.posted:
      for request in (posted.header_request, posted.payload_request):
        request.Cancel()
        request.Wait()
    self.posted.clear()


def _boundary_size(shape: tuple) -> int:
  return int(np.prod(shape)) if shape else 1


class StageLink:
  """Activations and gradients between a VW's stages on different ranks (one object per rank).

  Args:
    comm: the MPI communicator.
    vw_id: the VW.
    stage_ranks: per stage, the rank that runs it.
    boundaries: per stage ``s``, the ``(shape, dtype)`` of its input activation (index 0 unused); the gradient of
      that input has the same shape.
    num_minibatches: minibatches of the run (each stream carries this many messages).
    ahead: receives posted ahead per stream (>= Nm: a producer is never more than Nm minibatches ahead).
  """

  def __init__(self, comm, vw_id: int, stage_ranks: Sequence[int], boundaries: Sequence[tuple], num_minibatches: int,
               ahead: int):
    self.comm = comm
    self.vw_id = vw_id
    self.rank = comm.Get_rank()
    self.stage_ranks = list(stage_ranks)
    self.boundaries = list(boundaries)
    n = len(self.stage_ranks)
    self._local = {s for s in range(n) if self.stage_ranks[s] == self.rank}
    self._streams: dict[tuple[Kind, int], _InStream] = {}
    for s in sorted(self._local):
      if s > 0 and s - 1 not in self._local:
        shape, dtype = self.boundaries[s]
        self._streams[(Kind.ACTIVATION, s)] = _InStream(comm, self.stage_ranks[s - 1], _data_tag(Kind.ACTIVATION, s),
                                                        shape, dtype, num_minibatches, ahead)
      if s < n - 1 and s + 1 not in self._local:
        shape, dtype = self.boundaries[s + 1]
        self._streams[(Kind.GRADIENT, s)] = _InStream(comm, self.stage_ranks[s + 1], _data_tag(Kind.GRADIENT, s),
                                                      shape, dtype, num_minibatches, ahead)

  def is_local(self, stage: int) -> bool:
    return stage in self._local

  def recv_activation(self, stage: int, minibatch: int, version: int) -> np.ndarray:
    """Stage ``stage``'s input activation of ``minibatch`` from stage ``stage - 1``'s rank (blocking poll)."""
    return self._recv(Kind.ACTIVATION, stage, stage - 1, minibatch, version)

  def recv_gradient(self, stage: int, minibatch: int, version: int) -> np.ndarray:
    """The gradient of stage ``stage``'s output for ``minibatch`` from stage ``stage + 1``'s rank."""
    return self._recv(Kind.GRADIENT, stage, stage + 1, minibatch, version)

  def _recv(self, kind: Kind, stage: int, sender: int, minibatch: int, version: int) -> np.ndarray:
    stream = self._streams[(kind, stage)]
    posted = stream.take()
    stream._refill()  # pylint: disable=protected-access
    wait_all([posted.header_request])
    check_header(posted.header, source=stream.source, dest=self.rank, kinds=(kind,), vw=self.vw_id,
                 minibatch=minibatch, stage=sender, version=version, size=_boundary_size(stream.shape))
    wait_all([posted.payload_request])
    return posted.payload

  def send_activation(self, stage: int, minibatch: int, version: int, out) -> SentMarker:
    """Sends stage ``stage``'s output of ``minibatch`` to stage ``stage + 1``'s rank."""
    return self._send(Kind.ACTIVATION, stage, stage + 1, minibatch, version, out)

  def send_gradient(self, stage: int, minibatch: int, version: int, grad) -> SentMarker:
    """Sends the gradient of stage ``stage``'s input for ``minibatch`` to stage ``stage - 1``'s rank."""
    return self._send(Kind.GRADIENT, stage, stage - 1, minibatch, version, grad)

  def _send(self, kind: Kind, stage: int, dest_stage: int, minibatch: int, version: int, value) -> SentMarker:
    payload = np.ascontiguousarray(jax.device_get(value))
    header = make_header(kind, self.vw_id, minibatch, stage, version, payload.size)
    dest, tag = self.stage_ranks[dest_stage], _data_tag(kind, dest_stage)
    requests = [self.comm.Isend(header, dest=dest, tag=tag), self.comm.Isend(payload, dest=dest, tag=tag)]
    return SentMarker(requests, [header, payload])

  def close(self) -> None:
    """Cancels the receives posted beyond the run's last minibatch (none when every message arrived)."""
    for stream in self._streams.values():
      stream.cancel()


def _data_tag(kind: Kind, receiving_stage: int) -> int:
  return TAG_DATA + 2 * receiving_stage + (1 if kind is Kind.GRADIENT else 0)


def stage_boundaries(spec: Any, partition: Sequence[Sequence[int]], batch_size: int) -> list[tuple]:
  """Per stage, the ``(shape, dtype)`` of its input activation (index 0: the model's input), from ``jax.eval_shape``
  (no computation)."""
  params = jax.eval_shape(lambda: models.init_layer_params(spec, jax.random.key(0)))
  x = jax.ShapeDtypeStruct((batch_size, *spec.input_shape), np.dtype(spec.input_dtype))
  out = []
  for start, end in partition:
    out.append((tuple(x.shape), np.dtype(x.dtype)))
    layers = spec.layers[start:end]
    x = jax.eval_shape(lambda p, a, layers=layers: models.apply_layers(layers, p, a), list(params[start:end]), x)
  return out
