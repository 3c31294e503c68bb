"""The parameter server's progress watchdog: which virtual workers count as hung.

Rules layer (pure). A rank can hang without dying (a wedged GPU, a stopped process): MPI sees nothing wrong and the
job waits forever. The PS hears from every VW at least once per wave (its push, its metrics, a pull request), so a VW
that has been silent for longer than ``limit_s`` while the PS owes it nothing is treated as failed
(:class:`hetpipe_jax.mpi.ps_server.PSService` raises :class:`HungRankError`; the launcher's recovery restarts the job).
A VW the PS owes something is not counted: one whose pull the PS holds back under the staleness bound (WSP, HetPipe
§5) waits for *another* VW, and one that has reported its segment or its end waits for the PS. Stage ranks and PS
shards are covered through their VW: a stopped stage rank stalls its VW's pipeline, so its driver falls silent.

Before a VW's first message its process may still be compiling or restoring a checkpoint, which can take minutes,
so until then a longer limit applies (:data:`STARTUP_LIMIT_S`, or the limit when it is longer). A silence of the
limit or more is a hang, so with ``limit_s`` at least the longest wave the plan expects (the
launcher's default is minutes; a wave takes seconds) no healthy run trips it.
"""

from __future__ import annotations

from typing import Collection, Mapping


STARTUP_LIMIT_S = 300.0  # the watchdog's limit before a VW's first message (start-up, compilation, restore)


class HungRankError(RuntimeError):
  """A virtual worker stopped making progress (the message names it, its driver rank and its silence).

  Attributes:
    rank: the MPI rank blamed (the VW's driver), or None.
  """

  def __init__(self, message: str, rank: int | None = None):
    super().__init__(message)
    self.rank = rank


def silent_vws(now_s: float, last_heard_s: Mapping[int, float], waiting: Collection[int],
               limit_s: float, unheard: Collection[int] = (), startup_limit_s: float = 0.0
               ) -> list[tuple[int, float]]:
  """The VWs silent for ``limit_s`` seconds or more, with their silences, longest first.

  Args:
    now_s: the PS's clock now (seconds; any monotonic clock).
    last_heard_s: per VW, when the PS last received a message from one of its ranks (same clock); a VW starts out as
      heard at the segment's start.
    waiting: VWs the PS owes something (a pull held under the staleness bound, or its segment/end reported); never
      counted.
    limit_s: the watchdog's limit in seconds; 0 turns it off (no VW is ever silent).
    unheard: VWs not heard from since their process started (they may still be compiling or restoring a
      checkpoint); judged against ``max(limit_s, startup_limit_s)`` instead.
    startup_limit_s: the limit for ``unheard`` VWs (seconds).

  Returns:
    ``[(vw, silence_s), ...]``, longest silence first (ties by VW id).

  Raises:
    ValueError: ``limit_s`` < 0.
  """
  if not limit_s >= 0:
    raise ValueError(f"ps_watchdog_s={limit_s} must be >= 0 (0: off)")
  if limit_s == 0:
    return []
  startup = max(limit_s, startup_limit_s)
  silent = [(vw, now_s - t) for vw, t in last_heard_s.items()
            if vw not in waiting and now_s - t >= (startup if vw in unheard else limit_s)]
  return sorted(silent, key=lambda x: (-x[1], x[0]))
