"""A virtual worker's actions when some of its stages run on other MPI ranks (stage ranks; HetPipe §8.1's ED and HD
allocations put one GPU of several nodes in a VW).

Runtime layer. :class:`LinkedStages` is a part of :class:`hetpipe_jax.runtime.virtual_worker.VirtualWorker` (``link``
set): a remote stage's task is a command to its rank (``remote``); between stages of different ranks activations and
gradients go through the :class:`~hetpipe_jax.runtime.stage_ranks.StageLink`; a stage rank's side of a wave end and
of a pull works on its own stages' elements only. The protocol and the stage rank's server are in
:mod:`hetpipe_jax.runtime.stage_ranks`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from hetpipe_jax.rules.schedule import Task, TaskKind
from hetpipe_jax.runtime.vw_state import InFlightMinibatch, host_copy


class LinkedStages:
  """The stage-rank actions of a :class:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker`."""

  def _dispatch_linked(self, task: Task, mb: InFlightMinibatch):
    """:meth:`dispatch` with stage ranks: a remote stage's task is a command to its rank (the driver's remote
    executor calls this on whichever thread started it: the scheduler's, or a local executor's that booked a
    completion; returns None); a local stage's input from a stage on another rank
    arrives through the link, and its output to one leaves through it (the returned marker is ready once it has
    been received). Parameter gradients are kept before the input gradient is sent, so a minibatch's update (sent
    once stage 0's backward completed) finds them on every stage."""
    s = task.stage_id
    st = self.stages[s]
    p = task.minibatch_id
    if s not in self.local_stages:
      self.remote.start_task(task, mb.version.version_id,
                             self.task_time_s(task) if self.task_time_s is not None else None)
      return None
    version = mb.version.version_id
    params = mb.version.params[s]
    link = self.link
    if task.kind is TaskKind.BACKWARD:
      if link.is_local(s + 1):
        grad_out = mb.grad_in.pop(s)
      else:
        grad_out = jax.device_put(link.recv_gradient(s, p, version), st.device)
      gp, gx = st.backward(mb.residuals.pop(s), grad_out)
      mb.grads[s] = gp
      if s == 0:
        leaves = jax.tree.leaves(gp)
        return leaves[0] if leaves else grad_out
    else:
      if s == 0 or link.is_local(s - 1):
        x = mb.activations.pop(s)
      else:
        x = jax.device_put(link.recv_activation(s, p, version), st.device)
      if task.kind is TaskKind.FORWARD:
        out, vjp = st.forward(params, x)
        mb.residuals[s] = vjp
        if link.is_local(s + 1):
          nxt = jax.device_put(out, self.stages[s + 1].device)
          mb.activations[s + 1] = nxt
          return nxt
        return link.send_activation(s, p, version, out)
      loss, gp, gx = st.forward_backward(params, x, mb.labels)
      mb.loss = loss
      mb.grads[s] = gp
      if s == 0:
        return loss
    if link.is_local(s - 1):
      g = jax.device_put(gx, self.stages[s - 1].device)
      mb.grad_in[s - 1] = g
      return g
    return link.send_gradient(s, p, version, gx)


  def take_wave_delta(self) -> np.ndarray:
    """The local stages' wave delta, flat (their layers in stage order), and a fresh zero delta (a stage rank's side
    of a wave end)."""
    host = jax.device_get([self.wave_delta[s] for s in self.local_stages])
    flat = self._flat_of(self.local_stages, host)
    for s in self.local_stages:
      self.wave_delta[s] = self._zeros[s]
    return flat


  def _flat_of(self, stage_ids: Sequence[int], host: Sequence[Any]) -> np.ndarray:
    parts = [self.layout.flatten(h, self.stages[s].layer_range[0]) for s, h in zip(stage_ids, host)]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


  def install_rebased(self, flat: np.ndarray) -> None:
    """A stage rank's side of a pull: its stages' rebased weights (the pulled global weights plus the own waves the
    PS lacks, computed by the driver; its stages' layers in stage order) plus its current partial wave: a new
    version."""
    params = list(self.version.params)
    pos = 0
    offsets = self.layout.layer_offsets
    for s in self.local_stages:
      st = self.stages[s]
      start, end = st.layer_range
      n = offsets[end] - offsets[start]
      p = jax.device_put(host_copy(self.layout.unflatten(flat[pos:pos + n], start, end)), st.device)
      params[s] = st.add(p, self.wave_delta[s])
      pos += n
    if pos != flat.size:
      raise ValueError(f"[VW {self.vw_id}] rebased weights of {flat.size} floats for stages {self.local_stages} "
                       f"holding {pos}")
    self.version = self._new_version(params)


  def _linked_wave_flat(self) -> np.ndarray:
    """Stage ranks: the local stages' wave delta in a float32 ``[num_params]`` vector (zeros elsewhere: the stage
    ranks push their stages' parts themselves)."""
    offsets = self.layout.layer_offsets
    flat = np.zeros(self.layout.num_params, np.float32)
    host = jax.device_get([self.wave_delta[s] for s in self.local_stages])
    for s, h in zip(self.local_stages, host):
      start, end = self.stages[s].layer_range
      flat[offsets[start]:offsets[end]] = self.layout.flatten(h, start)
    return flat

