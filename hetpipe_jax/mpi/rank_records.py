"""Who each MPI rank is, and why one stopped: the small files a launcher reads to name a failed rank.

Pure (standard library only). Every rank of an MPI job writes ``<workdir>/procs/rank<r>.json`` when it starts
(:func:`write_proc`: rank, PID, host, start time), so the PID in MPICH's "BAD TERMINATION ... PID p RUNNING AT host"
message maps back to a rank; a rank that stops on an error it caught writes ``<workdir>/failures/rank<r>-<pid>.json``
(:func:`write_failure`: the error's type and message, and for a hang the rank it blames). The launcher's recovery
(:mod:`hetpipe_jax.recovery`) reads both (:func:`read_procs`, :func:`read_failures`).
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import time
from typing import Any


def _write_json(path: pathlib.Path, record: dict[str, Any]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + f".tmp{os.getpid()}")
  tmp.write_text(json.dumps(record, sort_keys=True) + "\n")
  os.replace(tmp, path)  # atomic: a reader never sees half a file


def write_proc(workdir: str | os.PathLike, rank: int, world_size: int) -> dict[str, Any]:
  """Writes (atomically) and returns this process's record ``{"rank", "world_size", "pid", "host", "started_at"}``
  (``started_at``: Unix seconds)."""
  record = {"rank": rank, "world_size": world_size, "pid": os.getpid(), "host": socket.gethostname(),
            "started_at": time.time()}
  _write_json(pathlib.Path(workdir) / "procs" / f"rank{rank}.json", record)
  return record


def write_failure(workdir: str | os.PathLike, rank: int, error: BaseException,
                  suspect_rank: int | None = None) -> dict[str, Any]:
  """Writes and returns this rank's failure record ``{"rank", "pid", "host", "time", "error", "message",
  "suspect_rank"}`` (``suspect_rank``: the rank a hang is blamed on, else None). Never raises: a failure record that
  cannot be written (a full disk) must not hide the error itself."""
  record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
            "error": type(error).__name__, "message": str(error), "suspect_rank": suspect_rank}
  try:
    _write_json(pathlib.Path(workdir) / "failures" / f"rank{rank}-{os.getpid()}.json", record)
  except OSError:
    pass
  return record


def _read_dir(directory: pathlib.Path, since: float, key: str) -> list[dict[str, Any]]:
  out = []
  if not directory.is_dir():
    return out
  for path in sorted(directory.glob("*.json")):
    try:
      record = json.loads(path.read_text())
    except (OSError, ValueError):
      continue
    if float(record.get(key, 0.0)) >= since:
      out.append(record)
  return out


def read_procs(workdir: str | os.PathLike, since: float = 0.0) -> dict[int, dict[str, Any]]:
  """Rank -> its process record, for the processes started at or after ``since`` (Unix seconds)."""
  return {int(r["rank"]): r for r in _read_dir(pathlib.Path(workdir) / "procs", since, "started_at")}


def read_failures(workdir: str | os.PathLike, since: float = 0.0) -> list[dict[str, Any]]:
  """The failure records written at or after ``since`` (Unix seconds), oldest first."""
  return sorted(_read_dir(pathlib.Path(workdir) / "failures", since, "time"), key=lambda r: r["time"])
