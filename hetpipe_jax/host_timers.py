"""Host timers: a thread's sleeps end within about a microsecond of their deadline (Linux timer slack).

Standard library only, below every layer: the stage executors (:mod:`hetpipe_jax.runtime.stage_executor`), the stage
ranks and the parameter-server service (:mod:`hetpipe_jax.mpi.ps_server`) set it on their threads.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_TIMERSLACK = 29  # linux/prctl.h


def fine_timer_slack() -> bool:
  """Lets the calling thread's sleeps end within about a microsecond of their deadline (Linux; else a no-op).

  Linux lets a normal thread's timers fire up to its "timer slack" late (50 µs by default) to batch wake-ups; an
  emulated 2 ms task would end that much late on every sleep. Returns whether the slack was set.
  """
  if not sys.platform.startswith("linux"):
    return False
  try:
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0) == 0
  except (OSError, AttributeError):
    return False
