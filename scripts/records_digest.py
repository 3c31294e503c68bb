"""Digests of a run's records, to show that a change of code leaves what a job writes unchanged.

Hashes ``minibatches.jsonl``, ``ps_applied.jsonl``, ``metrics.jsonl``, ``config.json``, ``summary.json`` and the
final weights (``checkpoint/``) of each run directory, leaving out what differs between two runs of the same code:
host wall-clock fields (:data:`WALL_CLOCK_KEYS`; under MPI, every time and rate and whatever the ranks' timing
decides, :data:`MPI_TIMING_KEYS`), checkpoint sizes (orbax's metadata holds timestamps) and the paths of the run
directory and of the directory above it (the run set's, which holds the data). Two checkouts agree when every digest
does.

  .venv/bin/python scripts/records_digest.py --run=/tmp/before           # runs :data:`JOBS`, writes digests.json
  .venv/bin/python scripts/records_digest.py --redigest=/tmp/before      # digests.json again from its runs
  .venv/bin/python scripts/records_digest.py DIR [DIR ...]               # digests existing run directories
  .venv/bin/python scripts/records_digest.py --compare=a.json,b.json    # exit 1 when any digest differs
  .venv/bin/python scripts/records_digest.py --smoke                    # seconds: a hand-made run directory
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RECORD_FILES = ("minibatches.jsonl", "ps_applied.jsonl", "metrics.jsonl", "config.json", "summary.json")
# Host clocks and file sizes: differ between two runs of the same code in every mode.
WALL_CLOCK_KEYS = frozenset({"host_wall_time_s", "seconds", "checkpoint_seconds_total", "start_unix_s", "bytes"})
# Under MPI, times are wall-clock and what the ranks' timing decides (waits, PS order, emulation overruns) differs
# between two runs; the settings, counts and record structure do not.
MPI_TIMING_KEYS = frozenset({
    "wall_time_s", "minibatches_per_s", "images_per_s", "wait_s", "idle_s", "inject_time_s", "complete_time_s",
    "host_busy_s", "update_s", "overrun_s", "num_overruns", "barrier_s", "ps_channel_s", "allreduce_s",
    "checkpoint_barrier_fraction", "seconds_per_vw", "max_concurrent_tasks", "peak_inflight_per_stage",
    "ps_channel", "ps_bytes", "num_pulls", "version_id", "version_local_updates", "version_global_clock",
    "version_vector_clock", "loss", "test_accuracy", "test_loss", "final_train_loss", "evaluations", "extra_updates",
    "max_clock_distance", "applied_waves_in_order", "applied_clock_aligned", "replica_sha256", "ps_staleness",
    "bytes", "trace_counts", "local_clock_at_injection", "ps_shards", "wave", "global_clock_at_pull"})


def _strip(value: Any, drop: frozenset, workdir: str) -> Any:
  if isinstance(value, dict):
    return {k: _strip(v, drop, workdir) for k, v in value.items() if k not in drop}
  if isinstance(value, list):
    return [_strip(v, drop, workdir) for v in value]
  if isinstance(value, str) and workdir:
    parent = str(pathlib.Path(workdir).parent)
    return value.replace(workdir, "<workdir>").replace(parent, "<runs>")
  return value


def _hash(obj: Any) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _weights_digest(path: pathlib.Path) -> str | None:
  if not path.exists():
    return None
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.jobs import checkpoint  # pylint: disable=g-import-not-at-top
  leaves = jax.tree_util.tree_leaves(checkpoint.restore_weights(path))
  h = hashlib.sha256()
  for leaf in leaves:
    h.update(np.ascontiguousarray(leaf, dtype="<f4").tobytes())
  return h.hexdigest()[:16]


def digest(workdir: str | pathlib.Path, mpi: bool | None = None) -> dict[str, Any]:
  """Per record file its digest (None: absent) and ``weights``: the final weights' (skipped under MPI, whose
  weights depend on the ranks' timing).

  Args:
    workdir: a finished run's directory.
    mpi: leave out :data:`MPI_TIMING_KEYS` too (None: when summary.json's ``mode`` is ``"mpi"``).
  """
  wd = pathlib.Path(workdir)
  summary = json.loads((wd / "summary.json").read_text()) if (wd / "summary.json").exists() else {}
  if mpi is None:
    mpi = summary.get("mode") == "mpi"
  drop = WALL_CLOCK_KEYS | (MPI_TIMING_KEYS if mpi else frozenset())
  out: dict[str, Any] = {}
  for name in RECORD_FILES:
    path = wd / name
    if not path.exists():
      out[name] = None
      continue
    text = path.read_text()
    if name.endswith(".jsonl"):
      rows = [json.loads(line) for line in text.splitlines() if line.strip()]
      if mpi:  # the ranks' timing orders the lines
        rows = sorted((_strip(r, drop, str(wd)) for r in rows), key=lambda r: json.dumps(r, sort_keys=True))
      out[name] = _hash([_strip(r, drop, str(wd)) for r in rows])
    else:
      out[name] = _hash(_strip(json.loads(text), drop, str(wd)))
  out["weights"] = None if mpi else _weights_digest(wd / "checkpoint")
  return out


# The job set: (name, mode, config overrides). Small runs on the synthetic Fashion-MNIST written by --run.
_TINY = {"num_minibatches": 8, "emulate_stage_ms": "10,20", "progress": False, "check_counts": False}
JOBS = (
    ("hetpipe", "virtual", {}),
    ("hetpipe_clip_ckpt", "virtual", {"grad_clip_norm": 0.5, "checkpoint_every_waves": 2}),
    ("pipedream_vsync", "virtual", {"method": "pipedream", "vertical_sync": True}),
    ("gpipe", "virtual", {"method": "gpipe"}),
    ("1f1b_flush", "virtual", {"method": "1f1b_flush"}),
    ("horovod", "virtual", {"method": "horovod", "num_stages": 1, "emulate_stage_ms": "20"}),
    ("hetpipe_dc", "virtual", {"delay_compensation": "dc"}),
    ("hetpipe_inverse", "virtual", {"ps_staleness_scaling": "inverse"}),
    ("main_mpi", "mpi", {"num_minibatches": 6, "check_counts": False, "progress": False,
                         "checkpoint_every_waves": 0}),
)


def redigest(out: pathlib.Path) -> dict[str, Any]:
  """The digests of the runs of :data:`JOBS` already in ``out`` (written again to ``out/digests.json``)."""
  results = {name: digest(out / name) for name, _, _ in JOBS if (out / name).exists()}
  (out / "digests.json").write_text(json.dumps(results, indent=2, sort_keys=True))
  return results


def run_jobs(out: pathlib.Path, only: set[str] | None = None) -> dict[str, Any]:
  """Runs :data:`JOBS` (``hetpipe_jax.train``) into ``out/<name>`` on synthetic data; returns the digests."""
  from hetpipe_jax.data import synthetic  # pylint: disable=g-import-not-at-top
  data = out / "data"
  if not data.exists():
    synthetic.write_synthetic_fashion_mnist(data, num_train=512, num_test=256)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO)
  py = str(REPO / ".venv" / "bin" / "python")
  results = {}
  for name, mode, over in JOBS:
    if only and name not in only:
      continue
    wd = out / name
    if mode == "virtual":
      args = [py, "-m", "hetpipe_jax.train", "--mode=virtual", "--config=experiments/configs/tiny.py"]
      over = {**_TINY, **over}
    else:  # the main job (experiments/configs/default.py and its plan) in smoke size
      args = [str(REPO / ".venv" / "bin" / "mpiexec"), "-n", "3", py, "-m", "mpi4py", "-m", "hetpipe_jax.train",
              "--config=experiments/configs/default.py"]
    args += [f"--workdir={wd}", f"--config.data_dir={data}"] + [f"--config.{k}={v}" for k, v in over.items()]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
      raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    results[name] = digest(wd)
  (out / "digests.json").write_text(json.dumps(results, indent=2, sort_keys=True))
  return results


def compare(a: dict, b: dict) -> list[str]:
  """The ``run/file`` digests that differ between two digest tables (runs in only one are named too)."""
  diffs = []
  for run in sorted(set(a) | set(b)):
    if run not in a or run not in b:
      diffs.append(f"{run}: only in {'first' if run in a else 'second'}")
      continue
    diffs += [f"{run}/{f}" for f in sorted(set(a[run]) | set(b[run])) if a[run].get(f) != b[run].get(f)]
  return diffs


def _smoke() -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    wd = pathlib.Path(tmp)
    (wd / "minibatches.jsonl").write_text('{"vw_id": 0, "minibatch_id": 0, "complete_time_s": 1.0}\n')
    (wd / "summary.json").write_text(json.dumps({"mode": "virtual", "host_wall_time_s": 3.0,
                                                 "checkpoint": f"{wd}/checkpoint"}))
    first = digest(wd)
    (wd / "summary.json").write_text(json.dumps({"mode": "virtual", "host_wall_time_s": 4.0,
                                                 "checkpoint": f"{wd}/checkpoint"}))
    second = digest(wd)
    assert first == second, (first, second)
    return first


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("workdirs", nargs="*")
  p.add_argument("--run", help="run the job set into this directory")
  p.add_argument("--only", default="", help="comma-separated job names of --run")
  p.add_argument("--redigest", help="digest the job set's runs in this directory again")
  p.add_argument("--compare", help="two digests.json files, comma-separated")
  p.add_argument("--smoke", action="store_true")
  a = p.parse_args()
  if a.smoke:
    print(json.dumps(_smoke()))
  elif a.compare:
    first, second = (json.loads(pathlib.Path(x).read_text()) for x in a.compare.split(","))
    diffs = compare(first, second)
    print(json.dumps({"runs": len(first), "differ": diffs}, indent=2))
    sys.exit(1 if diffs else 0)
  elif a.redigest:
    print(json.dumps(redigest(pathlib.Path(a.redigest)), indent=2))
  elif a.run:
    print(json.dumps(run_jobs(pathlib.Path(a.run), set(filter(None, a.only.split(",")))), indent=2))
  else:
    print(json.dumps({w: digest(w) for w in a.workdirs}, indent=2))


if __name__ == "__main__":
  main()
