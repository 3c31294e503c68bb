"""The parameter server: global weights updated by wave updates under WSP, on receipt or clock-aligned (HetPipe §5).

Runtime layer (numpy only; the MPI loop lives in :mod:`hetpipe_jax.mpi.ps_server`). The bookkeeping (which waves are
applied, the global clock, pending pulls) is the pure :class:`hetpipe_jax.rules.wsp.ParameterServerState`; this class
adds the tensors.
"""

from __future__ import annotations

import numpy as np

from hetpipe_jax.rules import wsp


class BadUpdateError(ValueError):
  """A wave update the PS refuses (wrong size, NaN or Inf); the message names the VW and the wave."""


class ParameterServer:
  """Global weights as one float32 vector ``[num_params]`` plus pending wave updates.

  Args:
    initial_weights: W0, float32 ``[num_params]`` (copied).
    num_virtual_workers: N >= 1.
    ps_apply: ``"on_receipt"`` (HetPipe §5, default): a pushed wave update is added to the global weights at once;
      ``"clock_aligned"``: it is held until every VW has pushed that wave, then all N are added in VW order.
    staleness_scaling, staleness_alpha: each wave update is added times its ``state.staleness`` scale
      (:class:`hetpipe_jax.rules.wsp.ParameterServerState`; ``"none"``: added as pushed, HetPipe §5).

  Either way the global weights are W0 plus the updates of ``state.applied``, added in that order (the order a
  replay follows), and a copy is named by its vector clock (:meth:`snapshot`).

  Raises:
    ValueError: ``num_virtual_workers < 1``, an unknown ``ps_apply`` or a bad staleness scaling.
  """

  def __init__(self, initial_weights: np.ndarray, num_virtual_workers: int, ps_apply: str = "on_receipt",
               staleness_scaling: str = "none", staleness_alpha: float = 1.0):
    self.weights = np.array(initial_weights, dtype=np.float32, copy=True)
    self.state = wsp.ParameterServerState(num_virtual_workers, ps_apply, staleness_scaling=staleness_scaling,
                                          staleness_alpha=staleness_alpha)
    self._pending: dict[tuple[int, int], np.ndarray] = {}
    self.wave_offset = 0  # added to wave ids in messages (checkpoint segments number their waves from 0)

  @property
  def global_clock(self) -> int:
    return self.state.global_clock

  def push(self, vw_id: int, wave_id: int, delta: np.ndarray) -> int:
    """Accepts VW ``vw_id``'s aggregated update of ``wave_id``; returns the number of wave updates applied now.

    Raises:
      BadUpdateError: wrong size, or NaN/Inf values (nothing is applied; the global weights are untouched).
      ValueError: the wave was already pushed, or pushed out of order.
    """
    if delta.shape != self.weights.shape:
      raise BadUpdateError(f"VW {vw_id} pushed {delta.shape[0] if delta.ndim else 0} floats for wave "
                           f"{wave_id + self.wave_offset}; the model has {self.weights.size}")
    if not np.isfinite(delta).all():
      bad = int(np.size(delta) - np.count_nonzero(np.isfinite(delta)))
      raise BadUpdateError(f"VW {vw_id}'s update of wave {wave_id + self.wave_offset} has {bad} NaN/Inf values: "
                           "refused before it "
                           "touched the global weights (training diverged on that VW: lower config.learning_rate)")
    state = self.state
    ready = state.push(vw_id, wave_id)
    scaled = state.staleness_scaling != "none"
    if ready == [(wave_id, vw_id)]:  # on receipt: no copy needed
      if scaled:
        self.weights += np.float32(state.staleness[-1][1]) * np.asarray(delta, np.float32)
      else:
        self.weights += np.asarray(delta, np.float32)
      return 1
    self._pending[(wave_id, vw_id)] = np.array(delta, np.float32, copy=True)
    scales = state.staleness[len(state.staleness) - len(ready):]
    for key, (_, scale) in zip(ready, scales):
      if scaled:
        self.weights += np.float32(scale) * self._pending.pop(key)
      else:
        self.weights += self._pending.pop(key)
    return len(ready)

  def snapshot(self) -> tuple[tuple[int, ...], np.ndarray]:
    """``(vector clock, copy of the global weights)``; the vector clock's minimum is the global clock."""
    return self.state.vector_clock(), self.weights.copy()

  def pull_reply(self, vw_id: int) -> tuple[tuple[int, ...], np.ndarray]:
    """:meth:`snapshot` sent to VW ``vw_id`` as its pull reply (recorded: its later waves' staleness counts from
    it)."""
    vector_clock, weights = self.snapshot()
    self.state.note_pull(vw_id, vector_clock)
    return vector_clock, weights


class LocalPSClient:
  """In-process client for one VW and an in-process :class:`ParameterServer` (single-process runs and tests).

  Pull requests go to the server's :class:`~hetpipe_jax.rules.wsp.ParameterServerState` (answered at once or kept
  pending); every push through a client lets the state answer the pending pulls it now can, and a VW's answered
  pull is returned by its next :meth:`poll_pull`, with the global weights current then.
  """

  def __init__(self, server: ParameterServer, vw_id: int):
    self.server = server
    self.vw_id = vw_id
    self._pull_outstanding = False
    self.losses: list[tuple[int, float]] = []

  def push(self, wave_id: int, flat_delta: np.ndarray, loss_sum: float, num_minibatches: int) -> None:
    self.server.push(self.vw_id, wave_id, flat_delta)
    self.server.state.serve_pending_pulls()  # answered pulls leave the pending set; their clients poll them
    self.losses.append((wave_id, loss_sum / max(num_minibatches, 1)))

  def request_pull(self, required_clock: int) -> None:
    self.server.state.request_pull(self.vw_id, required_clock)  # answered now, or pending until a push
    self._pull_outstanding = True

  def poll_pull(self) -> tuple[int, np.ndarray] | None:
    if not self._pull_outstanding or self.vw_id in self.server.state.pending_pulls:
      return None
    self._pull_outstanding = False
    return self.server.pull_reply(self.vw_id)
