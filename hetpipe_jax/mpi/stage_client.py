"""The driver's side of its VW's stage ranks: remote stages' executors, the version-change stream and the listener
of their completion reports (the protocol: :mod:`hetpipe_jax.mpi.stage_server`).

Runtime layer. The driver keeps the run loop and every rule decision; :class:`RemoteStages` sends each stage rank its
tasks and the VW's version changes (:mod:`hetpipe_jax.mpi.wire`'s control kinds, in order on ``TAG_CONTROL``) and
posts the ranks' completions on the run's queue.
"""

from __future__ import annotations

import collections
import json
import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np

from hetpipe_jax.mpi import wire
from hetpipe_jax.mpi.stage_link import RECEIVES_AHEAD, REPORT_SIZE, TASK_CODES, TASK_KINDS, PostedReceive, StageLink
from hetpipe_jax.mpi.wire import TAG_CONTROL, TAG_REPLY, TAG_REPORT, Kind
from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.runtime.stage_executor import Completion, fine_timer_slack


class RemoteStageExecutor:
  """The driver's executor of a stage that runs on another rank: submitting a task sends the rank its command
  (``dispatch``, :meth:`VirtualWorker.dispatch` of a remote stage's task, does), on the thread that started the
  task (the scheduler's, or a local executor's that booked a completion: :meth:`RemoteStages._control` sends each
  message whole); the completion arrives through :class:`RemoteStages`' listener."""

  def __init__(self, stage_id: int):
    self.stage_id = stage_id

  def submit(self, task: Task, dispatch: Callable[[], Any], duration_s: float | None = None) -> None:
    del task, duration_s  # the command carries the emulated duration (dispatch computes it)
    dispatch()

  def close(self) -> None:
    pass


class RemoteStages:
  """The driver's side of its VW's stage ranks: their executors and the version-change stream (the ranks push and
  pull their own parts at the PS).

  Args:
    comm: the MPI communicator.
    vw_id: the VW.
    link: this rank's :class:`StageLink` (it knows which stages are local).
  """

  def __init__(self, comm, vw_id: int, link: StageLink):
    self.comm = comm
    self.vw_id = vw_id
    self.link = link
    self.rank = comm.Get_rank()
    self.stage_ranks = link.stage_ranks
    self.followers = sorted(set(self.stage_ranks) - {self.rank})
    self._sends: list = []
    # The control stream is sent from the scheduler's thread (inject, update, pull, wave end) and from the local
    # executors' threads (a completion booked there starts a remote stage's task): one message (header, then its
    # payload) leaves whole, or a rank would take another message's header as a payload (MPI's truncation error).
    self._send_lock = threading.Lock()
    self._done: queue.SimpleQueue | None = None
    self._t0 = 0.0
    self._stop = threading.Event()
    self._listener: threading.Thread | None = None
    self._reports: dict[int, collections.deque] = {}
    self.num_reports = 0
    # Clipping by the global norm: (minibatch, stage) -> the squared norm of a remote stage's gradient, as its rank
    # reported it with the backward's completion (the listener thread writes, the scheduler's reads: sq_norms).
    self._sq_norms: dict[tuple[int, int], float] = {}
    self._sq_norms_cv = threading.Condition()
    self._listener_error: BaseException | None = None

  def is_local(self, stage: int) -> bool:
    return self.link.is_local(stage)

  def executor(self, stage: int) -> RemoteStageExecutor:
    return RemoteStageExecutor(stage)

  # -- the control stream
  def _control(self, rank: int, kind: Kind, payload: np.ndarray | None = None, **fields: int) -> None:
    size = 0 if payload is None else int(payload.size)
    header = wire.make_header(kind, self.vw_id, size=size, **fields)
    if size:
      payload = np.ascontiguousarray(payload)
    with self._send_lock:
      self._sends.append((self.comm.Isend(header, dest=rank, tag=TAG_CONTROL), header))
      if size:
        self._sends.append((self.comm.Isend(payload, dest=rank, tag=TAG_CONTROL), payload))
      self._sends = [(r, b) for r, b in self._sends if not r.Test()]  # progresses them now

  def begin_run(self, done: queue.SimpleQueue, t0: float, start_unix_s: float, num_minibatches: int) -> None:
    """Tells every stage rank the run's start (their executors share the driver's clock) and starts listening for
    their completions, posted on ``done``."""
    if self._listener is not None:
      raise RuntimeError("a run of the stage ranks is under way: stop it first (RemoteStages.stop)")
    self._done, self._t0 = done, t0
    for r in self.followers:
      self._control(r, Kind.START, np.array([start_unix_s], np.float64), minibatch=num_minibatches)
      self._reports[r] = collections.deque(
          PostedReceive(self.comm, r, TAG_REPORT, i, (REPORT_SIZE,), np.float64) for i in range(RECEIVES_AHEAD))
    self._listener = threading.Thread(target=self._listen, name=f"vw{self.vw_id}-stage-reports", daemon=True)
    self._listener.start()

  def on_inject(self, minibatch: int, version_id: int, labels: np.ndarray) -> None:
    last = self.stage_ranks[-1]
    for r in self.followers:
      self._control(r, Kind.INJECT, np.asarray(labels, np.int32) if r == last else None, minibatch=minibatch,
                    version=version_id)

  def start_task(self, task: Task, version_id: int, duration_s: float | None) -> None:
    ns = -1 if duration_s is None else int(round(duration_s * 1e9))
    self._control(self.stage_ranks[task.stage_id], Kind.TASK, minibatch=task.minibatch_id, stage=task.stage_id,
                  version=version_id, arg0=TASK_CODES[task.kind], arg1=ns)

  def on_update(self, minibatch: int, version_id: int, norm: float | None = None) -> None:
    """Tells every stage rank to apply minibatch ``minibatch``'s update as version ``version_id``; ``norm``: its
    global gradient norm when clipping (sent as the payload), else None."""
    payload = None if norm is None else np.array([norm], np.float64)
    for r in self.followers:
      self._control(r, Kind.UPDATE, payload, minibatch=minibatch, version=version_id)

  def sq_norms(self, minibatch: int, stages: Sequence[int]) -> list[float]:
    """The squared gradient norms of ``stages`` (remote) for ``minibatch``, as their ranks reported them with their
    backwards' completions; waits for reports still on their way (a stage's backward of p ends before stage 0's).

    Raises:
      RuntimeError: the listener failed while waiting.
    """
    keys = [(minibatch, s) for s in stages]
    with self._sq_norms_cv:
      while not all(k in self._sq_norms for k in keys):
        if self._listener_error is not None:
          raise RuntimeError("the stage ranks' report listener failed") from self._listener_error
        self._sq_norms_cv.wait(timeout=0.5)
      return [self._sq_norms.pop(k) for k in keys]

  def on_pull(self, version_id: int, own_applied: Sequence[int]) -> None:
    """Tells every stage rank to install the next pull (the one the driver installs now) as version ``version_id``.

    The ranks received their parts of it from the shards themselves (:class:`~hetpipe_jax.mpi.ps_client.
    StageRankPSClient`); the command carries, per shard, how many of the VW's own waves its slice holds (the driver's
    copy of the shards' vector clocks), which each rank checks against the replies it holds before rebasing.
    """
    payload = np.asarray(own_applied, np.int64)
    for r in self.followers:
      self._control(r, Kind.PULL_INSTALL, payload, version=version_id)

  def end_wave(self, wave: int) -> None:
    """Ends wave ``wave`` on every stage rank: each pushes its stages' wave delta to their shards itself."""
    for r in self.followers:
      self._control(r, Kind.END_WAVE, wave=wave)

  def stop(self, num_pulls: int = 0, last: bool = True) -> dict[int, dict]:
    """Stops every stage rank; returns each one's report of the run (rank -> its JSON).

    Args:
      num_pulls: pulls the driver requested in the job so far (each rank takes the replies of those it never
        installed).
      last: the job's last run: the link's receives posted beyond it are cancelled. False: a checkpoint segment's
        end; the next :meth:`begin_run` starts the next segment over the same link.
    """
    for r in self.followers:
      self._control(r, Kind.STOP, arg0=num_pulls)
    reports = {}
    for r in self.followers:
      header = np.empty(wire.HEADER_SIZE, np.int64)
      wire.wait_all([self.comm.Irecv(header, source=r, tag=TAG_REPLY)])
      size = wire.check_header(header, source=r, dest=self.rank, kinds=(Kind.STOPPED,), vw=self.vw_id).size
      payload = np.empty(size, np.uint8)
      wire.wait_all([self.comm.Irecv(payload, source=r, tag=TAG_REPLY)])
      reports[r] = json.loads(payload.tobytes().decode())
    self._stop.set()
    if self._listener is not None:
      self._listener.join()
    for posted in self._reports.values():
      for p in posted:
        for request in (p.header_request, p.payload_request):
          request.Cancel()
          request.Wait()
    with self._send_lock:
      wire.wait_all([r for r, _ in self._sends])
      self._sends = []
    if last:
      self.link.close()
    else:
      self._stop.clear()
      self._listener, self._reports, self._done = None, {}, None
    return reports

  def _listen(self) -> None:
    """The listener thread: each stage rank's completion reports, in its order, posted on the run's queue."""
    fine_timer_slack()
    backoff = wire.Backoff()
    try:
      while not self._stop.is_set():
        got = False
        for r, posted in self._reports.items():
          while posted and posted[0].header_request.Test():
            p = posted.popleft()
            h = wire.check_header(p.header, source=r, dest=self.rank, kinds=(Kind.REPORT,), vw=self.vw_id,
                                  size=REPORT_SIZE)
            wire.wait_all([p.payload_request])
            posted.append(PostedReceive(self.comm, r, TAG_REPORT, p.index + RECEIVES_AHEAD, (REPORT_SIZE,), np.float64))
            minibatch, stage, code = h.minibatch, h.stage, h.arg0
            start, end, overrun, dispatch, submit, device_end, loss, sq_norm = (float(x) for x in p.payload)
            if not np.isnan(sq_norm):  # clipping: this backward's part of its minibatch's squared norm
              with self._sq_norms_cv:
                self._sq_norms[(minibatch, stage)] = sq_norm
                self._sq_norms_cv.notify_all()
            self._done.put(Completion(Task(stage, TASK_KINDS[code], minibatch), start, end, overrun,
                                      dispatch_s=dispatch, submit_s=submit, device_end_s=device_end,
                                      loss=None if np.isnan(loss) else loss))
            self.num_reports += 1
            got = True
        if got:
          backoff.reset()
        else:
          backoff.wait()
    except BaseException as e:  # pylint: disable=broad-except
      with self._sq_norms_cv:
        self._listener_error = e
        self._sq_norms_cv.notify_all()
      # the scheduler re-raises it (as a failed task of stage -1)
      self._done.put(Completion(Task(-1, TaskKind.FORWARD, -1), 0.0, 0.0, error=e))
