"""Where the repository is: the one place that finds its root (configs, plans and profiles are relative to it),
and the one JSON file writer for the files kept there.

Planning layer: standard library only.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def repo_path(path: str | pathlib.Path) -> pathlib.Path:
  """``path`` as given when it exists or is absolute, else relative to the repository root.

  So ``experiments/plans/x.json`` works from any working directory.
  """
  p = pathlib.Path(path)
  if p.is_absolute() or p.exists():
    return p
  return REPO_ROOT / p


def write_json(obj: Any, path: str | pathlib.Path) -> None:
  """Writes ``obj`` as indented JSON with a final newline, creating parent folders (plans, profiles)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(obj, indent=1) + "\n")
