"""Virtual-time training: the event engine's schedule with every task's real JAX computation (HetPipe on any cluster).

Runtime layer. The engine (:mod:`hetpipe_jax.sim.engine`) decides, from the cost model's task durations, when each
task of each VW starts, when minibatches complete, when pushes reach the PS and when pull replies arrive; its hooks
run the real numerics of :class:`hetpipe_jax.runtime.virtual_worker.VirtualWorker` in that order, in one process,
with an in-process :class:`hetpipe_jax.ps.param_server.ParameterServer`. So a convergence study of a 16-GPU
heterogeneous cluster runs on one CPU machine: real weights, simulated seconds. Emulated GPUs are mapped onto the
local devices round-robin (placement does not change the numerics).

One WSP state per VW: the engine is handed each VirtualWorker's own ``sync``
(:class:`hetpipe_jax.rules.wsp.VWSyncState`) and is its only driver: it decides injections (``wsp.injection_step``),
wave ends and pulls and advances the state once; the hooks only carry out those decisions with the VirtualWorker's
actions (``inject``, ``dispatch``, ``complete_minibatch``, ``end_wave``, ``install_pull``), which never advance the
state (they read ``local_clock`` for the records). Pull requests are the engine's too, so the VWs' PS client never
sees one.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from hetpipe_jax.costs.task_times import VWTaskTimes
from hetpipe_jax.ps.param_server import ParameterServer
from hetpipe_jax.runtime.virtual_worker import VirtualWorker
from hetpipe_jax.sim import engine as engine_lib


class RecordingPSClient:
  """A VW's PS client in virtual time: pushes are held until the engine delivers them; pulls are the engine's."""

  def __init__(self, vw_id: int, outbox: dict):
    self.vw_id = vw_id
    self.outbox = outbox  # (vw, wave) -> (flat delta, loss sum, minibatches)

  def push(self, wave_id: int, flat_delta: np.ndarray, loss_sum: float, num_minibatches: int) -> None:
    self.outbox[(self.vw_id, wave_id)] = (flat_delta, loss_sum, num_minibatches)

  def request_pull(self, required_clock: int) -> None:
    """Never called in virtual time.

    Raises:
      RuntimeError: always; the engine drives the VW's sync state and requests and delivers its pulls.
    """
    raise RuntimeError(f"[VW {self.vw_id}] requested a pull at clock {required_clock} in virtual time, where the "
                       "engine drives the VW's sync state and requests its pulls")

  def poll_pull(self):
    return None


class VirtualTimeHooks:
  """Engine hooks that run each event's real computation (see the engine's documented hook order).

  Args:
    vws: one VirtualWorker per VW, built with :class:`RecordingPSClient` clients sharing ``outbox``.
    server: the in-process PS.
    outbox: the clients' pending pushes.
    on_clock: ``(global_clock, simulated_time_s, loss_sums) -> None`` whenever the global clock advances.
  """

  def __init__(self, vws: Sequence[VirtualWorker], server: ParameterServer, outbox: dict,
               on_clock: Callable[[int, float, list], None] | None = None):
    self.vws = list(vws)
    self.server = server
    self.outbox = outbox
    self.on_clock = on_clock
    self.inflight: list[dict] = [{} for _ in vws]
    # Per VW, the global weights its answered pull carries (taken when the PS answers; one pull outstanding per VW).
    self.replies: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
    self.losses: list[tuple[int, float, int]] = []  # (vw, loss sum, minibatches) of applied waves

  def on_inject(self, vw_id: int, minibatch_id: int, t: float) -> None:
    self.inflight[vw_id][minibatch_id] = self.vws[vw_id].inject(minibatch_id, t)

  def on_task_start(self, vw_id: int, task, t: float) -> None:
    del t
    self.vws[vw_id].dispatch(task, self.inflight[vw_id][task.minibatch_id])

  def on_minibatch_complete(self, vw_id: int, minibatch_id: int, t: float) -> None:
    self.vws[vw_id].complete_minibatch(self.inflight[vw_id].pop(minibatch_id), t)

  def on_wave_end(self, vw_id: int, wave_id: int, t: float) -> None:
    del t
    self.vws[vw_id].end_wave(wave_id)  # the push goes to the outbox until the engine delivers it

  def on_push(self, vw_id: int, wave_id: int, t: float) -> None:
    delta, loss_sum, count = self.outbox.pop((vw_id, wave_id))
    before = self.server.global_clock
    self.server.push(vw_id, wave_id, delta)
    self.losses.append((vw_id, loss_sum, count))
    for clock in range(before + 1, self.server.global_clock + 1):
      if self.on_clock is not None:
        self.on_clock(clock, t, self.losses)
        self.losses = []

  def on_pull_sent(self, vw_id: int, vector_clock: tuple[int, ...], t: float) -> None:
    del t
    got, weights = self.server.pull_reply(vw_id)
    if got != tuple(vector_clock):
      raise AssertionError(f"the engine's PS answers VW {vw_id} with vector clock {list(vector_clock)}, the "
                           f"in-process PS holds {list(got)}")
    self.replies[vw_id] = (got, weights)

  def on_pull_reply(self, vw_id: int, vector_clock: tuple[int, ...], t: float) -> None:
    del t
    got, weights = self.replies.pop(vw_id)
    assert got == tuple(vector_clock), (vw_id, got, vector_clock)
    self.vws[vw_id].install_pull(got, weights)


def run(vws: Sequence[VirtualWorker], server: ParameterServer, outbox: dict, task_times: Sequence[VWTaskTimes],
        num_waves: int, staleness_bound: int, pull_every_wave: bool,
        on_clock: Callable[[int, float, list], None] | None = None) -> tuple[engine_lib.EngineReport, float]:
  """Runs every VW for ``num_waves`` waves in simulated time; returns the engine's report and host seconds.

  The engine drives each VW's own ``sync`` state (module docstring) and applies pushes as ``server`` does
  (``server.state.ps_apply``), so the engine's PS and the in-process one hold the same updates at every event.

  Raises:
    ValueError: the VWs, task times and Nm do not agree, or a VW's sync state disagrees with ``staleness_bound``
      or ``pull_every_wave`` or is not fresh.
  """
  if len(vws) != len(task_times):
    raise ValueError(f"{len(vws)} virtual workers but {len(task_times)} task-time entries")
  num_inflight = vws[0].num_inflight
  config = engine_lib.EngineConfig(num_waves=num_waves, num_inflight=num_inflight, staleness_bound=staleness_bound,
                                   pull_every_wave=pull_every_wave, records=True,
                                   ps_apply=server.state.ps_apply, method=vws[0].method.name,
                                   max_held=(None if all(vw.max_held is None for vw in vws) else
                                             tuple(vw.max_held or (num_inflight,) * len(vw.stages) for vw in vws)))
  hooks = VirtualTimeHooks(vws, server, outbox, on_clock)
  t0 = time.perf_counter()
  report = engine_lib.run(task_times, config, hooks=hooks, sync_states=[vw.sync for vw in vws])
  return report, time.perf_counter() - t0



class HeldReducer:
  """A flush-method VW's reducer in virtual time: holds its step buffer until the engine's all-reduce (returns
  None, so the VW waits for :meth:`hetpipe_jax.runtime.flush_step.FlushUpdate.apply_reduced`)."""

  def __init__(self, vw_id: int, outbox: dict):
    self.vw_id = vw_id
    self.outbox = outbox  # (vw, step) -> buffer

  def __call__(self, step: int, buf: np.ndarray) -> None:
    self.outbox[(self.vw_id, step)] = buf.copy()


class AllReduceHooks(VirtualTimeHooks):
  """Engine hooks of the all-reduce methods: tasks as :class:`VirtualTimeHooks`; at a step's end a VW hands its
  buffer to its :class:`HeldReducer` (``on_wave_end``); when the engine's all-reduce happens (``on_allreduce``, the
  last VW entered it) the buffers are summed in VW order and every VW applies the sum (the engine then advances
  each VW's ``AllReduceSyncState`` at the reduction's end).

  Args:
    vws: the VWs (built with :class:`HeldReducer` reducers sharing ``outbox``).
    outbox: the reducers' held buffers.
    on_step: ``(step, simulated time, mean loss) -> None`` after each applied step, at the simulated time the
      reduction ends and every replica holds the update (the engine's ``on_reduced``; the numerics are applied when
      the reduction starts, which no task of the step's VWs can observe before it ends).
  """

  def __init__(self, vws: Sequence[VirtualWorker], outbox: dict,
               on_step: Callable[[int, float, float], None] | None = None):
    super().__init__(vws, None, outbox)
    self.on_step = on_step
    self._pending: dict[int, list] = {}  # step -> [replicas yet to hold it, mean loss]

  def on_allreduce(self, step: int, t: float) -> None:
    bufs = [self.outbox.pop((v, step)) for v in range(len(self.vws))]
    summed = bufs[0].copy()
    for b in bufs[1:]:
      summed += b
    for vw in self.vws:
      vw.update.apply_reduced(step, summed)
    self._pending[step] = [len(self.vws), float(summed[-1]) / (len(self.vws) * self.vws[0].num_inflight)]

  def on_reduced(self, vw_id: int, step: int, t: float) -> None:
    del vw_id
    pending = self._pending[step]
    pending[0] -= 1
    if pending[0] == 0:
      del self._pending[step]
      if self.on_step is not None:
        self.on_step(step, t, pending[1])


def run_allreduce(vws: Sequence[VirtualWorker], outbox: dict, task_times: Sequence[VWTaskTimes], num_steps: int,
                  on_step: Callable[[int, float, float], None] | None = None
                  ) -> tuple[engine_lib.EngineReport, float]:
  """Runs every flush-method VW for ``num_steps`` steps in simulated time (the engine drives each VW's own
  ``AllReduceSyncState``); returns the engine's report and host seconds."""
  if len(vws) != len(task_times):
    raise ValueError(f"{len(vws)} virtual workers but {len(task_times)} task-time entries")
  config = engine_lib.EngineConfig(num_waves=num_steps, num_inflight=vws[0].num_inflight, records=True,
                                   method=vws[0].method.name)
  hooks = AllReduceHooks(vws, outbox, on_step)
  t0 = time.perf_counter()
  report = engine_lib.run(task_times, config, hooks=hooks, sync_states=[vw.sync for vw in vws])
  return report, time.perf_counter() - t0


__all__ = ["RecordingPSClient", "VirtualTimeHooks", "run", "HeldReducer", "AllReduceHooks", "run_allreduce"]
