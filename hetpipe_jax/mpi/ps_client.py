"""The PS protocol over MPI: a VW's client (:class:`MPIPSClient`), a stage rank's (:class:`StageRankPSClient`), the
PS side's header check and payload receive, and the PS bytes each rank sends (:data:`PS_BYTES`).

Runtime layer (numpy; mpi4py is imported by the client that first uses it). VWs are ranks S..S+N-1, the
parameter-server shards ranks 0..S-1 (S = 1: rank 0). Messages are :mod:`hetpipe_jax.mpi.wire`'s: a header on
``TAG_PS_HEADER`` followed, when ``size > 0``, by one contiguous numpy payload on ``TAG_PS_DATA``; the kinds and
fields of PUSH, METRICS, PULL, WEIGHTS, DONE, SEGMENT and OPTSTATE are in its table. The receiver checks the header
against the sender's rank and the payload size the kind allows (:func:`check_header`).

A WEIGHTS reply is followed by a second payload on ``TAG_PS_DATA``: the weights' vector clock (per VW, how many of its
waves they hold; HetPipe §5 under ``ps_apply="on_receipt"``), whose minimum must equal the header's global clock.

Stage ranks (:class:`hetpipe_jax.ps.shards.VWParts`): a VW's ranks each PUSH their part of a shard's slice (their
stages' elements; the shard applies the wave once every part arrived), WEIGHTS go to each rank holding a part (its
part) and to the driver (its part, possibly empty, with the vector clock); PULL, METRICS, SEGMENT and DONE come from
the driver only, OPTSTATE from every rank holding parameters (its stages'). Sizes are then the part's.
"""

from __future__ import annotations

import json
import time
from typing import Callable

import numpy as np

from hetpipe_jax.mpi import wire
from hetpipe_jax.mpi.wire import Kind, ProtocolError  # noqa: F401 (ProtocolError: what the checks raise)

METRICS_SIZE = 3  # [wave loss sum, minibatches in the wave, VW seconds since start]
BARRIER_MAX_S = 2e-4  # a checkpoint barrier's longest poll pause (it waits for every VW's segment)


def check_header(header: np.ndarray, source_rank: int, *, num_params: int, expect_kinds: tuple[Kind, ...],
                 first_vw_rank: int = 1, vw_of_rank: dict[int, int] | None = None,
                 dest: int | None = None) -> wire.Header:
  """Checks a header of the PS protocol (:func:`hetpipe_jax.mpi.wire.check_header`, then what the PS protocol
  adds); returns its fields.

  Args:
    header: the int64 header received.
    source_rank: the rank it came from.
    num_params: the float count PUSH and WEIGHTS must carry (a shard's slice under sharded PS).
    expect_kinds: the kinds the receiver accepts now.
    first_vw_rank: rank of VW 0 (= the number of PS shards; ranks below it are shards).
    vw_of_rank: stage ranks: every VW rank's VW (drivers and stage ranks); None: rank r hosts VW r - first_vw_rank.
    dest: the receiving rank (named in the error).

  Raises:
    ProtocolError: what :func:`hetpipe_jax.mpi.wire.check_header` refuses (bad magic or wire version, unknown or
      unexpected kind), a VW id that does not match the sender's rank, a negative wave, or a payload size that the
      kind does not allow.
  """
  h = wire.check_header(header, source=source_rank, dest=dest, kinds=expect_kinds)
  kind, vw_id, wave, size = h.kind, h.vw, h.wave, h.size
  if vw_of_rank is not None:
    if source_rank >= first_vw_rank and vw_of_rank.get(source_rank) != vw_id:
      raise ProtocolError(f"rank {source_rank} claims to be VW {vw_id} (it serves VW {vw_of_rank.get(source_rank)})")
  elif source_rank >= first_vw_rank and vw_id != source_rank - first_vw_rank:
    raise ProtocolError(f"rank {source_rank} claims to be VW {vw_id} (rank r hosts VW r-{first_vw_rank})")
  if wave < 0:
    raise ProtocolError(f"{kind.name} from rank {source_rank} has negative wave {wave}")
  if size < 0:
    raise ProtocolError(f"{kind.name} from rank {source_rank} has negative size {size}")
  expected = {Kind.PUSH: num_params, Kind.WEIGHTS: num_params, Kind.METRICS: METRICS_SIZE, Kind.PULL: 0}.get(kind)
  if expected is not None and size != expected:
    raise ProtocolError(f"{kind.name} from rank {source_rank} carries {size} elements, expected {expected}")
  return h


class ByteCounts:
  """Payload bytes of wave updates (PUSH) and pulled weights (WEIGHTS) this process sent, per destination rank.

  Every rank keeps one (:data:`PS_BYTES`); the job sums them over ranks (``MPI.Reduce``) into a
  ``[world, world]`` matrix of bytes sent from rank i to rank j, the runtime's PS traffic per rank pair.
  """

  def __init__(self):
    self.sent: dict[int, int] = {}

  def add(self, dest: int, num_bytes: int) -> None:
    self.sent[dest] = self.sent.get(dest, 0) + int(num_bytes)

  def matrix_row(self, rank: int, world: int) -> np.ndarray:
    """int64 ``[world, world]``: this rank's row filled in, zeros elsewhere (sum it over ranks)."""
    m = np.zeros((world, world), np.int64)
    for dest, n in self.sent.items():
      m[rank, dest] = n
    return m


PS_BYTES = ByteCounts()


class MPIPSClient:
  """A VW's side of the protocol (implements :class:`hetpipe_jax.runtime.virtual_worker.PSClient`).

  Sends are non-blocking (``Isend``) so a VW never blocks on a PS that is itself sending; buffers are kept alive
  until their requests complete.

  Sharded parameter servers (``shards`` with S > 1 shards on ranks ``0..S-1``): a wave update is pushed to every
  shard as that shard's slice, a pull is requested from every shard and completes when every shard answered; it
  then returns ``(vector clock, weights, per-shard vector clocks)``, the vector clock being the element-wise minimum
  over shards (what every layer is guaranteed to hold). Metrics and reports go to the lead shard (rank 0).

  Args:
    comm: the MPI communicator.
    vw_id: this VW (rank ``first_vw_rank + vw_id``).
    num_params: the model's parameter count.
    num_virtual_workers: N.
    shards: which slice each shard holds; None: one PS on rank 0 holding everything.
    first_vw_rank: rank of VW 0 (= the number of PS shards).
    parts: stage ranks (:class:`hetpipe_jax.ps.shards.VWParts` of this VW; this client is its driver's): a push
      carries only the driver's part of each shard it sends to (the stage ranks push theirs,
      :class:`StageRankPSClient`), and a pull's reply from each shard carries the driver's part (possibly empty)
      and the shard's vector clock; the flat weights returned hold the driver's elements (zeros elsewhere).
  """

  def __init__(self, comm, vw_id: int, num_params: int, num_virtual_workers: int, shards=None,
               first_vw_rank: int = 1, parts=None):
    from mpi4py import MPI  # runtime-only dependency
    self._mpi = MPI
    self.comm = comm
    self.vw_id = vw_id
    self.num_params = num_params
    self.num_virtual_workers = num_virtual_workers
    self.shards = shards
    self.num_shards = 1 if shards is None else shards.num_shards
    self.first_vw_rank = first_vw_rank
    self.parts = parts
    self.rank = comm.Get_rank() if parts is not None else first_vw_rank + vw_id
    self.num_pulls_requested = 0
    self._sends: list = []  # (request, buffer)
    self._pull_requests: dict[int, tuple] = {}  # shard -> (request, header) of an outstanding pull's reply
    self._pull_parts: dict[int, tuple] = {}  # shard -> (vector clock, weights slice) received so far
    self._t0 = time.perf_counter()
    # a VW's PS channel thread (hetpipe_jax.runtime.ps_channel) may make this client's calls, one thread at a time
    self.serves_other_threads = MPI.Query_thread() >= MPI.THREAD_SERIALIZED

  @property
  def _pull_request(self):
    """Truthy while a pull is outstanding (some shard has not answered)."""
    return self._pull_requests or None

  def _isend(self, kind: Kind, wave: int, payload: np.ndarray | None = None, dest: int = 0) -> None:
    isend_message(self.comm, self._sends, self.vw_id, kind, wave, payload, dest)

  def _reap(self) -> None:
    self._sends = [(r, b) for r, b in self._sends if not r.Test()]

  def _shard_size(self, shard: int) -> int:
    if self.parts is not None:
      return self.parts.part_size(self.rank, shard)
    return self.num_params if self.shards is None else self.shards.size(shard)

  def push(self, wave_id: int, flat_delta: np.ndarray, loss_sum: float, num_minibatches: int) -> None:
    flat_delta = flat_delta.astype(np.float32, copy=False)
    if self.parts is not None:
      push_parts(self._isend, self.parts, self.rank, wave_id, flat_delta)
    for shard in range(self.num_shards if self.parts is None else 0):
      part = flat_delta if self.shards is None else self.shards.gather(flat_delta, shard)
      self._isend(Kind.PUSH, wave_id, part, dest=shard)
    metrics = np.array([loss_sum, num_minibatches, time.perf_counter() - self._t0], np.float64)
    self._isend(Kind.METRICS, wave_id, metrics)
    self._reap()

  def _expect_weights(self, shard: int) -> None:
    header = np.empty(wire.HEADER_SIZE, np.int64)
    self._pull_requests[shard] = (self.comm.Irecv(header, source=shard, tag=wire.TAG_PS_HEADER), header)

  def request_pull(self, required_clock: int) -> None:
    if self._pull_requests or self._pull_parts:
      raise RuntimeError("a pull is already outstanding")
    self.num_pulls_requested += 1
    for shard in range(self.num_shards):
      self._isend(Kind.PULL, required_clock, dest=shard)
      self._expect_weights(shard)

  def poll_pull(self):
    self._reap()
    if not self._pull_requests:
      return None
    for shard, (request, header) in list(self._pull_requests.items()):
      if not request.Test():
        continue
      del self._pull_requests[shard]
      size = self._shard_size(shard)
      clock = check_header(header, shard, num_params=size, expect_kinds=(Kind.WEIGHTS,),
                           first_vw_rank=self.first_vw_rank, dest=self.rank).wave
      weights = np.empty(size, np.float32)
      self.comm.Recv(weights, source=shard, tag=wire.TAG_PS_DATA)
      vector_clock = np.empty(self.num_virtual_workers, np.int64)
      self.comm.Recv(vector_clock, source=shard, tag=wire.TAG_PS_DATA)
      if int(vector_clock.min()) != clock or int(vector_clock.max()) < 0:
        raise ProtocolError(f"WEIGHTS from rank {shard} for VW {self.vw_id} at global clock {clock} carry vector "
                            f"clock {vector_clock.tolist()} (its minimum must be the global clock)")
      self._pull_parts[shard] = (tuple(int(c) for c in vector_clock), weights)
    if self._pull_requests:
      return None
    parts, self._pull_parts = self._pull_parts, {}
    if self.parts is not None:  # stage ranks: the driver's elements; the stage ranks got theirs from the shards
      flat = np.zeros(self.num_params, np.float32)
      for shard, (_, part) in parts.items():
        flat[self.parts.flat_index[(self.rank, shard)]] = part
      if self.shards is None:
        return parts[0][0], flat
    elif self.shards is None:
      return parts[0]
    else:
      flat = np.empty(self.num_params, np.float32)
      for shard, (_, part) in parts.items():
        self.shards.scatter(flat, shard, part)
    per_shard = tuple(parts[s][0] for s in range(self.num_shards))
    vector_clock = tuple(min(vc[v] for vc in per_shard) for v in range(self.num_virtual_workers))
    return vector_clock, flat, per_shard

  def drain_pull(self) -> None:
    """Waits for the reply to an outstanding pull and drops it (a segment's end: the barrier's weights follow)."""
    wire.poll_until(lambda: not self._pull_requests or self.poll_pull() is not None)

  def barrier(self, num_waves: int, report: dict, opt_state: np.ndarray | None) -> tuple[tuple[int, ...], np.ndarray]:
    """A checkpoint barrier: sends the segment's report to the lead (an empty SEGMENT to every other shard) and, when
    a checkpoint is due, the optimizer state of this rank's stages, then waits, without spinning, for every shard's
    global weights, which hold every VW's waves of the run so far.

    Returns:
      ``(vector clock, float32 [num_params])`` as :meth:`poll_pull` (with stage ranks: this rank's elements).
    """
    self.drain_pull()
    self._isend(Kind.SEGMENT, num_waves, np.frombuffer(json.dumps(report).encode(), dtype=np.uint8).copy())
    for shard in range(1, self.num_shards):
      self._isend(Kind.SEGMENT, num_waves, None, dest=shard)
    if opt_state is not None:
      self._isend(Kind.OPTSTATE, num_waves, opt_state)
    for shard in range(self.num_shards):
      self._expect_weights(shard)
    got = wire.poll_until(self.poll_pull, wire.Backoff(max_s=BARRIER_MAX_S))
    return got[0], got[1]

  def send_opt_state(self, num_waves: int, opt_state: np.ndarray) -> None:
    """Sends the VW's optimizer state (uint8 bytes) for the checkpoint at the run's end (before :meth:`finish`)."""
    self._isend(Kind.OPTSTATE, num_waves, opt_state)

  def finish(self, num_waves: int, report: dict) -> None:
    """Sends DONE with a JSON report (to the lead; an empty DONE to the other shards) and waits for every send to
    complete (a reply to a pull is drained)."""
    payload = np.frombuffer(json.dumps(report).encode(), dtype=np.uint8).copy()
    self._isend(Kind.DONE, num_waves, payload)
    for shard in range(1, self.num_shards):
      self._isend(Kind.DONE, num_waves, None, dest=shard)

    def finished() -> bool:
      if self._pull_requests:
        self.poll_pull()
      self._reap()
      return not self._sends and not self._pull_requests
    wire.poll_until(finished)


def isend_message(comm, sends: list, vw_id: int, kind: Kind, wave: int, payload: np.ndarray | None,
                  dest: int) -> None:
  """Sends one VW → PS message: its header, then its payload when it has one (non-blocking; ``(request, buffer)``
  pairs are appended to ``sends``, which keeps the buffers alive until sent). A PUSH payload's bytes are counted in
  :data:`PS_BYTES` (the job's ``ps_bytes``)."""
  size = 0 if payload is None else payload.size
  header = wire.make_header(kind, vw_id, wave=wave, size=size)
  sends.append((comm.Isend(header, dest=dest, tag=wire.TAG_PS_HEADER), header))
  if size:
    payload = np.ascontiguousarray(payload)
    if kind is Kind.PUSH:
      PS_BYTES.add(dest, payload.nbytes)
    sends.append((comm.Isend(payload, dest=dest, tag=wire.TAG_PS_DATA), payload))


def push_parts(isend: Callable, parts, rank: int, wave_id: int, values: np.ndarray,
               positions: dict[int, np.ndarray] | None = None) -> None:
  """Stage ranks: ``rank``'s part of wave ``wave_id`` to every shard it sends to (:meth:`VWParts.senders`).

  Args:
    isend: ``(kind, wave, payload, dest)`` that sends one message.
    parts: the VW's :class:`hetpipe_jax.ps.shards.VWParts`.
    rank: the sending rank.
    wave_id: the wave.
    values: float32: the wave's update, ``[num_params]`` (valid at least on ``rank``'s elements) when ``positions``
      is None, else ``rank``'s own elements only.
    positions: per shard, the part's positions in ``values``; None: ``parts.flat_index``.
  """
  for shard in parts.shards_of(rank):
    index = parts.flat_index[(rank, shard)] if positions is None else positions[shard]
    isend(Kind.PUSH, wave_id, np.ascontiguousarray(values[index], np.float32), dest=shard)


class StageRankPSClient:
  """A stage rank's side of the PS (stage ranks): pushes its parts of each wave to their shards and receives its
  parts of every pull the driver requested, straight from the shards.

  The driver decides everything: it requests each pull (the shards answer every receiver) and later tells the rank,
  in its version stream, to install the next one; replies arrive in the order of the requests (one pull outstanding
  per VW, MPI's order per source and tag), so the rank's k-th install takes every shard's k-th reply. Values are the
  rank's own elements only (``local_index``), never a whole-model vector.

  Args:
    comm: the MPI communicator.
    parts: the VW's :class:`hetpipe_jax.ps.shards.VWParts`.
    local_index: int64 ``[n]``: the flat indices of this rank's elements, ascending (its stages' layers in order).
    num_virtual_workers: N.

  Raises:
    ValueError: a part of this rank holds an element outside ``local_index``.
  """

  def __init__(self, comm, parts, local_index: np.ndarray, num_virtual_workers: int):
    self.comm = comm
    self.parts = parts
    self.vw_id = parts.vw_id
    self.rank = comm.Get_rank()
    self.local_index = np.asarray(local_index, np.int64)
    self.num_virtual_workers = num_virtual_workers
    self.shards = parts.shards_of(self.rank)
    self.positions = {}  # shard -> the part's positions among this rank's elements
    for shard in self.shards:
      idx = parts.flat_index[(self.rank, shard)]
      pos = np.searchsorted(self.local_index, idx)
      if idx.size and (pos.max() >= self.local_index.size or not np.array_equal(self.local_index[pos], idx)):
        raise ValueError(f"rank {self.rank}'s part of shard {shard} holds elements it does not run")
      self.positions[shard] = pos
    self.num_pulls_received = 0
    self._sends: list = []
    self._posted: dict[int, tuple] = {}  # shard -> (request, header) of the next reply
    self._got: dict[int, tuple] = {}  # shard -> (vector clock, part) of the next pull
    self._post()

  def _post(self) -> None:
    for shard in self.shards:
      header = np.empty(wire.HEADER_SIZE, np.int64)
      self._posted[shard] = (self.comm.Irecv(header, source=shard, tag=wire.TAG_PS_HEADER), header)

  def _isend(self, kind: Kind, wave: int, payload: np.ndarray, dest: int) -> None:
    isend_message(self.comm, self._sends, self.vw_id, kind, wave, payload, dest)
    self._sends = [(r, b) for r, b in self._sends if not r.Test()]

  def push(self, wave_id: int, local_delta: np.ndarray) -> None:
    """Pushes this rank's parts of wave ``wave_id`` (float32 ``[n]``: its elements, in ``local_index`` order)."""
    push_parts(self._isend, self.parts, self.rank, wave_id, local_delta, self.positions)

  def poll_pull(self) -> tuple[dict[int, tuple[int, ...]], np.ndarray] | None:
    """The next pull's reply once every shard's part arrived: ``({shard: its vector clock}, float32 [n])``, this
    rank's elements in ``local_index`` order; None while some part is missing.

    Raises:
      ProtocolError: a malformed reply.
    """
    got = self._take_reply()
    if got is not None:
      self.num_pulls_received += 1
    return got

  def _take_reply(self) -> tuple[dict[int, tuple[int, ...]], np.ndarray] | None:
    """The next WEIGHTS reply from every shard of this rank (a pull's or a barrier's), or None while some part is
    missing; posts the receives of the next one."""
    self._sends = [(r, b) for r, b in self._sends if not r.Test()]
    for shard, (request, header) in list(self._posted.items()):
      if shard in self._got or not request.Test():
        continue
      size = self.parts.part_size(self.rank, shard)
      h = check_header(header, shard, num_params=size, expect_kinds=(Kind.WEIGHTS,),
                       first_vw_rank=self.parts.num_shards, dest=self.rank)
      if h.vw != self.vw_id:
        raise ProtocolError(f"WEIGHTS from rank {shard} for VW {h.vw} reached rank {self.rank} (VW {self.vw_id})")
      part = np.empty(size, np.float32)
      self.comm.Recv(part, source=shard, tag=wire.TAG_PS_DATA)
      vector_clock = np.empty(self.num_virtual_workers, np.int64)
      self.comm.Recv(vector_clock, source=shard, tag=wire.TAG_PS_DATA)
      self._got[shard] = (tuple(int(c) for c in vector_clock), part)
    if len(self._got) < len(self.shards):
      return None
    got, self._got = self._got, {}
    self._post()
    local = np.zeros(self.local_index.size, np.float32)
    for shard, (_, part) in got.items():
      local[self.positions[shard]] = part
    return {shard: vc for shard, (vc, _) in got.items()}, local

  def barrier(self, num_waves: int, opt_state: np.ndarray | None) -> np.ndarray:
    """A checkpoint barrier (after :meth:`finish` drained the segment's pulls): sends the optimizer state of this
    rank's stages to the lead shard when a checkpoint is due, then waits for its parts of the barrier's global
    weights from its shards (they hold every VW's waves so far; not counted as a pull).

    Returns:
      float32 ``[n]``: this rank's elements in ``local_index`` order.
    """
    if opt_state is not None:
      self.send_opt_state(num_waves, opt_state)
    if not self._posted:
      self._post()
    return wire.poll_until(self._take_reply, wire.Backoff(max_s=BARRIER_MAX_S))[1]

  def send_opt_state(self, num_waves: int, opt_state: np.ndarray) -> None:
    """Sends the optimizer state of this rank's stages (uint8 bytes) to the lead shard (a checkpoint's)."""
    self._isend(Kind.OPTSTATE, num_waves, opt_state, dest=0)

  def finish(self, num_pulls: int) -> None:
    """Drops the replies of pulls the driver requested but never installed (``num_pulls`` requested in all), cancels
    the receive posted for a further one and completes every send."""

    def drained() -> bool:
      if self.num_pulls_received < num_pulls:
        self.poll_pull()
      return self.num_pulls_received >= num_pulls
    wire.poll_until(drained)
    for request, _ in self._posted.values():
      request.Cancel()
      request.Wait()
    self._posted = {}
    self.flush()

  def flush(self) -> None:
    """Completes every send (the end of :meth:`finish`; the last checkpoint's optimizer state after it)."""
    wire.wait_all([r for r, _ in self._sends])
    self._sends = []


def recv_payload(comm, source: int, kind: Kind, size: int) -> np.ndarray:
  """Receives the payload that follows a header of ``kind`` (blocking; it was sent right after the header)."""
  dtype = {Kind.PUSH: np.float32, Kind.WEIGHTS: np.float32, Kind.METRICS: np.float64, Kind.DONE: np.uint8,
           Kind.SEGMENT: np.uint8, Kind.OPTSTATE: np.uint8}[kind]
  buf = np.empty(size, dtype)
  if size:
    comm.Recv(buf, source=source, tag=wire.TAG_PS_DATA)
  return buf
