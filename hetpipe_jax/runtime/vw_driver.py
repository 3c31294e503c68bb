"""The driver of a virtual worker's run: the MPI runtime's event loop (HetPipe §4–§5).

Runtime layer. :func:`run` makes every rule decision of a run through the pure rules (:mod:`hetpipe_jax.rules.schedule`:
per-stage FIFO ready queues, forwards and backwards in order, Nm in flight; :mod:`hetpipe_jax.rules.wsp`: the local
and WSP injection bounds, wave ends, pulls) and is the one caller of the VW's :class:`~hetpipe_jax.rules.wsp.
VWSyncState` transitions during it. It hands ready tasks to the stages' in-order executors
(:mod:`hetpipe_jax.runtime.stage_executor`) and calls the VW's actions (:class:`~hetpipe_jax.runtime.virtual_worker.
VirtualWorker`: ``inject``, ``dispatch``, ``complete_minibatch``, ``end_wave``, ``install_pull``) to carry the
decisions out on real tensors. In virtual time the event engine is the driver instead
(:mod:`hetpipe_jax.runtime.virtual_time`).

Threads: the local stages' executors book a completion that does not end its minibatch on their own thread (under the
run's lock) and start the tasks it made ready; a minibatch's last task comes to this thread, which books it and applies
the update together (the local staleness rule). Remote stages' completions (stage ranks) come through the queue. The
VW's PS channel thread (:mod:`hetpipe_jax.runtime.ps_channel`, where the VW has one) makes its pushes and pull
requests in the order this thread sends them and polls the replies, which this thread installs; the run returns
once the channel has made every push.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import queue
import threading
import time
import types
from typing import Any

import jax

from hetpipe_jax.rules import methods
from hetpipe_jax.rules import schedule
from hetpipe_jax.rules import wsp
from hetpipe_jax.runtime.stage_executor import OVERRUN_TOLERANCE_S, StageExecutor, clock_pair
from hetpipe_jax.runtime.vw_state import InFlightMinibatch, VWStats


def run(vw: Any, num_minibatches: int, *, completion_log: list | None = None) -> VWStats:
  """Trains VW ``vw``'s ``num_minibatches`` (a multiple of Nm, so every wave is whole) and returns its stats.

  Each loop iteration takes the posted completions off the queue, hands the tasks they made ready to the stage
  executors, and only then applies the completed minibatches' updates, pushes wave ends and injects: the updates
  (on the CPU backend they compute inline, in this thread) never delay a ready task, and a new minibatch still
  starts on the weights that include every completed minibatch. The garbage collector leaves the objects created
  before the run alone until it returns (``gc.freeze``), so its collections stay short.

  Args:
    vw: the :class:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker` (its actions carry the decisions out).
    num_minibatches: minibatches to train.
    completion_log: instrumentation (benchmarks): when given, ``(completion, received_s, woke)`` is appended for
      every task: its :class:`~hetpipe_jax.runtime.stage_executor.Completion`, when this thread took it off the
      queue (seconds since the run's start), and whether it woke this thread from waiting (else it had been
      queued while this thread was busy).

  Raises:
    ValueError: ``num_minibatches`` is not a positive multiple of Nm.
    FloatingPointError: a loss is NaN or Inf.
  """
  if num_minibatches <= 0 or num_minibatches % vw.num_inflight:
    raise ValueError(f"num_minibatches={num_minibatches} must be a positive multiple of num_inflight="
                     f"{vw.num_inflight} (whole waves)")
  num_stages = len(vw.stages)
  rules = schedule.PipelineRules(num_stages, vw.num_inflight,
                                 methods.stage_order(vw.method, num_stages, vw.num_inflight, num_minibatches),
                                 max_held=vw.max_held)
  inflight: dict[int, InFlightMinibatch] = {}
  done: queue.SimpleQueue = queue.SimpleQueue()  # to this thread: minibatch ends, remote completions, errors
  # The rules, ``inflight`` and ``num_running`` are shared by this thread and the local stages' executors, which
  # book their own completions (see ``post``): every access to them holds this lock.
  lock = threading.Lock()
  stats = vw.stats
  # The objects that exist before the run (modules, compiled functions, data: over 100,000) stay out of the
  # collections during it: a full collection over them holds the GIL, so it stops every stage thread, for
  # 0.1-0.3 s on this machine (scripts/bench_runtime.py reports the collections during its runs).
  gc.freeze()
  t0, stats.start_unix_s = clock_pair()  # the run's clock, which stage ranks share
  # The VW's PS operations: through its PS channel thread (pushes and pulls off this thread, in order;
  # hetpipe_jax.runtime.ps_channel) where it has one, else the client, inline.
  channel = vw.ps_channel
  ps = channel if channel is not None else vw.ps
  stats.ps_channel = vw.ps_channel_mode
  busy0 = channel.busy_s if channel is not None else 0.0
  vw.placement.begin_run(done, t0, stats.start_unix_s, num_minibatches)  # stage ranks: on the same clock
  num_running = 0
  num_finished = 0  # minibatches whose completion this thread has processed (update, wave end)
  first = None
  wait_since = idle_since = None

  def submit_ready() -> None:
    """Hands every ready task to its stage's executor, FIFO per stage (caller holds ``lock``). A stage stops at a
    task whose minibatch is injected but not yet placed on the devices (this thread is still reading it)."""
    nonlocal num_running
    for s in range(num_stages):
      while True:
        task = rules.peek_ready(s)
        if task is None:
          break
        mb = inflight.get(task.minibatch_id)
        if mb is None:
          break
        rules.pop_ready(s)
        duration = vw.task_time_s(task) if vw.task_time_s is not None else None
        executors[s].submit(task, functools.partial(vw.dispatch, task, mb), duration)
        num_running += 1

  def book(c, woke: bool) -> bool:
    """Books completion ``c`` in the rules, logs and stats (caller holds ``lock``); True when it completes its
    minibatch (this thread then applies the update)."""
    nonlocal num_running
    if completion_log is not None:
      completion_log.append((c, time.perf_counter() - t0, woke))
    num_running -= 1
    if c.loss is not None:  # a remote last stage's loss, reported with its FB task
      inflight[c.task.minibatch_id].loss = c.loss
    vw.task_log.append((str(c.task), c.start_s, c.device_end_s))
    if c.overrun_s > OVERRUN_TOLERANCE_S:
      stats.num_overruns += 1
      stats.overrun_s += c.overrun_s
    rules.complete(c.task)
    stats.num_tasks += 1
    stats.dispatch_s += c.dispatch_s
    return schedule.completes_minibatch(c.task)

  # Per stage, its completions posted to this thread and not yet booked: a stage's completions are booked in its
  # order, so while one waits here the stage's later ones follow it.
  routed = [0] * num_stages

  def post(c) -> None:
    """Where the local stages' executors post completions: a task that does not complete its minibatch is booked
    on the executor's own thread, which then starts the tasks it made ready, so a cross-stage hop wakes one thread
    (the next stage's executor), not two (this scheduler thread, then the executor). A minibatch's last task
    goes to ``done``: this thread books it and applies the update together, so the rules never count a minibatch
    complete before its update is in the weights that new minibatches start on (the local staleness rule); the
    stage's next completions follow it there until it is booked."""
    if c.error is None:
      try:
        with lock:
          s = c.task.stage_id
          if not routed[s] and not schedule.completes_minibatch(c.task):
            t = time.perf_counter()
            book(c, False)
            submit_ready()
            stats.executor_book_s += time.perf_counter() - t
            return
          routed[s] += 1
      except BaseException as e:  # a broken rule: reported to the scheduler thread, which re-raises it
        c = dataclasses.replace(c, error=e)
    done.put(c)

  posted = types.SimpleNamespace(put=post)  # an executor's completion queue
  executors = [vw.placement.executor(s, functools.partial(StageExecutor, s, posted, t0)) for s in range(num_stages)]

  try:
    if channel is not None:
      channel.start()
    with jax.transfer_guard("disallow"):
      while num_finished < num_minibatches:
        loop_start = time.perf_counter()
        # 1. PS replies (no PS under all-reduce BSP).
        reply = ps.poll_pull() if ps is not None else None
        if reply is not None:
          t = time.perf_counter()
          vw.sync.on_pull_reply(wsp.global_clock_of(reply[0]))
          vw.install_pull(*reply)
          stats.sync_s += time.perf_counter() - t
        # 2. Completions posted here: minibatch ends, remote stages' completions (each stage reports in its own
        # order; the queue keeps completion order).
        finished = []
        taken = False
        while True:
          woke = first is not None
          if woke:
            c, first = first, None
          else:
            try:
              c = done.get_nowait()
            except queue.Empty:
              break
          if c.error is not None:
            raise c.error
          with lock:
            if routed[c.task.stage_id]:  # a local stage's (remote stages' completions all come this way)
              routed[c.task.stage_id] -= 1
            if book(c, woke):
              finished.append(c)
          taken = True
        # 3. The tasks those completions made ready start now, before the updates below.
        if taken:
          with lock:
            submit_ready()
        # 4. Completed minibatches: every stage's update (a new weight version), wave ends and their pulls.
        if finished:
          t = time.perf_counter()
          for c in finished:
            p = c.task.minibatch_id
            with lock:
              mb = inflight.pop(p)
            vw.complete_minibatch(mb, c.end_s)
            num_finished += 1
            wave, pull = vw.sync.on_minibatch_complete(p)
            if wave is not None:
              t_wave = time.perf_counter()
              if vw.end_wave(wave):
                vw.sync.on_reduced(wave)  # the all-reduce is a blocking collective: the update is applied
              stats.push_s += time.perf_counter() - t_wave
            if pull is not None:
              ps.request_pull(pull)
          stats.update_s += time.perf_counter() - t
        # 5. Injection under the local rule and WSP (on the weights that include every completed minibatch); each
        # minibatch's first task starts as soon as its data is placed, before the next one is read.
        with lock:
          injected, pull, waiting = wsp.injection_step(rules, vw.sync, num_minibatches)
        if pull is not None:
          ps.request_pull(pull)
        if waiting:
          if wait_since is None:
            wait_since = time.perf_counter()
        elif injected and wait_since is not None:
          stats.wait_s += time.perf_counter() - wait_since
          wait_since = None
        for p in injected:
          t = time.perf_counter()
          mb = vw.inject(p, t - t0)
          stats.inject_s += time.perf_counter() - t
          with lock:
            inflight[p] = mb
            submit_ready()
        stats.max_concurrent_tasks = max(stats.max_concurrent_tasks, num_running)
        # 6. Idle accounting, then block until a minibatch completes (or time out to poll the PS).
        if not num_running:
          if idle_since is None:
            idle_since = time.perf_counter()
        elif idle_since is not None:
          stats.idle_s += time.perf_counter() - idle_since
          idle_since = None
        # 7. Read the next minibatch ahead while waiting (off the path from a completion to the next injection).
        if rules.num_injected < num_minibatches:
          t = time.perf_counter()
          vw.prefetch(rules.num_injected)
          stats.inject_s += time.perf_counter() - t
        stats.host_busy_s += time.perf_counter() - loop_start
        if num_finished < num_minibatches:
          try:
            first = done.get(timeout=vw.poll_interval_s)  # processed first in the next iteration
          except queue.Empty:
            pass
    if idle_since is not None:
      stats.idle_s += time.perf_counter() - idle_since
    if channel is not None:  # every push sent is made and its records written before the run returns
      channel.flush()
  finally:
    for ex in executors:
      ex.close()
    if channel is not None:
      channel.stop()
      stats.ps_channel_s += channel.busy_s - busy0
    gc.unfreeze()
  stats.wall_time_s = time.perf_counter() - t0
  stats.peak_inflight_per_stage = list(rules.peak_held)
  return stats

