"""Launching the real entry point under mpiexec from tests, with a timeout."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from hetpipe_jax.paths import REPO_ROOT

BIN = pathlib.Path(sys.executable).parent


def mpiexec() -> str:
  exe = BIN / "mpiexec"
  return str(exe) if exe.exists() else "mpiexec"


def run_job(workdir, num_ranks: int, overrides: dict, config: str = "experiments/configs/tiny.py",
            timeout: float = 240, extra_args: tuple = ()) -> subprocess.CompletedProcess:
  """Runs ``hetpipe_jax.train`` on ``num_ranks`` ranks; returns the completed process (never hangs past timeout)."""
  args = [mpiexec(), "-n", str(num_ranks), sys.executable, "-m", "mpi4py", "-m", "hetpipe_jax.train",
          f"--config={config}", f"--workdir={workdir}"]
  overrides = {"check_counts": False, "progress": False, **overrides}
  args += [f"--config.{k}={v}" for k, v in overrides.items()] + list(extra_args)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  env["PYTHONPATH"] = str(REPO_ROOT)
  return subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def read_jsonl(path) -> list[dict]:
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
