"""Load on the parameter server: many VWs of a tiny model under one PS and under several shards, D = 0 and D = 4.

Each case is one MPI run (``experiments/configs/tiny.py`` with ``--model``, by default ``mlp_deep``: a tiny MLP of 4
layers with parameters, 2 stages per VW; every rank a process on this machine) and is checked with the same oracles
as the recovery drills (``experiments/run_checks.py``): every VW's waves applied exactly once on every shard, every
minibatch within WSP's bound D (HetPipe §5) and, for D > 0, the bound reached; the run's minibatch count. Reported
per case: wall time, minibatches/s and the PS's per-wave service time (from a wave update's arrival to applied, with
the pulls it unblocked sent; ``summary.json``'s ``ps_service``).

  .venv/bin/python experiments/ps_load.py [--num_vws=16] [--shards=1,4] [--bounds=0,4] [--output_dir=runs/ps_load]
  .venv/bin/python experiments/ps_load.py --smoke   # CI: 4 VWs, 2 shards, D = 4, a few waves

Several shards: each layer lives on one shard and a shard must hold some (``default`` placement, HetPipe §8.1), so
``mlp_deep``'s 4 layers with parameters fill at most 4 shards (``mlp_tiny``'s 3). Every case checkpoints every
``--checkpoint_every_waves`` clock ticks: the cut (every shard's slice and log, every VW's optimizer state) at 16
VWs, with the same checks across the barriers.

Writes ``ps_load.json`` and ``ps_load.md`` in ``--output_dir`` and prints the JSON; exits 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

if str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:  # run as a file: find the package
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

from experiments.run_checks import applied_once, max_staleness, output_and_data, read_jsonl, wsp_violations  # noqa: E402
from hetpipe_jax import flag_checks  # noqa: E402
from hetpipe_jax.paths import REPO_ROOT  # noqa: E402

_NUM_VWS = flags.DEFINE_integer("num_vws", 16, "Virtual workers (one MPI rank each).")
_SHARDS = flags.DEFINE_list("shards", ["1", "4"], "PS shard counts (at most the model's layers with parameters).")
_MODEL = flags.DEFINE_string("model", "mlp_deep", "The model (a registry name; mlp_deep fills 4 shards).")
_CKPT = flags.DEFINE_integer("checkpoint_every_waves", 10, "Checkpoint interval (clock ticks; 0: none).")
_BOUNDS = flags.DEFINE_list("bounds", ["0", "4"], "Staleness bounds D.")
_MINIBATCHES = flags.DEFINE_integer("num_minibatches", 60, "Minibatches per VW.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs/ps_load", "Where the runs and the report go.")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "Fashion-MNIST-format data ('' = a small synthetic set, made here).")
_SMOKE = flags.DEFINE_bool("smoke", False, "CI: 4 VWs, 2 shards, D = 4, 12 minibatches per VW.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 900.0, "Longest one case may take.")


def run_case(out: pathlib.Path, data_dir: str, num_vws: int, shards: int, bound: int, num_mb: int) -> dict:
  """One MPI run of ``shards + num_vws`` ranks; returns its row with the checks."""
  workdir = out / f"vws{num_vws}_shards{shards}_d{bound}"
  mpiexec = pathlib.Path(sys.executable).parent / "mpiexec"
  argv = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(shards + num_vws), sys.executable, "-m", "mpi4py",
          "-m", "hetpipe_jax.train", "--config=experiments/configs/tiny.py", f"--workdir={workdir}",
          f"--config.model={_MODEL.value}",
          f"--config.data_dir={data_dir}", "--config.check_counts=False", "--config.progress=False",
          f"--config.num_virtual_workers={num_vws}", f"--config.num_ps_shards={shards}",
          f"--config.staleness_bound={bound}", f"--config.num_minibatches={num_mb}",
          f"--config.checkpoint_every_waves={0 if _SMOKE.value else _CKPT.value}", "--config.log_every_waves=5",
          "--config.optimizer=sgd",
          "--config.learning_rate=0.05"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  t0 = time.time()
  try:
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S.value,
                          check=False)
    code, tail = proc.returncode, proc.stderr[-2000:]
  except subprocess.TimeoutExpired:
    code, tail = "timeout", ""
  row: dict = {"num_vws": num_vws, "num_ps_shards": shards, "staleness_bound": bound, "exit_code": code,
               "wall_s": time.time() - t0}
  summary_path = workdir / "summary.json"
  if code != 0 or not summary_path.exists():
    return {**row, "ok": False, "error": tail}
  summary = json.loads(summary_path.read_text())
  records = read_jsonl(workdir / "minibatches.jsonl")
  applied = applied_once(read_jsonl(workdir / "ps_applied.jsonl"), num_vws, summary["global_clock"])
  reached = max_staleness(records)
  row.update(num_minibatches=summary["num_minibatches"], num_records=len(records),
             minibatches_per_s=summary["minibatches_per_s"], training_wall_s=summary["wall_time_s"],
             ps_service=summary.get("ps_service"), applied=applied,
             wsp_violations=len(wsp_violations(records, bound)), max_staleness=reached,
             checkpoints=[c["global_clock"] for c in summary.get("checkpoints", [])],
             checkpoint_barrier_fraction=summary.get("checkpoint_barrier_fraction"))
  every, total = summary["checkpoint_every_waves"], summary["global_clock"]
  expected = sorted({*range(every, total, every), total}) if every else []  # the multiples of the interval, the end
  row["ok"] = bool(not any(applied.values()) and row["wsp_violations"] == 0 and len(records) == num_vws * num_mb
                   and summary["num_minibatches"] == num_vws * num_mb and (bound == 0 or reached == bound)
                   and row["checkpoints"] == expected)
  return row


def main(argv) -> None:
  del argv
  out, data_dir = output_and_data(_OUTPUT_DIR.value, _DATA_DIR.value)
  if _SMOKE.value:
    flag_checks.refuse_replaced("--smoke", ["shards", "bounds", "num_vws", "num_minibatches", "checkpoint_every_waves"])
    cases, num_vws, num_mb = [(2, 4)], 4, 12
  else:
    cases = [(int(s), int(d)) for s in _SHARDS.value for d in _BOUNDS.value]
    num_vws, num_mb = _NUM_VWS.value, _MINIBATCHES.value
  rows = []
  for shards, bound in cases:
    rows.append(run_case(out, data_dir, num_vws, shards, bound, num_mb))
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "applied"}, default=str), file=sys.stderr, flush=True)
  report = {"config": "experiments/configs/tiny.py", "model": _MODEL.value, "num_minibatches_per_vw": num_mb,
            "cases": rows,
            "all_ok": all(r["ok"] for r in rows)}
  (out / "ps_load.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
  lines = ["| VWs | shards | D | wall s | minibatches/s | PS service ms per wave (mean / p95 / max) | waves lost | "
           "applied twice | WSP violations | staleness reached | ok |", "|" + "---|" * 11]
  for r in rows:
    svc = r.get("ps_service") or {}
    svc_text = (f"{svc['mean_ms']:.2f} / {svc['p95_ms']:.2f} / {svc['max_ms']:.2f}" if svc else "-")
    a = r.get("applied", {})
    lines.append(f"| {r['num_vws']} | {r['num_ps_shards']} | {r['staleness_bound']} | {r['wall_s']:.1f} | "
                 f"{r.get('minibatches_per_s', float('nan')):.1f} | {svc_text} | {len(a.get('missing', []))} | "
                 f"{len(a.get('twice', []))} | {r.get('wsp_violations')} | {r.get('max_staleness')} | {r['ok']} |")
  (out / "ps_load.md").write_text("\n".join(lines) + "\n")
  print(json.dumps(report, default=str))
  if not report["all_ok"]:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
