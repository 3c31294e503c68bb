"""A rank's guard: runs one MPI rank's process as its child and records how it ended (``launch --max_restarts``).

  mpiexec ... python -m hetpipe_jax.mpi.rank_guard --workdir=W -- python -m mpi4py -m hetpipe_jax.train ...

Pure (standard library only). MPICH's report of a failed job names one terminated process, the lowest rank among
those its clean-up killed, not the one that failed first. The guard is the process MPICH starts; the rank runs as its
child with the guard's environment and inherited file descriptors (the PMI connection), so MPI sees no difference.
When the child ends the guard writes ``<workdir>/exits/rank<r>-<pid>.json`` at once (``{"rank", "pid", "host",
"time", "exit_code", "signal"}``: ``signal`` the number that ended it, else None; ``time`` in Unix seconds), then exits
as its child did. The rank that failed first ends while the others are still running, so its guard writes the
earliest record (:func:`read_exits`); the clean-up then kills the rest. SIGTERM and SIGINT to the guard are passed on
to the child.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any


def rank_of_environment(env: dict[str, str] | os._Environ) -> int | None:  # pylint: disable=protected-access
  """This process's MPI rank as the process manager gives it (``PMI_RANK``, MPICH's hydra; ``OMPI_COMM_WORLD_RANK``,
  Open MPI), or None."""
  for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"):
    if env.get(name, "").isdigit():
      return int(env[name])
  return None


def write_exit(workdir: str | os.PathLike, rank: int | None, pid: int, returncode: int) -> dict[str, Any]:
  """Writes (atomically) and returns the exit record of child ``pid`` (``returncode`` as :mod:`subprocess` gives it:
  negative for a signal)."""
  record = {"rank": rank, "pid": pid, "host": socket.gethostname(), "time": time.time(),
            "exit_code": returncode if returncode >= 0 else 128 - returncode,
            "signal": -returncode if returncode < 0 else None}
  path = pathlib.Path(workdir) / "exits" / f"rank{rank}-{pid}.json"
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, sort_keys=True) + "\n")
    os.replace(tmp, path)
  except OSError:
    pass
  return record


def read_exits(workdir: str | os.PathLike, since: float = 0.0) -> list[dict[str, Any]]:
  """The guards' exit records written at or after ``since`` (Unix seconds), earliest first."""
  out = []
  directory = pathlib.Path(workdir) / "exits"
  for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
    try:
      record = json.loads(path.read_text())
    except (OSError, ValueError):
      continue
    if float(record.get("time", 0.0)) >= since:
      out.append(record)
  return sorted(out, key=lambda r: r["time"])


def main(argv: list[str]) -> int:
  """``--workdir=W -- command...``: runs the command, records its end, returns its exit status."""
  if len(argv) < 3 or not argv[0].startswith("--workdir=") or argv[1] != "--":
    print("usage: python -m hetpipe_jax.mpi.rank_guard --workdir=W -- command ...", file=sys.stderr)
    return 2
  workdir = argv[0].split("=", 1)[1]
  child = subprocess.Popen(argv[2:], close_fds=False)  # pylint: disable=consider-using-with  # PMI's fd stays open
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda s, _: child.send_signal(s))
  code = child.wait()
  write_exit(workdir, rank_of_environment(os.environ), child.pid, code)
  return code if code >= 0 else 128 - code


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
