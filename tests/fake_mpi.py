"""An in-process stand-in for the mpi4py point-to-point calls the stage-rank and PS protocols use (``Isend``,
``Irecv``, ``Recv``, ``Iprobe``, ``Test``, ``Wait``, ``Cancel``, ``Get_rank``), so a driver, its stage ranks and the PS
shards' service loops can run as threads of one test.

MPI's matching rules are kept where the protocol relies on them: messages from one source to one destination on one
tag are received in the order they were sent, by receives in the order they were posted; a message larger than the
posted buffer is an error (MPI's truncation). Sends complete at once (eager; every message is buffered).
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np


class FakeRequest:
  def __init__(self, buf=None):
    self.buf = buf
    self.done = buf is None
    self.cancelled = False
    self.error = None

  def Test(self):  # noqa: N802 (mpi4py's names)
    if self.error is not None:
      raise self.error
    return self.done or self.cancelled

  def Wait(self):  # noqa: N802
    while not self.Test():
      time.sleep(1e-5)

  def Cancel(self):  # noqa: N802
    self.cancelled = True


class FakeWorld:
  """``comm(rank)`` gives each rank its communicator; ``sent`` counts messages per (source, dest, tag)."""

  def __init__(self):
    self.lock = threading.Lock()
    self.messages = collections.defaultdict(collections.deque)  # (src, dst, tag) -> unmatched payload copies
    self.receives = collections.defaultdict(collections.deque)  # (src, dst, tag) -> posted receives
    self.sent = collections.Counter()
    self.tamper = None  # optional (src, dst, tag, array) -> array: alters a message in flight (fault drills)

  def comm(self, rank: int) -> "FakeComm":
    return FakeComm(self, rank)


def _deliver(request: FakeRequest, data: np.ndarray) -> None:
  raw = np.ascontiguousarray(data).view(np.uint8).ravel()
  target = request.buf.view(np.uint8).reshape(-1)
  if raw.size > target.size:
    request.error = RuntimeError(f"message truncated: {raw.size} bytes into a buffer of {target.size}")
    return
  target[:raw.size] = raw
  request.done = True


class FakeComm:
  def __init__(self, world: FakeWorld, rank: int):
    self.world = world
    self.rank = rank

  def Get_rank(self):  # noqa: N802
    return self.rank

  def Isend(self, buf, dest, tag):  # noqa: N802
    data = np.array(buf, copy=True)
    world = self.world
    key = (self.rank, dest, tag)
    if world.tamper is not None:
      data = world.tamper(self.rank, dest, tag, data)
    with world.lock:
      world.sent[key] += 1
      pending = world.receives[key]
      while pending and pending[0].cancelled:
        pending.popleft()
      if pending:
        _deliver(pending.popleft(), data)
      else:
        world.messages[key].append(data)
    return FakeRequest()

  def Irecv(self, buf, source, tag):  # noqa: N802
    request = FakeRequest(buf)
    world = self.world
    key = (source, self.rank, tag)
    with world.lock:
      if world.messages[key]:
        _deliver(request, world.messages[key].popleft())
      else:
        world.receives[key].append(request)
    return request

  def Recv(self, buf, source, tag):  # noqa: N802
    self.Irecv(buf, source, tag).Wait()

  def Iprobe(self, source, tag, status=None):  # noqa: N802
    """True when a message from ``source`` (``MPI.ANY_SOURCE``: any) on ``tag`` waits unmatched; sets its source."""
    with self.world.lock:
      for (src, dst, t), queued in self.world.messages.items():
        if dst == self.rank and t == tag and queued and (source < 0 or src == source):
          if status is not None:
            status.Set_source(src)
          return True
    return False
