"""The activation/gradient link between a VW's stages on different MPI ranks (HetPipe §4's pipeline across nodes).

Runtime layer. Messages are :mod:`hetpipe_jax.mpi.wire`'s (ACTIVATION, GRADIENT: one checked int64 header, then one
contiguous numpy payload; non-blocking upper-case mpi4py calls, nothing pickled), on one tag per receiving stage and
direction. :class:`StageLink` carries activations and gradients stage rank to stage rank with receives posted ahead
(each stream carries minibatches 0, 1, ... in order: forwards and backwards run in minibatch order on every stage),
so a send completes when the data is in its consumer's buffer, which is when the sending task completes. The control
stream and the reports are :mod:`hetpipe_jax.mpi.stage_server`'s.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import jax
import numpy as np

from hetpipe_jax import models
from hetpipe_jax.mpi import wire
from hetpipe_jax.mpi.wire import Kind, ProtocolError
from hetpipe_jax.rules.schedule import TaskKind

REPORT_SIZE = 8  # a REPORT's float64 payload (wire's table)
RECEIVES_AHEAD = 4  # completion reports posted ahead per stage rank
TASK_CODES = {TaskKind.FORWARD: 0, TaskKind.BACKWARD: 1, TaskKind.FORWARD_BACKWARD: 2}  # a TASK's ``arg0``
TASK_KINDS = {v: k for k, v in TASK_CODES.items()}


class SentMarker:
  """What a task whose output leaves for another rank returns: ready once the output is in its consumer's buffer."""

  def __init__(self, requests: list, buffers: list):
    self._requests = requests
    self._buffers = buffers  # alive until sent

  def block_until_ready(self) -> "SentMarker":
    wire.wait_all(self._requests)
    self._buffers = []
    return self


class PostedReceive:
  """A receive of one header + payload posted ahead; ``index`` is its place in the stream (the minibatch)."""

  def __init__(self, comm, source: int, tag: int, index: int, shape: tuple, dtype):
    self.index = index
    self.header = np.empty(wire.HEADER_SIZE, np.int64)
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
    wire.wait_all([posted.header_request])
    wire.check_header(posted.header, source=stream.source, dest=self.rank, kinds=(kind,), vw=self.vw_id,
                      minibatch=minibatch, stage=sender, version=version, size=_boundary_size(stream.shape))
    wire.wait_all([posted.payload_request])
    return posted.payload

  def send_activation(self, stage: int, minibatch: int, version: int, out) -> SentMarker:
    """Sends stage ``stage``'s output of ``minibatch`` to stage ``stage + 1``'s rank."""
    return self._send(Kind.ACTIVATION, stage, stage + 1, minibatch, version, out)

  def send_gradient(self, stage: int, minibatch: int, version: int, grad) -> SentMarker:
    """Sends the gradient of stage ``stage``'s input for ``minibatch`` to stage ``stage - 1``'s rank."""
    return self._send(Kind.GRADIENT, stage, stage - 1, minibatch, version, grad)

  def _send(self, kind: Kind, stage: int, dest_stage: int, minibatch: int, version: int, value) -> SentMarker:
    payload = np.ascontiguousarray(jax.device_get(value))
    header = wire.make_header(kind, self.vw_id, minibatch=minibatch, stage=stage, version=version,
                              size=payload.size)
    dest, tag = self.stage_ranks[dest_stage], _data_tag(kind, dest_stage)
    requests = [self.comm.Isend(header, dest=dest, tag=tag), self.comm.Isend(payload, dest=dest, tag=tag)]
    return SentMarker(requests, [header, payload])

  def close(self) -> None:
    """Cancels the receives posted beyond the run's last minibatch (none when every message arrived)."""
    for stream in self._streams.values():
      stream.cancel()


def _data_tag(kind: Kind, receiving_stage: int) -> int:
  return wire.TAG_STAGE_DATA + 2 * receiving_stage + (1 if kind is Kind.GRADIENT else 0)


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
