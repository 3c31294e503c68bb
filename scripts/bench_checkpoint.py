"""What checkpoints cost the default job: the same MPI run with and without checkpoints, alternated, printing JSON.

  .venv/bin/python scripts/bench_checkpoint.py [--repeats=1] [--layout=one_ps|stage_ranks_shards] \
      [--num_minibatches=N] [--smoke --data_dir=DIR]

Each repeat runs the default config (experiments/configs/default.py, 3 MPI ranks) twice, back to back: at the
default interval (``checkpoint_every_waves`` of the config) and with ``checkpoint_every_waves=0`` (only the final
weights are saved). The overhead is the ratio of the two wall times of one repeat (issue 9 target: at most 5% at the
default interval). Odd repeats run the pair in the other order (without checkpoints first), so a drift of the machine
between the two runs of a pair does not always count against the same side; ``cpu_s_with``/``cpu_s_without`` are
the CPU seconds of all the run's processes (``getrusage`` of the children), a second, less load-sensitive view.
The JSON also gives each checkpoint's size and save time and the slowest VW's share of the wall
time spent in checkpoint barriers (``checkpoint_barrier_fraction`` of summary.json, measured inside the run).
``--layout``: ``one_ps`` (3 ranks: one PS, one process per VW) or ``stage_ranks_shards`` (6 ranks: two PS shards,
each VW's second stage on a stage rank; the checkpoint cut gathers every shard's slice and every stage rank's
optimizer state). ``--num_minibatches``: minibatches per VW instead of the config's epochs (the interval stays the
default; ``num_checkpoints`` in the JSON says how many the run made). ``--smoke`` (CI, seconds): 8 minibatches per VW
with a checkpoint every 2 waves, on ``--data_dir``.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position

from hetpipe_jax import flag_checks  # pylint: disable=wrong-import-position
from hetpipe_jax.paths import REPO_ROOT  # pylint: disable=wrong-import-position

_REPEATS = flags.DEFINE_integer("repeats", 1, "Pairs of runs (with, without checkpoints).")
_SMOKE = flags.DEFINE_bool("smoke", False, "8 minibatches per VW, a checkpoint every 2 waves (seconds; CI).")
_MINIBATCHES = flags.DEFINE_integer("num_minibatches", 0, "Minibatches per VW (0: the config's epochs).")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Fashion-MNIST directory (default: the config's).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the runs go (default: a temporary directory).")
_LAYOUT = flags.DEFINE_enum("layout", "one_ps", list(("one_ps", "stage_ranks_shards")),
                            "one_ps: 3 ranks; stage_ranks_shards: 2 PS shards and a stage rank per VW (6 ranks).")
LAYOUTS = {"one_ps": (3, []), "stage_ranks_shards": (6, ["--config.stage_ranks=True", "--config.num_ps_shards=2"])}

TARGET_OVERHEAD = 0.05


def _run(workdir: pathlib.Path, every: int | None, extra: list[str]) -> dict:
  """One MPI run of the default config in ``--layout``; returns its summary.json."""
  num_ranks, layout_args = LAYOUTS[_LAYOUT.value]
  extra = [*layout_args, *extra]
  args = [str(REPO_ROOT / ".venv/bin/mpiexec"), "-n", str(num_ranks), sys.executable, "-m", "mpi4py", "-m", "hetpipe_jax.train",
          "--config=experiments/configs/default.py", f"--workdir={workdir}", "--config.progress=False", *extra]
  if every is not None:
    args.append(f"--config.checkpoint_every_waves={every}")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  proc = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  if proc.returncode != 0:
    raise SystemExit(f"error: the run in {workdir} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  summary = json.loads((workdir / "summary.json").read_text())
  cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
  return {**summary, "cpu_s": cpu_s}


def main(argv):
  del argv
  extra = []
  if _SMOKE.value:
    flag_checks.refuse_replaced("--smoke", ["num_minibatches"])
    extra += ["--config.num_minibatches=8", "--config.eval_every_epochs=0", "--config.check_counts=False"]
  elif _MINIBATCHES.value:
    extra.append(f"--config.num_minibatches={_MINIBATCHES.value}")
  if _DATA_DIR.value:
    extra.append(f"--config.data_dir={_DATA_DIR.value}")
  every = 2 if _SMOKE.value else None  # None: the config's default interval, as the user runs it
  root = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="bench_checkpoint_"))
  pairs = []
  for r in range(_REPEATS.value):
    if r % 2 == 0:
      with_ckpt = _run(root / f"r{r}_ckpt", every, extra)
      without = _run(root / f"r{r}_none", 0, extra)
    else:
      without = _run(root / f"r{r}_none", 0, extra)
      with_ckpt = _run(root / f"r{r}_ckpt", every, extra)
    pairs.append({
        "first": "with" if r % 2 == 0 else "without",
        "wall_time_s_with": with_ckpt["wall_time_s"], "wall_time_s_without": without["wall_time_s"],
        "overhead": with_ckpt["wall_time_s"] / without["wall_time_s"] - 1.0,
        "cpu_s_with": round(with_ckpt["cpu_s"], 2), "cpu_s_without": round(without["cpu_s"], 2),
        "cpu_overhead": with_ckpt["cpu_s"] / without["cpu_s"] - 1.0,
        "checkpoint_every_waves": with_ckpt["checkpoint_every_waves"],
        "num_checkpoints": len(with_ckpt["checkpoints"]),
        "checkpoint_mb": [round(c["bytes"] / 1e6, 3) for c in with_ckpt["checkpoints"]],
        "checkpoint_seconds": [round(c["seconds"], 3) for c in with_ckpt["checkpoints"]],
        "checkpoint_seconds_total": with_ckpt["checkpoint_seconds_total"],
        "checkpoint_barrier_fraction": with_ckpt["checkpoint_barrier_fraction"],
        "test_accuracy_with": with_ckpt["test_accuracy"], "test_accuracy_without": without["test_accuracy"]})
  overhead = statistics.median(p["overhead"] for p in pairs)
  cpu_overhead = statistics.median(p["cpu_overhead"] for p in pairs)
  print(json.dumps({"machine": {"python": platform.python_version(), "cpus": os.cpu_count()}, "smoke": _SMOKE.value,
                    "layout": _LAYOUT.value, "num_minibatches_per_vw": _MINIBATCHES.value or None,
                    "workdir": str(root), "pairs": pairs, "median_overhead": overhead,
                    "median_cpu_overhead": cpu_overhead,
                    "target_overhead": None if _SMOKE.value else TARGET_OVERHEAD,
                    "meets_target": None if _SMOKE.value else overhead <= TARGET_OVERHEAD}, indent=1))


if __name__ == "__main__":
  app.run(main)
