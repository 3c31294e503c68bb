"""A virtual worker's PS channel: its wave pushes and pulls on their own thread, strictly in order (HetPipe §5).

Runtime layer. Under WSP a wave's push and the pull a later wave needs have slack: with staleness bound D, a
minibatch of wave c + 1 needs the global weights through wave c - D - 1 only, so the push of wave c (the losses read
back, the wave's update brought to the host and sent) and the pull that wave c + D + 2 needs may overlap the next
wave's compute. The channel takes them off the scheduler thread (:func:`hetpipe_jax.runtime.vw_driver.run`): the
scheduler does every bookkeeping step of a wave end and of a pull itself, synchronously (the VW's own waves, the wave
delta's reset, the :class:`~hetpipe_jax.rules.wsp.VWSyncState` transitions, the install's device adds), and hands the
channel device references (the wave's delta trees, its loss arrays) and pull requests. The channel thread executes
them in the order they were sent, so a pull request never reaches the PS before the VW's push of an earlier wave
(the PS answers it with weights that hold every wave the VW ended before asking, as over one ordered MPI channel);
it reads the wave's losses back (the NaN check, the records' losses and the ``on_minibatch`` callbacks, in wave
order), brings the update to the host, runs the fault-drill hook and pushes; between operations it polls the client
for the reply to an outstanding pull and places its stages' slices on their devices, so the scheduler takes it
without waiting (:meth:`PSChannel.poll_pull`) and its install only adds the VW's own updates on the devices
(:meth:`PSChannel.take_placed`).

Where it runs (:meth:`hetpipe_jax.runtime.virtual_worker.VirtualWorker.ps_channel_mode`): HetPipe's per-minibatch
update with one PS and every stage in this process; stage ranks, sharded PS, PipeDream and the all-reduce methods
keep the inline path. An error on the channel thread (a NaN loss: FloatingPointError; a PS refusing an update:
BadUpdateError) stops it and is raised on the scheduler thread by its next call into the channel; the run's end
(:meth:`PSChannel.flush`) waits until every push sent has been made and its records written.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any

_STOP = object()


class PSChannel:
  """One VW's ordered PS operations on a thread of their own (module docstring).

  The object lives as long as its VW: a pull requested in one run and answered after its end is kept for the next
  run's :meth:`poll_pull` (as the inline path leaves it in the client); each run starts the thread (:meth:`start`)
  and flushes it (:meth:`flush`).

  Args:
    vw: the :class:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker` (its ``ps`` client, ``push_wave`` action and
      ``poll_interval_s``).

  Attributes:
    busy_s: seconds the channel thread spent executing operations and polling the client.
  """

  def __init__(self, vw: Any):
    self._vw = vw
    self._ops: queue.SimpleQueue = queue.SimpleQueue()
    self._replies: collections.deque = collections.deque()  # pull replies polled, not yet taken by the scheduler
    self._placed: dict[int, tuple] = {}  # id(reply's weights) -> (the weights, per stage its placed params or None)
    self._pull_outstanding = False
    self._error: BaseException | None = None
    self._thread: threading.Thread | None = None
    self.busy_s = 0.0

  @property
  def running(self) -> bool:
    return self._thread is not None

  def start(self) -> None:
    """Starts the channel thread (a run's start)."""
    if self._thread is not None:
      raise RuntimeError(f"[VW {self._vw.vw_id}] the PS channel is already running")
    self._error = None
    self._thread = threading.Thread(target=self._loop, name=f"ps-channel-vw{self._vw.vw_id}", daemon=True)
    self._thread.start()

  def push(self, wave_id: int, trees: list, wave_losses: list) -> None:
    """Sends wave ``wave_id``'s push: per stage its summed delta (device trees), and its ``(record, loss array)``
    pairs.

    Raises:
      BaseException: an earlier operation's error on the channel thread.
    """
    self._raise_error()
    self._ops.put(("push", wave_id, trees, wave_losses))

  def request_pull(self, required_clock: int) -> None:
    """Sends a pull request for the global weights at global clock >= ``required_clock``, after every push sent.

    Raises:
      BaseException: an earlier operation's error on the channel thread.
    """
    self._raise_error()
    self._ops.put(("pull", required_clock))

  def poll_pull(self):
    """Non-blocking: the client's next pull reply (as its ``poll_pull`` returned it), or None.

    Raises:
      BaseException: an operation's error on the channel thread.
    """
    self._raise_error()
    return self._replies.popleft() if self._replies else None

  def take_placed(self, flat) -> list | None:
    """Per stage, the params the channel placed on its device from a reply's weights ``flat`` (None for a stage
    not in this process), or None when it placed none for this array; each reply's are taken once."""
    entry = self._placed.pop(id(flat), None)
    return entry[1] if entry is not None and entry[0] is flat else None

  def flush(self) -> None:
    """Waits until every operation sent has been executed, then stops the thread (a run's end).

    Raises:
      BaseException: an operation's error on the channel thread.
    """
    self.stop()
    self._raise_error()

  def stop(self) -> None:
    """Stops the thread after the operations sent (a run's end, also on an error; never raises)."""
    if self._thread is None:
      return
    self._ops.put(_STOP)
    self._thread.join()
    self._thread = None

  def drop_pulls(self) -> None:
    """Forgets the outstanding pull and its reply (a segment's start: the checkpoint barrier's weights replaced
    them; the client dropped an unanswered one, ``drain_pull``). Only while the thread is stopped."""
    if self._thread is not None:
      raise RuntimeError(f"[VW {self._vw.vw_id}] the PS channel is running")
    self._replies.clear()
    self._placed.clear()
    self._pull_outstanding = False

  def _raise_error(self) -> None:
    if self._error is not None:
      raise self._error

  def _poll(self) -> None:
    reply = self._vw.ps.poll_pull()
    if reply is not None:
      self._pull_outstanding = False
      flat = reply[1]
      self._placed[id(flat)] = (flat, self._vw.place_pulled(flat))
      self._replies.append(reply)

  def _loop(self) -> None:
    vw = self._vw
    while True:
      try:
        op = self._ops.get(timeout=vw.poll_interval_s) if self._pull_outstanding else self._ops.get()
      except queue.Empty:
        op = None
      if op is _STOP:
        return
      t = time.perf_counter()
      try:
        if op is not None and op[0] == "push":
          vw.push_wave(op[1], op[2], op[3])
        elif op is not None:
          vw.ps.request_pull(op[1])
          self._pull_outstanding = True
        if self._pull_outstanding:
          self._poll()
      except BaseException as e:  # raised on the scheduler thread at its next call; later operations are dropped
        self._error = e
        while self._ops.get() is not _STOP:
          pass
        return
      finally:
        self.busy_s += time.perf_counter() - t
