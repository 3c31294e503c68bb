"""MPI wire protocol between VWs (ranks 1..N) and the parameter server (rank 0).

Runtime layer. Every message is a fixed int64 header ``[MAGIC, kind, vw_id, wave, size]`` on ``TAG_HEADER``
followed, when ``size > 0``, by one contiguous numpy payload on ``TAG_DATA`` (upper-case mpi4py calls, never
pickled arrays). The receiver checks the header against the sender's rank and the expected payload size.

=========  ======================  =================  ==========================
kind       direction               ``wave`` field     payload
=========  ======================  =================  ==========================
PUSH       VW → PS                 wave id            float32 ``[num_params]``
METRICS    VW → PS                 wave id            float64 ``[METRICS_SIZE]``
PULL       VW → PS                 required clock     none
WEIGHTS    PS → VW                 global clock       float32 ``[num_params]``, then int64 ``[N]``
DONE       VW → PS                 waves done         uint8 JSON (records, stats)
SEGMENT    VW → PS                 waves done         uint8 JSON (the segment's records, stats; a checkpoint
                                                      barrier, see :mod:`hetpipe_jax.jobs.resume`)
OPTSTATE   VW → PS                 waves done         uint8: the VW's optimizer state by layer, leaves' bytes
=========  ======================  =================  ==========================

A WEIGHTS reply is followed by a second payload on ``TAG_DATA``: the weights' vector clock (per VW, how many of its
waves they hold; HetPipe §5 under ``ps_apply="on_receipt"``), whose minimum must equal the header's global clock.
"""

from __future__ import annotations

import enum
import json
import time

import numpy as np

MAGIC = 0x48455450  # "HETP"
HEADER_SIZE = 5
TAG_HEADER = 11
TAG_DATA = 12
METRICS_SIZE = 3  # [wave loss sum, minibatches in the wave, VW seconds since start]


class Kind(enum.IntEnum):
  PUSH = 1
  METRICS = 2
  PULL = 3
  WEIGHTS = 4
  DONE = 5
  SEGMENT = 6
  OPTSTATE = 7


class ProtocolError(RuntimeError):
  """A malformed or unexpected message."""


def make_header(kind: Kind, vw_id: int, wave: int, size: int) -> np.ndarray:
  return np.array([MAGIC, int(kind), vw_id, wave, size], dtype=np.int64)


def check_header(header: np.ndarray, source_rank: int, *, num_params: int, expect_kinds: tuple[Kind, ...]) -> Kind:
  """Validates a received header; returns its kind.

  Raises:
    ProtocolError: bad magic, unknown or unexpected kind, a VW id that does not match the sender's rank, a
      negative wave, or a payload size that the kind does not allow.
  """
  magic, kind_value, vw_id, wave, size = (int(v) for v in header)
  if magic != MAGIC:
    raise ProtocolError(f"message from rank {source_rank} has bad magic {magic:#x}")
  try:
    kind = Kind(kind_value)
  except ValueError:
    raise ProtocolError(f"message from rank {source_rank} has unknown kind {kind_value}") from None
  if kind not in expect_kinds:
    raise ProtocolError(f"rank {source_rank} sent {kind.name}, expected one of {[k.name for k in expect_kinds]}")
  if source_rank != 0 and vw_id != source_rank - 1:
    raise ProtocolError(f"rank {source_rank} claims to be VW {vw_id} (rank r hosts VW r-1)")
  if wave < 0:
    raise ProtocolError(f"{kind.name} from rank {source_rank} has negative wave {wave}")
  if size < 0:
    raise ProtocolError(f"{kind.name} from rank {source_rank} has negative size {size}")
  expected = {Kind.PUSH: num_params, Kind.WEIGHTS: num_params, Kind.METRICS: METRICS_SIZE, Kind.PULL: 0}.get(kind)
  if expected is not None and size != expected:
    raise ProtocolError(f"{kind.name} from rank {source_rank} carries {size} elements, expected {expected}")
  return kind


class MPIPSClient:
  """A VW's side of the protocol (implements :class:`hetpipe_jax.runtime.virtual_worker.PSClient`).

  Sends are non-blocking (``Isend``) so a VW never blocks on a PS that is itself sending; buffers are kept alive
  until their requests complete.
  """

  def __init__(self, comm, vw_id: int, num_params: int, num_virtual_workers: int):
    from mpi4py import MPI  # runtime-only dependency
    self._mpi = MPI
    self.comm = comm
    self.vw_id = vw_id
    self.num_params = num_params
    self.num_virtual_workers = num_virtual_workers
    self._sends: list = []  # (request, buffer)
    self._pull_header: np.ndarray | None = None
    self._pull_request = None
    self._t0 = time.perf_counter()

  def _isend(self, kind: Kind, wave: int, payload: np.ndarray | None = None) -> None:
    size = 0 if payload is None else payload.size
    header = make_header(kind, self.vw_id, wave, size)
    self._sends.append((self.comm.Isend(header, dest=0, tag=TAG_HEADER), header))
    if payload is not None and size:
      payload = np.ascontiguousarray(payload)
      self._sends.append((self.comm.Isend(payload, dest=0, tag=TAG_DATA), payload))

  def _reap(self) -> None:
    self._sends = [(r, b) for r, b in self._sends if not r.Test()]

  def push(self, wave_id: int, flat_delta: np.ndarray, loss_sum: float, num_minibatches: int) -> None:
    self._isend(Kind.PUSH, wave_id, flat_delta.astype(np.float32, copy=False))
    metrics = np.array([loss_sum, num_minibatches, time.perf_counter() - self._t0], np.float64)
    self._isend(Kind.METRICS, wave_id, metrics)
    self._reap()

  def request_pull(self, required_clock: int) -> None:
    if self._pull_request is not None:
      raise RuntimeError("a pull is already outstanding")
    self._isend(Kind.PULL, required_clock)
    self._pull_header = np.empty(HEADER_SIZE, np.int64)
    self._pull_request = self.comm.Irecv(self._pull_header, source=0, tag=TAG_HEADER)

  def poll_pull(self):
    self._reap()
    if self._pull_request is None or not self._pull_request.Test():
      return None
    self._pull_request = None
    check_header(self._pull_header, 0, num_params=self.num_params, expect_kinds=(Kind.WEIGHTS,))
    weights = np.empty(self.num_params, np.float32)
    self.comm.Recv(weights, source=0, tag=TAG_DATA)
    vector_clock = np.empty(self.num_virtual_workers, np.int64)
    self.comm.Recv(vector_clock, source=0, tag=TAG_DATA)
    clock = int(self._pull_header[3])
    if int(vector_clock.min()) != clock or int(vector_clock.max()) < 0:
      raise ProtocolError(f"WEIGHTS for VW {self.vw_id} at global clock {clock} carry vector clock "
                          f"{vector_clock.tolist()} (its minimum must be the global clock)")
    return tuple(int(c) for c in vector_clock), weights

  def drain_pull(self) -> None:
    """Waits for the reply to an outstanding pull and drops it (a segment's end: the barrier's weights follow)."""
    while self._pull_request is not None:
      if self.poll_pull() is None:
        time.sleep(1e-4)

  def barrier(self, num_waves: int, report: dict, opt_state: np.ndarray | None) -> tuple[tuple[int, ...], np.ndarray]:
    """A checkpoint barrier: sends the segment's report (and the optimizer state, when a checkpoint is due) and
    waits, without spinning, for the PS's global weights, which hold every VW's waves of the run so far.

    Returns:
      ``(vector clock, float32 [num_params])`` as :meth:`poll_pull`.
    """
    self.drain_pull()
    self._isend(Kind.SEGMENT, num_waves, np.frombuffer(json.dumps(report).encode(), dtype=np.uint8).copy())
    if opt_state is not None:
      self._isend(Kind.OPTSTATE, num_waves, opt_state)
    self._pull_header = np.empty(HEADER_SIZE, np.int64)
    self._pull_request = self.comm.Irecv(self._pull_header, source=0, tag=TAG_HEADER)
    while True:
      reply = self.poll_pull()
      if reply is not None:
        return reply
      time.sleep(2e-4)

  def send_opt_state(self, num_waves: int, opt_state: np.ndarray) -> None:
    """Sends the VW's optimizer state (uint8 bytes) for the checkpoint at the run's end (before :meth:`finish`)."""
    self._isend(Kind.OPTSTATE, num_waves, opt_state)

  def finish(self, num_waves: int, report: dict) -> None:
    """Sends DONE with a JSON report and waits for every send to complete (a reply to a pull is drained)."""
    payload = np.frombuffer(json.dumps(report).encode(), dtype=np.uint8).copy()
    self._isend(Kind.DONE, num_waves, payload)
    while self._sends or self._pull_request is not None:
      if self._pull_request is not None and self.poll_pull() is not None:
        continue
      self._reap()
      time.sleep(1e-4)


def recv_payload(comm, source: int, kind: Kind, size: int) -> np.ndarray:
  """Receives the payload that follows a header of ``kind`` (blocking; it was sent right after the header)."""
  dtype = {Kind.PUSH: np.float32, Kind.WEIGHTS: np.float32, Kind.METRICS: np.float64, Kind.DONE: np.uint8,
           Kind.SEGMENT: np.uint8, Kind.OPTSTATE: np.uint8}[kind]
  buf = np.empty(size, dtype)
  if size:
    comm.Recv(buf, source=source, tag=TAG_DATA)
  return buf
