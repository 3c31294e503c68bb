"""Command-line flags a mode sets itself: given beside that mode, a flag is refused, never silently replaced.

Utility layer (absl only). Every CLI, experiment and benchmark with a ``--smoke`` mode (a seconds-long end-to-end
check for CI that picks its own model, run length, cases, ...) names the flags that mode replaces; a user who gives
one of them beside ``--smoke`` gets one ``error:`` line and exit 2 instead of a run that records other values than
the ones asked for.
"""

from __future__ import annotations

import sys
from typing import Sequence

from absl import flags


def given(names: Sequence[str]) -> list[str]:
  """The flags of ``names`` given on the command line (``--name``; absl's ``present``)."""
  return [f"--{n}" for n in names if flags.FLAGS[n].present]


def refuse_replaced(mode: str, names: Sequence[str]) -> None:
  """Exits 2 with one ``error:`` line on stderr when a flag of ``names`` was given beside ``mode`` (``"--smoke"``),
  which sets every one of them itself; returns otherwise.

  Args:
    mode: the mode's flag as typed (``"--smoke"``).
    names: the flags the mode replaces, without dashes (each defined).
  """
  got = given(names)
  if got:
    print(f"error: {mode} sets {', '.join(f'--{n}' for n in names)} itself; {', '.join(got)} would not run: leave "
          f"{'it' if len(got) == 1 else 'them'} out, or drop {mode}", file=sys.stderr, flush=True)
    sys.exit(2)
