"""Runs ``hetpipe_jax.train.main`` as every rank of several bad-input cases' worlds, in this one process.

  python -m tests.train_checks_child CASES_JSON RESULTS_JSON

``CASES_JSON`` holds a list of cases ``{"config": path, "overrides": {...}, "num_ranks": n, "mode": "mpi"|"virtual",
"workdir": dir}``. For each case and each rank ``r`` of its world, ``train.main`` runs with a stand-in communicator
that answers only ``Get_rank`` and ``Get_size`` (any other call raises: the job passed its checks on that rank and
reached its first collective). ``RESULTS_JSON`` gets, per case, one ``{"rank", "code", "stderr",
"summary_exists"}`` per rank: ``code`` is the exit code ``train.main`` raised, or ``"communicated: ..."`` when the
rank got past every check, ``"raised <type>: <message>"`` for any other exception, or ``"returned"``.

A process of its own: importing ``hetpipe_jax.train`` defines its absl flags (``--config``, ``--workdir``, ...),
which clash with ``hetpipe_jax.launch``'s in a pytest process that imported both. Like the suite's processes, it has
8 forced CPU host devices; a case setting ``config.num_cpu_devices`` sees that many (``jax.local_devices`` cut to
them), as its own process would.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pathlib
import sys
import types

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


class _Communicated(Exception):
  """The job called the communicator beyond ``Get_rank``/``Get_size``: it passed its checks on this rank."""


class _ChecksOnlyComm:
  """Rank ``rank`` of a world of ``size``; any other call raises :class:`_Communicated`."""

  def __init__(self, rank: int, size: int):
    self.rank, self.size = rank, size

  def Get_rank(self):  # noqa: N802 (mpi4py's names)
    return self.rank

  def Get_size(self):  # noqa: N802
    return self.size

  def __getattr__(self, name):
    raise _Communicated(f"rank {self.rank} of {self.size} called comm.{name} after passing every check")


def _config(path: str, overrides: dict):
  """The config file's ``get_config()`` with ``overrides`` set (locked first, as ``--config`` locks it)."""
  module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
  config = module.get_config()
  config.lock()
  for key, value in overrides.items():
    config[key] = value
  return config


def _main_as_rank(train, rank: int, size: int, config, workdir: str, mode: str) -> tuple[object, str]:
  """``train.main`` as rank ``rank`` of ``size``; returns ``(exit code or what happened, stderr)``."""
  mpi4py = types.ModuleType("mpi4py")
  mpi4py.MPI = types.SimpleNamespace(COMM_WORLD=_ChecksOnlyComm(rank, size))
  sys.modules["mpi4py"] = mpi4py
  for name, value in (("_CONFIG", config), ("_WORKDIR", workdir), ("_PLAN", None), ("_MODE", mode),
                      ("_RESUME", False)):
    setattr(train, name, types.SimpleNamespace(value=value))
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    try:
      train.main([])
      code = "returned"
    except SystemExit as e:
      code = e.code
    except _Communicated as e:
      code = f"communicated: {e}"
    except Exception as e:  # pylint: disable=broad-except  # recorded: the other cases still run
      code = f"raised {type(e).__name__}: {e}"
  return code, err.getvalue()


def run_cases(cases: list[dict]) -> list[list[dict]]:
  """Every case on every rank of its world (see the module docstring); returns the per-rank results per case."""
  from absl import logging
  from hetpipe_jax import train
  import jax
  train._REPORT_GRACE_S = 0.0  # pylint: disable=protected-access  # no other rank to give the floor to
  all_devices = jax.local_devices
  verbosity = logging.get_verbosity()
  results = []
  for case in cases:
    if case["overrides"].get("num_cpu_devices"):  # the forced host-device count of the case's own process
      devices = all_devices()[:case["overrides"]["num_cpu_devices"]]
      jax.local_devices = lambda *a, _d=devices, **k: list(_d)
    rows = []
    for rank in range(case["num_ranks"]):
      config = _config(case["config"], case["overrides"])
      code, err = _main_as_rank(train, rank, case["num_ranks"], config, case["workdir"], case["mode"])
      rows.append({"rank": rank, "code": code, "stderr": err,
                   "summary_exists": (pathlib.Path(case["workdir"]) / "summary.json").exists()})
    jax.local_devices = all_devices
    logging.set_verbosity(verbosity)  # main sets it per rank
    results.append(rows)
  return results


def main(argv: list[str]) -> None:
  cases_path, results_path = argv
  cases = json.loads(pathlib.Path(cases_path).read_text())
  pathlib.Path(results_path).write_text(json.dumps(run_cases(cases), indent=1) + "\n")


if __name__ == "__main__":
  main(sys.argv[1:])
