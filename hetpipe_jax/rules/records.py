"""The per-minibatch record shared by the runtime, virtual time and the engine (``minibatches.jsonl`` rows).

Planning layer: plain data, so one checker (the WSP bounds, the sequential replay) serves every mode.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class MinibatchRecord:
  """What happened to one minibatch of one VW (HetPipe §4–§5).

  Attributes:
    vw_id, minibatch_id, wave_id: which minibatch (0-based; ``wave_id = minibatch_id // Nm``).
    local_clock_at_injection: the VW's local clock (completed waves) when the minibatch was injected.
    version_id: the VW's weight version (increments at every minibatch completion and every installed pull).
    version_local_updates: own minibatch updates in that version (minibatches ``0..n-1``).
    version_global_clock: global clock of the last pulled weights in that version (every VW's waves ``0..g-1``).
    inject_time_s, complete_time_s: seconds since the VW's start (wall time, or simulated time).
    loss: the minibatch's training loss (NaN in the timing-only engine).
  """

  vw_id: int
  minibatch_id: int
  wave_id: int
  local_clock_at_injection: int
  version_id: int
  version_local_updates: int
  version_global_clock: int
  inject_time_s: float
  complete_time_s: float = float("nan")
  loss: float = float("nan")
