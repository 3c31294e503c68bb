"""Stage ranks: a VW's stages on separate MPI ranks (one rank per GPU, or the VW's stages on one node in one rank).

Runtime layer. The VW's driver rank (``S + v``, running its first stage group) keeps the one
run loop (:func:`hetpipe_jax.runtime.vw_driver.run`) and every rule decision (``PipelineRules``,
``injection_step``, ``VWSyncState``); this module carries them to the stage ranks:

* **Tasks.** A remote stage's executor (:class:`hetpipe_jax.mpi.stage_client.RemoteStageExecutor`) sends its rank
  ``TASK`` ("start task X of minibatch p at version V", with the emulated duration) when the driver submits it, and
  the driver's listener thread posts the task's completion on the run's queue when the rank ``REPORT``\\ s it (its
  device times on the driver's clock; a last stage's loss). FIFO order per stage, Nm and WSP are decided once, by
  the driver.
* **Activations and gradients** go stage rank to stage rank (:class:`hetpipe_jax.mpi.stage_link.StageLink`): one
  int64 header (:func:`hetpipe_jax.mpi.wire.make_header`: kind, VW, minibatch, stage, weight version, size) then one
  contiguous numpy payload, non-blocking ``Isend`` / ``Irecv`` (nothing pickled). Receives are posted ahead (each
  stream carries minibatches 0, 1, ... in order: forwards and backwards run in minibatch order on every stage), so a
  send completes when the data is in its consumer's buffer, which is when the sending task completes (as in one
  process, where it waits for the ``device_put``). The receiver checks the header
  (:func:`hetpipe_jax.mpi.wire.check_header`); one that does not match is a ``ProtocolError`` naming both ranks.
* **Version changes** reach every stage rank as one in-order stream from the driver (``INJECT`` p at version V,
  ``UPDATE`` p → V+1, with p's global gradient norm when clipping, ``PULL_INSTALL`` → V+1: install the next pull,
  ``END_WAVE`` w). A stage rank applies them in that order
  (:class:`StageRankServer`), so its stages hold the driver's versions, and a task waits until its minibatch's
  version has been applied there (:class:`VersionStore`): one consistent weight version per minibatch on every stage.
* **Clipping by the global norm** (``grad_clip_norm`` > 0, :mod:`hetpipe_jax.runtime.grad_clip`): a stage rank
  reports the squared norm of each backward's parameter gradient with its completion; the driver adds every stage's
  for minibatch p when p completes (:meth:`RemoteStages.sq_norms`) and sends the norm with p's ``UPDATE``.
* **The PS, directly.** At ``END_WAVE`` w a stage rank pushes its stages' part of the wave to the shards holding
  those layers itself (:class:`hetpipe_jax.mpi.ps_client.StageRankPSClient`, parts by
  :class:`hetpipe_jax.ps.shards.VWParts`); a shard counts the VW's wave once every part arrived. The driver requests
  every pull (when, and at which clock: the WSP rules); each shard answers every rank holding some of its elements
  with its part and the driver with its part (possibly empty) and the shard's vector clock. The driver installs the
  pull when its own replies are in and sends ``PULL_INSTALL`` with, per shard, the VW's entry of that shard's vector
  clock; the rank takes the next reply from each of its shards (in request order), checks it holds the same entries,
  and rebases its stages (:func:`hetpipe_jax.ps.shards.rebase_on_shards`, the driver's rule) before it
  installs the new version. No weight or delta of a stage rank's layers passes through the driver.

A rank that dies ends the whole job: ``mpiexec`` (hydra) kills every rank when one exits abnormally, and an exception
on any rank aborts the world (``python -m mpi4py``), the same machinery as for VW ranks.

The wire (headers, kinds, the poll back-off) is :mod:`hetpipe_jax.mpi.wire`, the activation/gradient link
:mod:`hetpipe_jax.mpi.stage_link`, the driver's side (:class:`~hetpipe_jax.mpi.stage_client.RemoteStages`)
:mod:`hetpipe_jax.mpi.stage_client`; this module is a stage rank's side.
"""

from __future__ import annotations

import collections
import functools
import gc
import json
import queue
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from hetpipe_jax.mpi import wire
from hetpipe_jax.mpi.stage_link import TASK_CODES, TASK_KINDS
from hetpipe_jax.mpi.wire import CONTROL_KINDS, TAG_CONTROL, TAG_REPLY, TAG_REPORT, Kind, ProtocolError
from hetpipe_jax.ps.shards import rebase_on_shards
from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.runtime.stage_executor import Completion, StageExecutor, clock_pair, fine_timer_slack
from hetpipe_jax.runtime.vw_state import InFlightMinibatch


class VersionStore:
  """A stage rank's weight versions by id: installed in the driver's order, read by its stage executors.

  :meth:`get` waits until the version has been applied on this rank (a pull's weights still arriving, or the
  rank's main thread not there yet), so a task always runs on its minibatch's version.
  """

  def __init__(self, version: Any):
    self._cv = threading.Condition()
    self._versions = {version.version_id: version}
    self.latest = version.version_id
    self.num_waits = 0
    self.wait_s = 0.0
    self._error: BaseException | None = None

  def install(self, version: Any) -> None:
    with self._cv:
      self._versions[version.version_id] = version
      self.latest = version.version_id
      self._cv.notify_all()

  def get(self, version_id: int):
    """The version ``version_id``, once it has been installed.

    Raises:
      ProtocolError: it was installed and already dropped (no minibatch in flight held it).
      RuntimeError: the rank stopped while waiting (:meth:`fail`).
    """
    with self._cv:
      if version_id not in self._versions:
        t = time.perf_counter()
        self.num_waits += 1
        while version_id not in self._versions:
          if self._error is not None:
            raise RuntimeError(f"stopped while waiting for weight version {version_id}") from self._error
          if version_id <= self.latest:
            raise ProtocolError(f"weight version {version_id} was dropped (latest {self.latest}): a task asked for "
                                "a version no minibatch in flight holds")
          self._cv.wait(timeout=0.5)
        self.wait_s += time.perf_counter() - t
      return self._versions[version_id]

  def keep_only(self, version_ids: set[int]) -> None:
    """Drops every version except ``version_ids`` and the latest."""
    with self._cv:
      for v in [v for v in self._versions if v not in version_ids and v != self.latest]:
        del self._versions[v]

  def fail(self, error: BaseException) -> None:
    with self._cv:
      self._error = error
      self._cv.notify_all()

  def __len__(self) -> int:
    with self._cv:
      return len(self._versions)


class StageRankServer:
  """A stage rank: runs its stages' tasks as the driver commands and applies the driver's version changes in order.

  Args:
    comm: the MPI communicator.
    vw: a :class:`hetpipe_jax.runtime.virtual_worker.VirtualWorker` whose ``link`` makes only this rank's stages
      local (its actions run them: dispatch, the update, the rebase).
    driver_rank: the VW's driver.
    labels_template: an example of one minibatch's labels (shape and dtype; used on the last stage's rank).
    ps: this rank's :class:`hetpipe_jax.mpi.ps_client.StageRankPSClient` (or an object with its ``push``,
      ``poll_pull`` and ``finish``) over :meth:`local_index_of` ``vw``: its parts of every wave to their shards, its
      parts of every pull from them.
    shard_index: per PS shard, its flat element indices (:attr:`hetpipe_jax.ps.shards.ShardLayout.index`).
  """

  def __init__(self, comm, vw: Any, driver_rank: int, labels_template: np.ndarray, ps: Any, shard_index: Sequence):
    self.comm = comm
    self.ps = ps
    self.local_index = self.local_index_of(vw)
    self.shard_index = [np.flatnonzero(np.isin(self.local_index, idx)) for idx in shard_index]  # local positions
    self.own_flat: dict[int, np.ndarray] = {}  # wave -> this rank's pushed update (its elements)
    self.pull_reply = None  # the next pull's parts, once every shard's arrived
    self.num_pulls = 0  # pulls the driver requested (its STOP)
    self.vw = vw
    self.vw_id = vw.vw_id
    self.rank = comm.Get_rank()
    self.driver = driver_rank
    self.local = list(vw.local_stages)
    self.holds_last = len(vw.stages) - 1 in self.local
    self.labels_template = np.asarray(labels_template)
    self.store = VersionStore(vw.version)
    self.announced = vw.version.version_id  # the version the stream has declared so far
    self.inflight: dict[int, Any] = {}  # minibatch -> InFlightMinibatch
    self.versions: dict[int, int] = {}  # minibatch -> its version id
    self.events: collections.deque = collections.deque()  # version changes and wave ends, applied in order
    self.executors: dict[int, StageExecutor] = {}
    self.errors: queue.SimpleQueue = queue.SimpleQueue()  # an executor's failure, raised by the main loop
    self._lock = threading.Lock()  # sends and counts (the executors report their own completions)
    self._sends: list = []
    self.num_submitted = self.num_reported = 0
    self.stopping = False

  def _send(self, kind: Kind, tag: int, payload: np.ndarray | None = None, **fields: int) -> None:
    size = 0 if payload is None else int(payload.size)
    header = wire.make_header(kind, self.vw_id, size=size, **fields)
    with self._lock:
      self._sends.append((self.comm.Isend(header, dest=self.driver, tag=tag), header))
      if size:
        payload = np.ascontiguousarray(payload)
        self._sends.append((self.comm.Isend(payload, dest=self.driver, tag=tag), payload))
      # test at once: MPI progresses the sends now, not when the main loop next polls
      self._sends = [(r, b) for r, b in self._sends if not r.Test()]

  def put(self, c: Completion) -> None:
    """An executor's completion (called on its thread: the report leaves at once, without waking the main loop)."""
    if c.error is not None:
      self.errors.put(c.error)
      return
    self._report(c)

  def serve(self, last: bool = True) -> dict:
    """Runs until the driver's STOP; returns this rank's report of the run (also sent to the driver).

    Args:
      last: the job's last run on this rank: the link's receives posted beyond it are cancelled. False: a checkpoint
        segment's (:mod:`hetpipe_jax.jobs.resume`): the link carries on into the next segment's server.
    """
    control = collections.deque()  # received control messages: (header, payload request or None, payload)
    pending = self._post_header()
    fine_timer_slack()
    backoff = wire.Backoff()
    try:
      while not (self.stopping and not control and not self.events and self.num_reported == self.num_submitted):
        progressed = False
        while pending[0].Test():  # control headers, in order; a payload's receive is posted before the next header's
          h = wire.check_header(pending[1], source=self.driver, dest=self.rank, kinds=CONTROL_KINDS, vw=self.vw_id)
          request = payload = None
          if h.size:
            payload = self._payload_buffer(h.kind, h.size)
            request = self.comm.Irecv(payload, source=self.driver, tag=TAG_CONTROL)
          control.append((h, request, payload))
          pending = self._post_header()
          progressed = True
        while control:
          h, request, payload = control[0]
          if h.kind is not Kind.PULL_INSTALL and request is not None and not request.Test():
            break  # a small payload (labels, the start) still arriving
          control.popleft()
          self._on_control(h, request, payload)
          progressed = True
        while self.events and self._apply(self.events[0]):
          self.events.popleft()
          progressed = True
        if not self.errors.empty():
          raise self.errors.get()
        if progressed:
          backoff.reset()
        else:
          backoff.wait()
    except BaseException as e:
      self.store.fail(e)
      raise
    finally:
      for ex in self.executors.values():
        ex.close()
      gc.unfreeze()
    pending[0].Cancel()
    pending[0].Wait()
    self.ps.finish(self.num_pulls)
    report = {"rank": self.rank, "stages": self.local,
              "trace_counts": {str(s): dict(self.vw.stages[s].trace_counts) for s in self.local},
              "version_waits": self.store.num_waits, "version_wait_s": self.store.wait_s,
              "tasks": self.num_reported}
    self._send(Kind.STOPPED, TAG_REPLY, np.frombuffer(json.dumps(report).encode(), np.uint8).copy())
    wire.wait_all([r for r, _ in self._sends])
    if last:
      self.vw.placement.link.close()
    return report

  def _post_header(self) -> tuple:
    header = np.empty(wire.HEADER_SIZE, np.int64)
    return self.comm.Irecv(header, source=self.driver, tag=TAG_CONTROL), header

  def _payload_buffer(self, kind: Kind, size: int) -> np.ndarray:
    if kind is Kind.START:
      return np.empty(size, np.float64)
    if kind is Kind.INJECT:
      if not self.holds_last or size != self.labels_template.size:
        raise ProtocolError(f"rank {self.rank} (stages {self.local}) received labels of {size} elements from rank "
                            f"{self.driver}; expected {self.labels_template.size if self.holds_last else 'none'}")
      return np.empty(size, np.int32)
    if kind is Kind.UPDATE:
      if size != 1 or not self.vw.grad_clip_norm:
        raise ProtocolError(f"rank {self.rank} received an UPDATE with a payload of {size} from rank {self.driver}; "
                            f"expected {1 if self.vw.grad_clip_norm else 'none'} (the global gradient norm when "
                            "clipping)")
      return np.empty(size, np.float64)
    if kind is Kind.PULL_INSTALL:
      if size != len(self.shard_index):
        raise ProtocolError(f"rank {self.rank} received a PULL_INSTALL naming {size} shards from rank {self.driver}; "
                            f"there are {len(self.shard_index)}")
      return np.empty(size, np.int64)
    raise ProtocolError(f"rank {self.rank} received a {kind.name} with a payload of {size} from rank {self.driver}")

  def _on_control(self, h: wire.Header, request, payload) -> None:
    kind, minibatch, stage, version, arg0, arg1 = h.kind, h.minibatch, h.stage, h.version, h.arg0, h.arg1
    if kind is Kind.START:
      start_unix_s = float(payload[0])
      now, now_unix_s = clock_pair()
      t0 = now - (now_unix_s - start_unix_s)  # the driver's run clock
      gc.freeze()
      self.executors = {s: StageExecutor(s, self, t0) for s in self.local}  # completions: :meth:`put`
    elif kind is Kind.INJECT:
      if version != self.announced:
        raise ProtocolError(f"rank {self.rank}: minibatch {minibatch} injected at version {version} by rank "
                            f"{self.driver}, but its version stream is at {self.announced}")
      labels = None
      if self.holds_last:
        labels = jax.device_put(payload.reshape(self.labels_template.shape).astype(self.labels_template.dtype),
                                self.vw.stages[-1].device)
      self.inflight[minibatch] = InFlightMinibatch(None, None, labels, {}, {}, {}, {})
      self.versions[minibatch] = version
    elif kind is Kind.TASK:
      if minibatch not in self.inflight or version != self.versions[minibatch] or stage not in self.executors:
        raise ProtocolError(f"rank {self.rank} (stages {self.local}) got task {stage}{TASK_KINDS[arg0].value}"
                            f"{minibatch} at version {version} from rank {self.driver}; minibatch known: "
                            f"{minibatch in self.inflight}, at version {self.versions.get(minibatch)}")
      task = Task(stage, TASK_KINDS[arg0], minibatch)
      mb = self.inflight[minibatch]
      self.executors[stage].submit(task, functools.partial(self._run_task, task, mb, version),
                                   None if arg1 < 0 else arg1 / 1e9)
      self.num_submitted += 1
    elif kind in (Kind.UPDATE, Kind.PULL_INSTALL):
      if version != self.announced + 1:
        raise ProtocolError(f"rank {self.rank}: {kind.name} to version {version} from rank {self.driver}, but the "
                            f"stream's last version is {self.announced}")
      self.announced = version
      self.events.append((kind, minibatch, version, request, payload))
    elif kind is Kind.END_WAVE:
      self.events.append((kind, h.wave, version, None, None))
    else:  # STOP
      self.stopping = True
      self.num_pulls = arg0

  def _run_task(self, task: Task, mb: Any, version_id: int):
    """On the stage's executor thread: waits for the minibatch's version on this rank, then runs the task."""
    mb.version = self.store.get(version_id)
    return self.vw.dispatch(task, mb)

  def _apply(self, event: tuple) -> bool:
    """Applies the oldest version change; False when it cannot be applied yet (its payload still arriving)."""
    kind, minibatch, version, request, payload = event
    if kind is Kind.UPDATE:
      mb = self.inflight[minibatch]
      if any(s not in mb.grads for s in self.local):
        return False  # the backward's parameter gradients (kept before its input gradient left) not there yet
      if self.vw.grad_clip_norm and payload is None:
        raise ProtocolError(f"rank {self.rank}: the UPDATE of minibatch {minibatch} from rank {self.driver} carries "
                            "no global gradient norm, and this rank clips by it")
      self.vw.update.apply_update(mb, None if payload is None else float(payload[0]))
      del self.inflight[minibatch], self.versions[minibatch]
    elif kind is Kind.PULL_INSTALL:
      if self.pull_reply is None:
        self.pull_reply = self.ps.poll_pull()
      if self.pull_reply is None or not request.Test():
        return False  # a shard's part, or the driver's command, still arriving
      self._install_pull(self.pull_reply, payload)
      self.pull_reply = None
    else:  # END_WAVE: this rank's part of the wave, straight to its shards
      delta = self.vw.update.take_wave_delta()
      self.own_flat[minibatch] = delta
      self.ps.push(minibatch, delta)
      return True
    if self.vw.version.version_id != version:
      raise ProtocolError(f"rank {self.rank}: applying {kind.name} made version {self.vw.version.version_id}, the "
                          f"driver (rank {self.driver}) made {version}")
    self.store.install(self.vw.version)
    self.store.keep_only(set(self.versions.values()))
    return True

  @staticmethod
  def local_index_of(vw: Any) -> np.ndarray:
    """int64: the flat indices of ``vw``'s local stages' elements, ascending (the order of
    :meth:`~hetpipe_jax.runtime.minibatch_update.PerMinibatchUpdate.take_wave_delta` and ``install_rebased``)."""
    offsets = vw.layout.layer_offsets
    return np.concatenate([np.arange(offsets[vw.stages[s].layer_range[0]], offsets[vw.stages[s].layer_range[1]],
                                     dtype=np.int64) for s in vw.local_stages] or [np.zeros(0, np.int64)])

  def _install_pull(self, reply: tuple, own_applied: np.ndarray) -> None:
    """Rebases this rank's stages on its parts of the pull the driver installs now (the same own-wave rule as the
    driver's, :func:`hetpipe_jax.ps.shards.rebase_on_shards`), then adds the partial wave."""
    clocks, flat = reply
    for shard, vc in clocks.items():
      if vc[self.vw_id] != int(own_applied[shard]):
        raise ProtocolError(f"rank {self.rank}: shard {shard}'s reply holds {vc[self.vw_id]} of VW {self.vw_id}'s "
                            f"waves, but the pull the driver (rank {self.driver}) installs holds "
                            f"{int(own_applied[shard])}")
    local, self.own_flat = rebase_on_shards(flat, self.own_flat, [int(c) for c in own_applied], self.shard_index)
    self.vw.update.install_rebased(local)

  def _report(self, c: Completion) -> None:
    loss = sq_norm = float("nan")
    if c.task.kind is TaskKind.FORWARD_BACKWARD:
      loss = float(jax.device_get(self.inflight[c.task.minibatch_id].loss))
    if self.vw.grad_clip_norm and c.task.kind is not TaskKind.FORWARD:  # the driver waits for it to update p
      s = c.task.stage_id
      sq_norm = float(jax.device_get(self.vw.stages[s].sq_norm(self.inflight[c.task.minibatch_id].grads[s])))
    payload = np.array([c.start_s, c.end_s, c.overrun_s, c.dispatch_s, c.submit_s, c.device_end_s, loss, sq_norm],
                       np.float64)
    self._send(Kind.REPORT, TAG_REPORT, payload, minibatch=c.task.minibatch_id, stage=c.task.stage_id,
               arg0=TASK_CODES[c.task.kind])
    with self._lock:
      self.num_reported += 1
