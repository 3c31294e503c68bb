"""Where a virtual worker's stages run: all in this process, or some on other MPI ranks (stage ranks).

Runtime layer. A :class:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker` holds one placement and asks it, never
``if link`` / ``if remote``, how a stage's input arrives, where its output goes and who else must hear of a new
weight version. :class:`AllLocal` is the null object (every stage in this process: activations and gradients are
device-to-device moves, nobody else to tell); :class:`LinkedStages` is the stage-rank placement (HetPipe §8.1's ED
and HD allocations put one GPU of several nodes in a VW): a stage on another rank gets its tasks as commands, its
inputs and outputs go through the :class:`~hetpipe_jax.mpi.stage_link.StageLink`, and on the driver every
version change (injection, a minibatch's update, a pull, a wave end) is sent to the stage ranks
(:class:`~hetpipe_jax.mpi.stage_client.RemoteStages`), which apply the same changes in the same order
(:class:`~hetpipe_jax.mpi.stage_server.StageRankServer`). The protocol is in :mod:`hetpipe_jax.mpi.stage_server`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np


class AllLocal:
  """Every stage of the VW runs in this process (the null placement: no ranks to tell, no wire).

  Attributes:
    all_local: True.
  """

  all_local = True

  def is_local(self, stage_id: int) -> bool:
    del stage_id
    return True

  # --------------------------------------------------------------- activations and gradients
  def take_activation(self, task, mb: Any, device) -> Any:
    """Task ``task``'s stage's input of minibatch ``mb`` (already on ``device``)."""
    del device
    return mb.activations.pop(task.stage_id)

  def take_gradient(self, task, mb: Any, device) -> Any:
    """Task ``task``'s stage's output gradient of minibatch ``mb`` (already on ``device``)."""
    del device
    return mb.grad_in.pop(task.stage_id)

  def send_activation(self, task, mb: Any, out, next_device):
    """Moves task ``task``'s stage's output to the next stage; returns the array that is ready once it arrived."""
    nxt = jax.device_put(out, next_device)
    mb.activations[task.stage_id + 1] = nxt
    return nxt

  def send_gradient(self, task, mb: Any, grad, prev_device):
    """Moves task ``task``'s stage's input gradient to the previous stage; returns the array that is ready once it
    arrived."""
    g = jax.device_put(grad, prev_device)
    mb.grad_in[task.stage_id - 1] = g
    return g

  # --------------------------------------------------------------- version changes (the driver's side)
  def on_inject(self, minibatch_id: int, version_id: int, labels: np.ndarray) -> None:
    del minibatch_id, version_id, labels

  def on_update(self, minibatch_id: int, version_id: int, norm: float | None) -> None:
    del minibatch_id, version_id, norm

  def on_pull(self, version_id: int, own_applied: Sequence[int]) -> None:
    del version_id, own_applied

  def wave_flat(self, vw: Any, wave_id: int, trees: Sequence[Any]) -> np.ndarray:
    """The wave's update to push, float32 ``[num_params]``: every stage's delta ``trees`` (layer order)."""
    del wave_id
    return vw.flat_of(range(len(vw.stages)), trees)

  # --------------------------------------------------------------- the run
  def begin_run(self, done, t0: float, start_unix_s: float, num_minibatches: int) -> None:
    del done, t0, start_unix_s, num_minibatches

  def executor(self, stage_id: int, make_local: Callable[[], Any]) -> Any:
    """Stage ``stage_id``'s executor: a local one (``make_local()``)."""
    del stage_id
    return make_local()


class LinkedStages(AllLocal):
  """Some of the VW's stages run on other MPI ranks (module docstring).

  Args:
    link: this rank's :class:`~hetpipe_jax.mpi.stage_link.StageLink` (which stages are local; activations and
      gradients to and from stages on other ranks).
    remote: on the driver, the :class:`~hetpipe_jax.mpi.stage_client.RemoteStages` its actions send their version
      changes and remote tasks to; None on a stage rank.
  """

  all_local = False

  def __init__(self, link: Any, remote: Any = None):
    self.link = link
    self.remote = remote

  def is_local(self, stage_id: int) -> bool:
    return self.link.is_local(stage_id)

  def start_task(self, task, version_id: int, duration_s: float | None) -> None:
    """A remote stage's task: a command to its rank (driver only)."""
    self.remote.start_task(task, version_id, duration_s)

  def sq_norms(self, minibatch_id: int, stage_ids: Sequence[int]) -> list[float]:
    """The remote stages' squared gradient norms of a minibatch, as their ranks reported them (driver only)."""
    return self.remote.sq_norms(minibatch_id, stage_ids)

  def take_activation(self, task, mb: Any, device) -> Any:
    if task.stage_id == 0 or self.link.is_local(task.stage_id - 1):
      return mb.activations.pop(task.stage_id)
    return jax.device_put(self.link.recv_activation(task.stage_id, task.minibatch_id, mb.version.version_id), device)

  def take_gradient(self, task, mb: Any, device) -> Any:
    if self.link.is_local(task.stage_id + 1):
      return mb.grad_in.pop(task.stage_id)
    return jax.device_put(self.link.recv_gradient(task.stage_id, task.minibatch_id, mb.version.version_id), device)

  def send_activation(self, task, mb: Any, out, next_device):
    if not self.link.is_local(task.stage_id + 1):
      return self.link.send_activation(task.stage_id, task.minibatch_id, mb.version.version_id, out)
    return super().send_activation(task, mb, out, next_device)

  def send_gradient(self, task, mb: Any, grad, prev_device):
    if not self.link.is_local(task.stage_id - 1):
      return self.link.send_gradient(task.stage_id, task.minibatch_id, mb.version.version_id, grad)
    return super().send_gradient(task, mb, grad, prev_device)

  def on_inject(self, minibatch_id: int, version_id: int, labels: np.ndarray) -> None:
    """Every stage rank learns p's version; the last stage's rank gets the labels."""
    if self.remote is not None:
      self.remote.on_inject(minibatch_id, version_id, labels)

  def on_update(self, minibatch_id: int, version_id: int, norm: float | None) -> None:
    """Every stage rank applies p's update to its stages: the same new version."""
    if self.remote is not None:
      self.remote.on_update(minibatch_id, version_id, norm)

  def on_pull(self, version_id: int, own_applied: Sequence[int]) -> None:
    """The stage ranks rebase their stages on their parts of the same pull."""
    if self.remote is not None:
      self.remote.on_pull(version_id, own_applied)

  def wave_flat(self, vw: Any, wave_id: int, trees: Sequence[Any]) -> np.ndarray:
    """The stage ranks push their own parts to the shards: the driver's wave update is its local stages' deltas in a
    float32 ``[num_params]`` vector (zeros elsewhere)."""
    self.remote.end_wave(wave_id)
    offsets = vw.layout.layer_offsets
    flat = np.zeros(vw.layout.num_params, np.float32)
    local = vw.local_stages
    parts = jax.device_get([vw.stages[s].ravel(trees[s]) for s in local])
    for s, part in zip(local, parts):
      start, end = vw.stages[s].layer_range
      flat[offsets[start]:offsets[end]] = part
    return flat

  def begin_run(self, done, t0: float, start_unix_s: float, num_minibatches: int) -> None:
    """Stage ranks start their executors on the driver's clock."""
    self.remote.begin_run(done, t0, start_unix_s, num_minibatches)

  def executor(self, stage_id: int, make_local: Callable[[], Any]) -> Any:
    return make_local() if self.link.is_local(stage_id) else self.remote.executor(stage_id)


ALL_LOCAL = AllLocal()
