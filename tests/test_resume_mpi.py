"""Fault drills under mpiexec (issue 9): kill -9 of a VW rank after a checkpoint, resume to the end with every wave
applied once and the WSP bounds holding across the resume; a NaN update refused by the PS with one message."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from hetpipe_jax.jobs import checkpoint
from hetpipe_jax.paths import REPO_ROOT
from tests.mpi_util import mpiexec, read_jsonl, run_job

pytestmark = pytest.mark.mpi

# Nm = 1, D = 0, momentum SGD and the clock-aligned PS: every addition happens in one fixed order, so an interrupted
# and resumed run must end with the uninterrupted run's weights (on receipt, the PS adds in arrival order, which
# varies between runs by a float rounding). Momentum has a state per VW: a resumed VW must continue from the
# checkpoint's, not from a fresh one (constant-rate SGD, stateless, would not tell them apart).
DRILL = {"num_virtual_workers": 2, "num_minibatches": 24, "num_inflight": 1, "staleness_bound": 0,
         "optimizer": "momentum", "learning_rate": 0.05, "batch_size": 16, "checkpoint_every_waves": 6,
         "emulate_stage_ms": "20,20", "ps_apply": "clock_aligned"}


def _start(workdir, overrides) -> subprocess.Popen:
  args = [mpiexec(), "-n", "3", sys.executable, "-m", "mpi4py", "-m", "hetpipe_jax.train",
          "--config=experiments/configs/tiny.py", f"--workdir={workdir}"]
  args += [f"--config.{k}={v}" for k, v in {"check_counts": False, "progress": False, **overrides}.items()]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  return subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _vw_rank_pids(workdir) -> list[int]:
  """PIDs of the job's Python ranks, by process start; the last two are the VWs (rank 0 starts first)."""
  out = subprocess.run(["pgrep", "-f", f"hetpipe_jax.train .*--workdir={workdir}"], capture_output=True, text=True)
  pids = [int(p) for p in out.stdout.split()]
  pids = [p for p in pids if "mpiexec" not in pathlib_read(f"/proc/{p}/cmdline")]
  return sorted(pids)


def pathlib_read(path: str) -> str:
  try:
    with open(path, "rb") as f:
      return f.read().replace(b"\0", b" ").decode(errors="replace")
  except OSError:
    return ""


def test_kill_a_vw_after_a_checkpoint_then_resume_to_the_end(tmp_path, synthetic_data_dir):
  overrides = {"data_dir": synthetic_data_dir, **DRILL}
  full = run_job(tmp_path / "full", 3, overrides)
  assert full.returncode == 0, full.stderr[-3000:]
  workdir = tmp_path / "drill"
  proc = _start(workdir, overrides)
  deadline = time.time() + 120
  while not (workdir / "checkpoints" / "6").exists():
    assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:] if proc.poll() else "timeout"
    time.sleep(0.02)
  pids = _vw_rank_pids(workdir)
  assert len(pids) == 3, pids
  os.kill(pids[-1], signal.SIGKILL)
  killed = time.time()
  proc.wait(timeout=30)
  assert time.time() - killed < 10 and proc.returncode != 0
  assert not (workdir / "summary.json").exists()
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert steps and steps[-1] < 24, steps
  resumed = run_job(workdir, 3, overrides, extra_args=("--resume",))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert [r["global_clock"] for r in summary["resumes"]] == [steps[-1]]
  # Every wave applied exactly once over the whole run (the PS log across the resume), in the clock-aligned order.
  applied = [(a["wave_id"], a["vw_id"]) for a in read_jsonl(workdir / "ps_applied.jsonl")]
  assert applied == [(w, v) for w in range(24) for v in range(2)]
  # WSP across the resume: every minibatch's weights within D = 0 of its clock, records of both parts present once.
  records = read_jsonl(workdir / "minibatches.jsonl")
  assert sorted((r["vw_id"], r["minibatch_id"]) for r in records) == [(v, p) for v in range(2) for p in range(24)]
  for r in records:
    assert r["version_global_clock"] >= r["local_clock_at_injection"] - 0, r
    assert r["version_local_updates"] == r["minibatch_id"], r  # Nm = 1
  # The resumed run ends where the uninterrupted one does.
  a = checkpoint.restore_weights(tmp_path / "full" / "checkpoint")
  b = checkpoint.restore_weights(workdir / "checkpoint")
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=0)
  assert json.loads((workdir / "config.json").read_text())["checkpoint_every_waves"] == 6


def test_a_nan_update_is_refused_with_one_message_and_the_checkpoint_stays_loadable(tmp_path, synthetic_data_dir):
  workdir = tmp_path / "run"
  proc = run_job(workdir, 3, {"data_dir": synthetic_data_dir, **DRILL, "checkpoint_every_waves": 4,
                              "debug_nan_update": "1:6"}, timeout=120)
  assert proc.returncode != 0
  assert "error: VW 1's update of wave 6 has 1 NaN/Inf values: refused before it touched the global weights" \
      in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.count("error:") == 1
  assert not (workdir / "summary.json").exists()
  store = checkpoint.TrainingCheckpoints(workdir)
  step, weights, _, meta = store.restore_latest()
  store.close()
  assert step == 4 and meta["global_clock"] == 4
  assert all(np.isfinite(w).all() for w in jax.tree.leaves(weights))
