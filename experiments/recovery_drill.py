"""Fault drills for ``launch --max_restarts``: kill or stop a rank of a running job and check that it recovers.

Each drill launches the tiny MLP on the 4-node ED plan (``experiments/plans/local_cpu_4node_mlp_tiny_ed.json``, every
node on localhost, one PS) with checkpoints every ``--checkpoint_every_waves`` clock ticks, waits for the first
checkpoint, injects its fault, and waits for the launcher:

* ``vw``: ``kill -9`` VW 0's rank (a transient fault: the same plan is resumed);
* ``ps``: ``kill -9`` the PS (rank 0);
* ``hang``: ``SIGSTOP`` VW 1's rank: the PS's watchdog (``--watchdog_s``) names it and the job restarts;
* ``node``: node ``n2`` stops answering the launcher's probe (``--node_probe`` finds a file the drill writes), then
  ``kill -9`` VW 0's rank, which runs a stage on ``n2``: the launcher re-plans ED on ``n0, n1, n3`` and resumes on the
  new plan.

Checks per drill (oracles written here, apart from the job's code): the launcher exits 0 after exactly one restart;
the restart names the rank the drill hit; every VW's waves ``0..W-1`` appear exactly once in ``ps_applied.jsonl``
(none lost, none applied twice across the restart); every minibatch ran on weights whose global clock is at least
its wave minus D (WSP, HetPipe §5), in every segment; the first loss logged after the resume is no jump over the
losses logged just before the checkpoint it resumed from. Measured: detection (fault → the failed attempt's end),
restart (→ the next attempt's start, re-planning included), and time lost (the drill's wall time minus a clean run's,
``--clean``), against the goal checkpoint interval + 60 s.

  .venv/bin/python experiments/recovery_drill.py [--drills=vw,ps,hang,node] [--output_dir=runs/recovery_drill]
  .venv/bin/python experiments/recovery_drill.py --smoke   # CI: the vw and hang drills, 200 minibatches

Writes ``recovery_drill.json`` and ``recovery_drill.md`` in ``--output_dir`` and prints the JSON. Drills with stage
ranks and several PS shards need checkpoints in those layouts, which the job does not write yet.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

if str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:  # run as a file: find the package
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

from experiments.run_checks import applied_once, loss_jump, output_and_data, read_jsonl, wsp_violations  # noqa: E402
from hetpipe_jax.recovery import newest_checkpoint  # noqa: E402
from hetpipe_jax.paths import REPO_ROOT  # noqa: E402

_DRILLS = flags.DEFINE_list("drills", ["vw", "ps", "hang", "node"], "Which drills: vw, ps, hang, node.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs/recovery_drill", "Where the drills' runs and reports go.")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "Fashion-MNIST-format data ('' = a small synthetic set, made here).")
_MINIBATCHES = flags.DEFINE_integer("num_minibatches", 1200, "Minibatches per VW.")
_CKPT = flags.DEFINE_integer("checkpoint_every_waves", 40, "Checkpoint interval (global clock ticks).")
_WATCHDOG_S = flags.DEFINE_float("watchdog_s", 20.0, "The PS's watchdog limit for the run (seconds).")
_CLEAN = flags.DEFINE_bool("clean", True, "Also time a run without a fault (time lost = drill - clean).")
_SMOKE = flags.DEFINE_bool("smoke", False, "CI: the vw and hang drills, 200 minibatches, no clean run.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 600.0, "Longest a drill may take.")

PLAN = "experiments/plans/local_cpu_4node_mlp_tiny_ed.json"
TARGETS = {"vw": (1, signal.SIGKILL), "ps": (0, signal.SIGKILL), "hang": (2, signal.SIGSTOP),
           "node": (1, signal.SIGKILL)}


def _launch(workdir: pathlib.Path, data_dir: str, probe_dir: pathlib.Path, num_minibatches: int, ckpt: int,
            watchdog_s: float, max_restarts: int) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
  argv = [sys.executable, "-m", "hetpipe_jax.launch", f"--plan={PLAN}", "--config=experiments/configs/tiny.py",
          f"--workdir={workdir}", "--num_ps_shards=1", f"--max_restarts={max_restarts}", f"--watchdog_s={watchdog_s}",
          f"--node_probe=test ! -e {probe_dir}/down_{{node}}", "--",
          f"--config.data_dir={data_dir}", "--config.check_counts=False", "--config.progress=False",
          f"--config.num_minibatches={num_minibatches}", f"--config.checkpoint_every_waves={ckpt}",
          "--config.ps_placement=default", "--config.log_every_waves=5"]
  log = open(workdir.parent / f"{workdir.name}.log", "w", encoding="utf-8")  # pylint: disable=consider-using-with
  return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_drill(name: str, out: pathlib.Path, data_dir: str, num_minibatches: int, ckpt: int, watchdog_s: float
              ) -> dict:
  """Runs one drill (module docstring); returns its row."""
  workdir = out / name
  probe_dir = out / f"{name}_probe"
  probe_dir.mkdir(parents=True, exist_ok=True)
  t0 = time.time()
  proc = _launch(workdir, data_dir, probe_dir, num_minibatches, ckpt, watchdog_s, max_restarts=1 if name != "clean"
                 else 0)
  row: dict = {"drill": name}
  if name != "clean":
    deadline = time.time() + _TIMEOUT_S.value
    while newest_checkpoint(workdir) is None and proc.poll() is None and time.time() < deadline:
      time.sleep(0.05)
    rank, sig = TARGETS[name]
    procs = {int(p.stem[4:]): json.loads(p.read_text()) for p in (workdir / "procs").glob("rank*.json")}
    if name == "node":
      (probe_dir / "down_n2").write_text("")
    row["fault_at"] = time.time()
    row["fault"] = f"{signal.Signals(sig).name} rank {rank}"
    row["checkpoint_before_fault"] = newest_checkpoint(workdir)
    os.kill(int(procs[rank]["pid"]), sig)
  try:
    code = proc.wait(timeout=_TIMEOUT_S.value)
  except subprocess.TimeoutExpired:
    proc.kill()
    code = "timeout"
  row["exit_code"] = code
  row["wall_s"] = time.time() - t0
  if name == "clean":
    return row
  restarts = read_jsonl(workdir / "restarts.jsonl")
  summary = json.loads((workdir / "summary.json").read_text()) if (workdir / "summary.json").exists() else {}
  row["restarts"] = len(restarts)
  if restarts:
    r = restarts[0]
    row.update(cause=r["cause"], rank_named=r["rank"], role=r["role"], gone_nodes=r["gone_nodes"],
               new_plan=r["new_plan"], resume_from=r["resume_from"],
               detection_s=r["failed_at"] - row["fault_at"], restart_s=r["restarted_at"] - r["failed_at"])
  if summary:
    n = summary["num_virtual_workers"]
    num_waves = summary["global_clock"]  # every VW did every wave (a resume onto a new plan may change Nm)
    row["applied"] = applied_once(read_jsonl(workdir / "ps_applied.jsonl"), n, num_waves)
    records = read_jsonl(workdir / "minibatches.jsonl")
    row["num_records"] = len(records)
    row["wsp_violations"] = len(wsp_violations(records, summary["staleness_bound"]))
    row["loss_jump"] = loss_jump(read_jsonl(workdir / "metrics.jsonl"), row.get("resume_from") or 0)
    row["test_accuracy"] = summary.get("test_accuracy")
    row["num_vws_after"] = n
  target_rank = TARGETS[name][0]
  row["ok"] = bool(code == 0 and row.get("restarts") == 1 and row.get("rank_named") == target_rank
                   and summary and not any(row["applied"].values()) and row["wsp_violations"] == 0
                   and row["num_records"] == summary["num_minibatches"] and row["loss_jump"]["ok"]
                   and (name != "node" or row.get("gone_nodes") == ["n2"])
                   and (name != "hang" or row.get("cause") == "hang"))
  return row


def main(argv) -> None:
  del argv
  out, data_dir = output_and_data(_OUTPUT_DIR.value, _DATA_DIR.value)
  drills = ["vw", "hang"] if _SMOKE.value else list(_DRILLS.value)
  unknown = sorted(set(drills) - set(TARGETS))
  if unknown:
    raise app.UsageError(f"--drills: unknown {', '.join(unknown)}; use some of {', '.join(TARGETS)}")
  num_mb = 200 if _SMOKE.value else _MINIBATCHES.value
  ckpt = 5 if _SMOKE.value else _CKPT.value
  watchdog_s = min(_WATCHDOG_S.value, 8.0) if _SMOKE.value else _WATCHDOG_S.value
  for name in drills:
    if (out / name).exists():
      raise app.UsageError(f"{out / name} exists: choose a new --output_dir")
  rows = [run_drill(name, out, data_dir, num_mb, ckpt, watchdog_s) for name in drills]
  clean = None
  if _CLEAN.value and not _SMOKE.value:
    clean = run_drill("clean", out, data_dir, num_mb, ckpt, watchdog_s)
    for row in rows:
      row["time_lost_s"] = row["wall_s"] - clean["wall_s"]
  report = {"plan": PLAN, "num_minibatches_per_vw": num_mb, "checkpoint_every_waves": ckpt, "watchdog_s": watchdog_s,
            "clean_wall_s": clean["wall_s"] if clean else None, "drills": rows,
            "all_ok": all(r["ok"] for r in rows)}
  (out / "recovery_drill.json").write_text(json.dumps(report, indent=1, sort_keys=True, default=str) + "\n")
  lines = ["| drill | fault | cause named | rank | detection s | restart s | time lost s | resumed from | waves lost | "
           "applied twice | WSP violations | loss jump ok | ok |", "|" + "---|" * 13]
  for r in rows:
    lost = f"{r['time_lost_s']:.1f}" if "time_lost_s" in r else "-"
    applied = r.get("applied", {})
    lines.append(f"| {r['drill']} | {r.get('fault')} | {r.get('cause')} | {r.get('rank_named')} | "
                 f"{r.get('detection_s', float('nan')):.1f} | {r.get('restart_s', float('nan')):.2f} | {lost} | "
                 f"{r.get('resume_from')} | {len(applied.get('missing', []))} | {len(applied.get('twice', []))} | "
                 f"{r.get('wsp_violations')} | {r.get('loss_jump', {}).get('ok')} | {r['ok']} |")
  (out / "recovery_drill.md").write_text("\n".join(lines) + "\n")
  print(json.dumps(report, sort_keys=True, default=str))
  if not report["all_ok"]:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
