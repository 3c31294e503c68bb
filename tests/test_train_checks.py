"""``hetpipe_jax.train``'s refusals of bad input, in one process: every rank of the job's world refuses before any
communication.

``train.main`` runs as each rank ``r`` of a world of ``n`` in turn, with a stand-in communicator that answers only
``Get_rank`` and ``Get_size``: the job's first collective (the barrier after every rank's checks) would end the run, so
a bad setting must be refused on every rank before it, with one ``error:`` line, exit 2 and no summary. This process
has 8 CPU devices: a case setting ``config.num_cpu_devices`` sees that many (``jax.local_devices`` cut to them), as
its own process would. One case of each kind of check (before jax, the world size, a sharded PS's layout, the
local device count, the mode) also runs under ``mpiexec`` (one ``error:`` line over all ranks, non-zero exit, no
hang): ``tests/test_mpi_job.py::test_bad_input_fails_fast_on_every_rank``.
"""

from __future__ import annotations

import sys
import types

import pytest

from hetpipe_jax.paths import REPO_ROOT
from tests.test_mpi_job import BAD_INPUTS


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
  import importlib
  module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
  config = module.get_config()
  config.lock()
  for key, value in overrides.items():
    config[key] = value
  return config


def _main_as_rank(monkeypatch, capsys, rank, size, config, workdir, mode):
  """``train.main`` as rank ``rank`` of ``size``; returns ``(exit code or None, stderr)``."""
  from absl import logging
  from hetpipe_jax import train
  monkeypatch.setattr(logging, "set_verbosity", lambda v: None)  # main sets the process's verbosity per rank
  mpi4py = types.ModuleType("mpi4py")
  mpi4py.MPI = types.SimpleNamespace(COMM_WORLD=_ChecksOnlyComm(rank, size))
  monkeypatch.setitem(sys.modules, "mpi4py", mpi4py)
  monkeypatch.setattr(train, "_REPORT_GRACE_S", 0.0)
  for name, value in (("_CONFIG", config), ("_WORKDIR", str(workdir)), ("_PLAN", None), ("_MODE", mode),
                      ("_RESUME", False)):
    monkeypatch.setattr(train, name, types.SimpleNamespace(value=value))
  capsys.readouterr()
  try:
    train.main([])
    code = None
  except SystemExit as e:
    code = e.code
  return code, capsys.readouterr().err


@pytest.mark.parametrize("overrides,num_ranks,message,config,extra_args", BAD_INPUTS)
def test_bad_input_is_refused_on_every_rank_before_any_communication(tmp_path, monkeypatch, capsys,
                                                                     synthetic_data_dir, overrides, num_ranks,
                                                                     message, config, extra_args):
  """Every case of ``BAD_INPUTS``, on every rank of its world."""
  import jax
  monkeypatch.chdir(REPO_ROOT)
  if overrides.get("num_cpu_devices"):  # the forced host-device count of the case's own process
    devices = jax.local_devices()[:overrides["num_cpu_devices"]]
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: list(devices))
  mode = "virtual" if "--mode=virtual" in extra_args else "mpi"
  assert set(extra_args) <= {"--mode=virtual"}
  workdir = tmp_path / "run"
  for rank in range(num_ranks):
    cfg = _config(config, {"data_dir": str(synthetic_data_dir), "check_counts": False, "progress": False, **overrides})
    code, err = _main_as_rank(monkeypatch, capsys, rank, num_ranks, cfg, workdir, mode)
    assert code == 2, (rank, code, err[-3000:])
    assert message in err, (rank, err[-3000:])
    assert err.count("error:") == 1, (rank, err)  # one clear message per rank; rank 0's alone under mpiexec
    assert (err.startswith("error: ") if rank == 0 else f"error: [rank {rank}] " in err), (rank, err)
    assert not (workdir / "summary.json").exists()
