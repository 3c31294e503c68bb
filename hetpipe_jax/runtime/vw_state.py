"""A virtual worker's state types: its weight versions, in-flight minibatches, run statistics, and the PS client it
talks to (HetPipe §4–§5).

Runtime layer; used by :mod:`hetpipe_jax.runtime.virtual_worker` (the actions), :mod:`hetpipe_jax.runtime.vw_driver`
(the run loop) and the stage-rank server.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import numpy as np

from hetpipe_jax.rules.records import MinibatchRecord


def host_copy(tree):
  """Copies host arrays before ``device_put``: on the CPU backend a device array may alias the numpy buffer it came
  from, and the buffers weights come from (the PS's global weights) change in place while computations that read
  them may still be running asynchronously."""
  return jax.tree.map(lambda a: np.array(a, copy=True), tree)


class PSClient(Protocol):
  """What a VW needs from the parameter server (in-process or over MPI)."""

  def push(self, wave_id: int, flat_delta: np.ndarray, loss_sum: float, num_minibatches: int) -> None:
    """Sends wave ``wave_id``'s aggregated update (float32 ``[num_params]``)."""

  def request_pull(self, required_clock: int) -> None:
    """Asks for the global weights once the global clock is >= ``required_clock``."""

  def poll_pull(self) -> tuple[tuple[int, ...], np.ndarray] | None:
    """Non-blocking: ``(vector clock, float32 [num_params])`` if a pull reply arrived, else None.

    The vector clock has one entry per VW (how many of its waves the weights hold); its minimum is the global
    clock.
    """


@dataclasses.dataclass(frozen=True)
class WeightVersion:
  """One consistent version of a VW's weights.

  Attributes:
    params: per stage, that stage's per-layer params on its device.
    local_updates: how many of this VW's own minibatch updates it includes (minibatches ``0..local_updates-1``).
    vector_clock: per VW, how many of its waves the last pulled global weights hold (HetPipe §5; entries above
      the minimum are extra updates, under ``ps_apply="on_receipt"``).
    version_id: increments on every change.
  """

  params: tuple
  local_updates: int
  vector_clock: tuple[int, ...]
  version_id: int
  shard_vector_clocks: tuple[tuple[int, ...], ...] | None = None  # sharded PS: per shard, its slice's vector clock

  @property
  def global_clock(self) -> int:
    """The guaranteed global clock: every VW's waves ``0..global_clock-1`` are included."""
    return min(self.vector_clock)


@dataclasses.dataclass
class VWStats:
  """Per-VW timing: seconds waiting for the PS (WSP bound) and seconds with no runnable task."""

  wait_s: float = 0.0
  idle_s: float = 0.0
  wall_time_s: float = 0.0
  start_unix_s: float = 0.0  # the run's start on the machine clock (record times are relative to it)
  num_pulls: int = 0
  num_pushes: int = 0
  peak_inflight_per_stage: list[int] = dataclasses.field(default_factory=list)
  max_concurrent_tasks: int = 0
  num_tasks: int = 0
  host_busy_s: float = 0.0  # scheduler thread's time not blocked waiting for completions
  # of update_s: the wave ends (losses read back, the wave's update to the host and pushed); through a PS channel
  # thread (ps_channel = "thread"): handing the wave to it (the run end's wait for its last pushes is in wall_time_s)
  push_s: float = 0.0
  update_s: float = 0.0  # ... of which applying minibatch updates and pushing waves (weights' compute/transfers)
  sync_s: float = 0.0  # ... of which installing pulled global weights
  inject_s: float = 0.0  # ... of which reading minibatches and placing them on stage devices
  dispatch_s: float = 0.0  # stage executors' time inside task dispatch calls
  executor_book_s: float = 0.0  # stage executors' time booking their completions and starting what they made ready
  ps_channel: str = "inline"  # where the VW's PS operations ran: "thread" (ps_channel module) or "inline"
  ps_channel_s: float = 0.0  # the PS channel thread's busy time (pushes, pull requests, polling replies)
  num_overruns: int = 0  # emulated tasks whose real work outlasted their target duration
  overrun_s: float = 0.0


@dataclasses.dataclass
class InFlightMinibatch:
  version: WeightVersion
  images: jax.Array
  labels: jax.Array
  activations: dict  # stage -> input activation on that stage's device
  residuals: dict  # stage -> vjp closure
  grad_in: dict  # stage -> gradient arriving from stage + 1
  grads: dict  # stage -> param grads
  loss: Any = None
  record: MinibatchRecord | None = None


