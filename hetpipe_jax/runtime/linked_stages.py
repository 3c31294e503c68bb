"""A virtual worker's actions when some of its stages run on other MPI ranks (stage ranks; HetPipe §8.1's ED and HD
allocations put one GPU of several nodes in a VW).

Runtime layer. :class:`LinkedStages` is a part of :class:`hetpipe_jax.runtime.virtual_worker.VirtualWorker` (``link``
set): a stage rank's side of a wave end and of a pull, which work on its own stages' elements only, and the
driver's wave delta of its own stages. (:meth:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker.dispatch` sends a
remote stage's task to its rank and moves activations and gradients through the
:class:`~hetpipe_jax.runtime.stage_wire.StageLink`.) The protocol and the stage rank's server are in
:mod:`hetpipe_jax.runtime.stage_ranks`.
"""

from __future__ import annotations

import jax
import numpy as np



class LinkedStages:
  """The stage-rank actions of a :class:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker`."""

  def take_wave_delta(self) -> np.ndarray:
    """The local stages' wave delta, flat (their layers in stage order), and a fresh zero delta (a stage rank's side
    of a wave end)."""
    flat = self._flat_of(self.local_stages, [self.wave_delta[s] for s in self.local_stages])
    for s in self.local_stages:
      self.wave_delta[s] = self._zeros[s]
    return flat

  def install_rebased(self, flat: np.ndarray) -> None:
    """A stage rank's side of a pull: its stages' rebased weights (the pulled global weights plus the own waves the
    PS lacks, computed by the driver; its stages' layers in stage order) plus its current partial wave: a new
    version."""
    params = list(self.version.params)
    pos = 0
    offsets = self.layout.layer_offsets
    for s in self.local_stages:
      start, end = self.stages[s].layer_range
      n = offsets[end] - offsets[start]
      params[s] = self.stages[s].add(self._stage_params_of(s, flat[pos:pos + n]), self.wave_delta[s])
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
    parts = jax.device_get([self.stages[s].ravel(self.wave_delta[s]) for s in self.local_stages])
    for s, part in zip(self.local_stages, parts):
      start, end = self.stages[s].layer_range
      flat[offsets[start]:offsets[end]] = part
    return flat

