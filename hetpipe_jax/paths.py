"""Where the repository is: the one place that finds its root (configs, plans and profiles are relative to it).

Planning layer: standard library only.
"""

from __future__ import annotations

import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def repo_path(path: str | pathlib.Path) -> pathlib.Path:
  """``path`` as given when it exists or is absolute, else relative to the repository root.

  So ``experiments/plans/x.json`` works from any working directory.
  """
  p = pathlib.Path(path)
  if p.is_absolute() or p.exists():
    return p
  return REPO_ROOT / p
