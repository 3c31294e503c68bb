"""``hetpipe_jax.train``'s refusals of bad input: every rank of the job's world refuses before any communication.

``train.main`` runs as each rank ``r`` of a world of ``n`` in turn, with a stand-in communicator that answers only
``Get_rank`` and ``Get_size``: the job's first collective (the barrier after every rank's checks) would end the run, so
a bad setting must be refused on every rank before it, with one ``error:`` line, exit 2 and no summary. Every case of
``BAD_INPUTS`` runs in one child process (``tests/train_checks_child.py``: importing ``hetpipe_jax.train`` into
pytest's process would define its absl flags beside ``hetpipe_jax.launch``'s). One case of each kind of check (before
jax, the world size, a sharded PS's layout, the local device count, the mode) also runs under ``mpiexec`` (one
``error:`` line over all ranks, non-zero exit, no hang): ``tests/test_mpi_job.py::test_bad_input_fails_fast_on_every_
rank``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax.paths import REPO_ROOT
from tests.test_mpi_job import BAD_INPUTS


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, synthetic_data_dir) -> list[list[dict]]:
  """Per case of ``BAD_INPUTS``, per rank of its world: what ``train.main`` did (one child process for all)."""
  root = tmp_path_factory.mktemp("train_checks")
  cases = []
  for i, (overrides, num_ranks, _, config, extra_args) in enumerate(BAD_INPUTS):
    assert set(extra_args) <= {"--mode=virtual"}
    cases.append({"config": config, "num_ranks": num_ranks, "workdir": str(root / f"case{i}" / "run"),
                  "mode": "virtual" if "--mode=virtual" in extra_args else "mpi",
                  "overrides": {"data_dir": str(synthetic_data_dir), "check_counts": False, "progress": False,
                                **overrides}})
  (root / "cases.json").write_text(json.dumps(cases))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  proc = subprocess.run([sys.executable, "-m", "tests.train_checks_child", str(root / "cases.json"),
                         str(root / "results.json")], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  results = json.loads((root / "results.json").read_text())
  assert [len(rows) for rows in results] == [b[1] for b in BAD_INPUTS]
  return results


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)),
                         ids=[f"{i}-{'-'.join(b[0]) or 'world_size'}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_is_refused_on_every_rank_before_any_communication(refusals, case):
  """Every case of ``BAD_INPUTS``, on every rank of its world."""
  message = BAD_INPUTS[case][2]
  for row in refusals[case]:
    rank, code, err = row["rank"], row["code"], row["stderr"]
    assert code == 2, (rank, code, err[-3000:])
    assert message in err, (rank, err[-3000:])
    assert err.count("error:") == 1, (rank, err)  # one clear message per rank; rank 0's alone under mpiexec
    (line,) = [x for x in err.splitlines() if "error:" in x]  # beside the job's log lines
    assert line.startswith(f"error: [rank {rank}] " if rank else "error: ") and (rank or "[rank" not in line), err
    assert not row["summary_exists"]
