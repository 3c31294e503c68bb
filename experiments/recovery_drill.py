"""Fault drills for ``launch --max_restarts``: kill or stop a rank of a running job and check that it recovers.

Each drill launches the tiny MLP on the 4-node ED plan (``experiments/plans/local_cpu_4node_mlp_tiny_ed.json``, every
node on localhost) with stage ranks (one rank per stage) and one PS shard per node, 12 ranks: shards 0-3 on nodes
n0-n3, the VWs' drivers 4 and 5 (stage 0, on n2), VW 0's stage ranks 6-8 and VW 1's 9-11 (on n0, n1, n3). It
checkpoints every ``--checkpoint_every_waves`` clock ticks, waits for a checkpoint, injects its fault, and waits for
the launcher:

* ``vw``: ``kill -9`` VW 0's driver (rank 4; a transient fault: the same plan is resumed);
* ``stage``: ``kill -9`` a stage rank (rank 6, VW 0's stage 1);
* ``shard``: ``kill -9`` a PS shard (rank 1);
* ``ps``: ``kill -9`` the lead PS shard (rank 0);
* ``hang``: ``SIGSTOP`` VW 1's driver (rank 5): the PS's watchdog (``--watchdog_s``) names it and the job restarts;
* ``node``: node ``n2`` stops answering the launcher's probe (``--node_probe`` finds a file the drill writes), then
  ``kill -9`` its shard (rank 2): the launcher re-plans ED on ``n0, n1, n3`` and resumes on the new plan (3 shards,
  new stage ranks).

``--sequence`` runs the drills in one launch instead, one fault after each restart's next checkpoint (``--smoke``:
the stage, vw, shard and hang faults in one launch of 200 minibatches, on the same layout over the 2-node ED plan
``experiments/plans/local_cpu_2node_mlp_tiny_ed_local.json``: 6 ranks, the drivers 2 and 3, VW 0's stage rank 4).

Checks per drill (oracles written here, apart from the job's code): the launcher exits 0 after exactly one restart
per fault; each restart names the rank the drill hit; every VW's waves ``0..W-1`` appear exactly once on every shard
in ``ps_applied.jsonl`` (none lost, none applied twice across the restarts); every minibatch ran on weights whose
global clock is at least its wave minus D (WSP, HetPipe §5), in every segment; the first loss logged after each
resume is no jump over the losses logged just before the checkpoint it resumed from. Measured: detection (fault →
the failed attempt's end), restart (→ the next attempt's start, re-planning included), and time lost (the drill's
wall time minus a clean run's, ``--clean``, per fault), against the goal checkpoint interval + 60 s.

  .venv/bin/python experiments/recovery_drill.py [--drills=vw,stage,shard,ps,hang,node] [--output_dir=runs/recovery_drill]
  .venv/bin/python experiments/recovery_drill.py --smoke   # CI: stage, vw, shard and hang in one 2-node launch

Writes ``recovery_drill.json`` and ``recovery_drill.md`` in ``--output_dir`` and prints the JSON.
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
from hetpipe_jax import flag_checks  # noqa: E402
from hetpipe_jax.jobs.job_config import plan_nodes  # noqa: E402
from hetpipe_jax.mpi import rank_records  # noqa: E402
from hetpipe_jax.planning.plan_format import load_plan  # noqa: E402
from hetpipe_jax.recovery import newest_checkpoint  # noqa: E402
from hetpipe_jax.paths import REPO_ROOT  # noqa: E402

_DRILLS = flags.DEFINE_list("drills", ["vw", "stage", "shard", "ps", "hang", "node"],
                            "Which drills: vw, stage, shard, ps, hang, node.")
_SEQUENCE = flags.DEFINE_bool("sequence", False, "Run the drills' faults one after another in one launch.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs/recovery_drill", "Where the drills' runs and reports go.")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "Fashion-MNIST-format data ('' = a small synthetic set, made here).")
_MINIBATCHES = flags.DEFINE_integer("num_minibatches", 1200, "Minibatches per VW.")
_CKPT = flags.DEFINE_integer("checkpoint_every_waves", 40, "Checkpoint interval (global clock ticks).")
_WATCHDOG_S = flags.DEFINE_float("watchdog_s", 20.0, "The PS's watchdog limit for the run (seconds).")
_CLEAN = flags.DEFINE_bool("clean", True, "Also time a run without a fault (time lost = drill - clean).")
_SMOKE = flags.DEFINE_bool("smoke", False, "CI: the stage, vw, shard and hang faults in one launch of 200 minibatches, "
                           "no clean run.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 600.0, "Longest a drill may take.")
_CACHE = flags.DEFINE_string("compilation_cache", "auto", "launch --compilation_cache for every launch ('' = none: "
                             "each restart compiles its stage programs again).")

PLAN = "experiments/plans/local_cpu_4node_mlp_tiny_ed.json"
SMOKE_PLAN = "experiments/plans/local_cpu_2node_mlp_tiny_ed_local.json"  # the same layout on 2 nodes: 6 ranks
# In turn on n1, n0, n1, n0: a rank failing again on the node of the previous failure would count the node as gone.
SMOKE_FAULTS = ["stage", "vw", "shard", "hang"]
DRILLS = ("vw", "stage", "shard", "ps", "hang", "node")


def targets(num_nodes: int) -> dict[str, tuple[int, signal.Signals]]:
  """Each drill's rank and signal on an ED plan of ``num_nodes`` nodes and 2 VWs with stage ranks and one shard per
  node: shards ``0..S-1`` (S = ``num_nodes``), drivers ``S, S+1``, then VW 0's stage ranks (the rank layout rule,
  :func:`hetpipe_jax.mpi.rank_layout.stage_rank_layout`). The node drill loses node ``n2`` and kills its shard."""
  return {"vw": (num_nodes, signal.SIGKILL), "stage": (num_nodes + 2, signal.SIGKILL), "shard": (1, signal.SIGKILL),
          "ps": (0, signal.SIGKILL), "hang": (num_nodes + 1, signal.SIGSTOP), "node": (2, signal.SIGKILL)}


def _launch(plan: str, workdir: pathlib.Path, data_dir: str, probe_dir: pathlib.Path, num_minibatches: int, ckpt: int,
            watchdog_s: float, max_restarts: int) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
  argv = [sys.executable, "-m", "hetpipe_jax.launch", f"--plan={plan}", "--config=experiments/configs/tiny.py",
          f"--workdir={workdir}", "--stage_ranks", f"--max_restarts={max_restarts}", f"--watchdog_s={watchdog_s}",
          f"--node_probe=test ! -e {probe_dir}/down_{{node}}", f"--compilation_cache={_CACHE.value}", "--",
          f"--config.data_dir={data_dir}", "--config.check_counts=False", "--config.progress=False",
          f"--config.num_minibatches={num_minibatches}", f"--config.checkpoint_every_waves={ckpt}",
          "--config.log_every_waves=5"]
  log = open(workdir.parent / f"{workdir.name}.log", "w", encoding="utf-8")  # pylint: disable=consider-using-with
  return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_drill(plan: str, name: str, faults: list[str], out: pathlib.Path, data_dir: str, num_minibatches: int,
              ckpt: int, watchdog_s: float) -> dict:
  """Runs one launch with ``faults`` (drill names, one after each restart's next checkpoint; [] for a clean run) and
  checks it (module docstring); returns its row."""
  workdir = out / name
  probe_dir = out / f"{name}_probe"
  probe_dir.mkdir(parents=True, exist_ok=True)
  t0 = time.time()
  proc = _launch(plan, workdir, data_dir, probe_dir, num_minibatches, ckpt, watchdog_s, max_restarts=len(faults))
  hits = targets(len(plan_nodes(load_plan(plan))))
  row: dict = {"drill": name, "faults": []}
  since, after = t0, -1  # the current attempt's start; the checkpoint it resumed from
  deadline = time.time() + _TIMEOUT_S.value
  for k, fault in enumerate(faults):
    while proc.poll() is None and time.time() < deadline:
      newest = newest_checkpoint(workdir)
      procs = rank_records.read_procs(workdir, since)
      if newest is not None and newest > after and len(procs) == procs_expected(procs):
        break
      time.sleep(0.05)
    rank, sig = hits[fault]
    if fault == "node":
      (probe_dir / "down_n2").write_text("")
    hit = {"fault": f"{signal.Signals(sig).name} rank {rank} ({fault})", "fault_at": time.time(),
           "checkpoint_before_fault": newest_checkpoint(workdir), "target_rank": rank, "drill": fault}
    if proc.poll() is None and rank in procs:
      os.kill(int(procs[rank]["pid"]), sig)
    row["faults"].append(hit)
    while proc.poll() is None and time.time() < deadline and len(read_jsonl(workdir / "restarts.jsonl")) <= k:
      time.sleep(0.05)
    restarts = read_jsonl(workdir / "restarts.jsonl")
    if len(restarts) > k:
      since, after = restarts[k]["restarted_at"], restarts[k]["resume_from"] if restarts[k]["resume_from"] else -1
  try:
    code = proc.wait(timeout=max(1.0, deadline - time.time()))
  except subprocess.TimeoutExpired:
    proc.kill()
    code = "timeout"
  row["exit_code"] = code
  row["wall_s"] = time.time() - t0
  if not faults:
    return row
  restarts = read_jsonl(workdir / "restarts.jsonl")
  summary = json.loads((workdir / "summary.json").read_text()) if (workdir / "summary.json").exists() else {}
  row["restarts"] = len(restarts)
  for hit, r in zip(row["faults"], restarts):
    hit.update(cause=r["cause"], rank_named=r["rank"], role=r["role"], gone_nodes=r["gone_nodes"],
               new_plan=r["new_plan"], resume_from=r["resume_from"],
               detection_s=r["failed_at"] - hit["fault_at"], restart_s=r["restarted_at"] - r["failed_at"])
  metrics = read_jsonl(workdir / "metrics.jsonl")
  for hit in row["faults"]:
    hit["loss_jump"] = loss_jump(metrics, hit.get("resume_from") or 0)
    hit["ok"] = bool(hit.get("rank_named") == hit["target_rank"] and hit["loss_jump"]["ok"]
                     and (hit["drill"] != "node" or hit.get("gone_nodes") == ["n2"])
                     and (hit["drill"] != "hang" or hit.get("cause") == "hang"))
  if summary:
    n = summary["num_virtual_workers"]
    num_waves = summary["global_clock"]  # every VW did every wave (a resume onto a new plan may change Nm)
    row["applied"] = applied_once(read_jsonl(workdir / "ps_applied.jsonl"), n, num_waves)
    records = read_jsonl(workdir / "minibatches.jsonl")
    row["num_records"] = len(records)
    row["wsp_violations"] = len(wsp_violations(records, summary["staleness_bound"]))
    row["test_accuracy"] = summary.get("test_accuracy")
    row["num_vws_after"] = n
    row["num_ps_shards_after"] = summary.get("num_ps_shards")
  row["ok"] = bool(code == 0 and row["restarts"] == len(faults) and summary and not any(row["applied"].values())
                   and row["wsp_violations"] == 0 and row["num_records"] == summary["num_minibatches"]
                   and all(h["ok"] for h in row["faults"]))
  return row


def procs_expected(procs: dict) -> int:
  """The world size the current attempt's process records name (every rank has started once all are there)."""
  return max((int(p["world_size"]) for p in procs.values()), default=-1)


def main(argv) -> None:
  del argv
  if _SMOKE.value:
    flag_checks.refuse_replaced("--smoke", ["drills", "num_minibatches", "checkpoint_every_waves", "sequence"])
  out, data_dir = output_and_data(_OUTPUT_DIR.value, _DATA_DIR.value)
  drills = SMOKE_FAULTS if _SMOKE.value else list(_DRILLS.value)
  unknown = sorted(set(drills) - set(DRILLS))
  if unknown:
    raise app.UsageError(f"--drills: unknown {', '.join(unknown)}; use some of {', '.join(DRILLS)}")
  plan = SMOKE_PLAN if _SMOKE.value else PLAN
  num_mb = 200 if _SMOKE.value else _MINIBATCHES.value
  ckpt = 5 if _SMOKE.value else _CKPT.value
  watchdog_s = min(_WATCHDOG_S.value, 8.0) if _SMOKE.value else _WATCHDOG_S.value
  launches = [("sequence", drills)] if _SMOKE.value or _SEQUENCE.value else [(d, [d]) for d in drills]
  for name, _ in launches:
    if (out / name).exists():
      raise app.UsageError(f"{out / name} exists: choose a new --output_dir")
  rows = [run_drill(plan, name, faults, out, data_dir, num_mb, ckpt, watchdog_s) for name, faults in launches]
  clean = None
  if _CLEAN.value and not _SMOKE.value:
    clean = run_drill(plan, "clean", [], out, data_dir, num_mb, ckpt, watchdog_s)
    for row in rows:
      row["time_lost_s"] = row["wall_s"] - clean["wall_s"]
      row["time_lost_per_fault_s"] = row["time_lost_s"] / len(row["faults"])
  report = {"plan": plan, "layout": "stage ranks (one per stage), one PS shard per node",
            "compilation_cache": _CACHE.value,
            "num_minibatches_per_vw": num_mb, "checkpoint_every_waves": ckpt, "watchdog_s": watchdog_s,
            "clean_wall_s": clean["wall_s"] if clean else None, "drills": rows,
            "all_ok": all(r["ok"] for r in rows)}
  (out / "recovery_drill.json").write_text(json.dumps(report, indent=1, sort_keys=True, default=str) + "\n")
  (out / "recovery_drill.md").write_text(table(rows))
  print(json.dumps(report, sort_keys=True, default=str))
  if not report["all_ok"]:
    sys.exit(1)


def table(rows: list[dict]) -> str:
  """The drills' Markdown table: one line per fault (time lost: per fault of its launch)."""
  lines = ["| drill | fault | cause named | rank | detection s | restart s | time lost s | resumed from | waves lost | "
           "applied twice | WSP violations | loss jump ok | ok |", "|" + "---|" * 13]
  for r in rows:
    lost = f"{r['time_lost_per_fault_s']:.1f}" if "time_lost_per_fault_s" in r else "-"
    applied = r.get("applied", {})
    for h in r["faults"]:
      lines.append(f"| {r['drill']} | {h['fault']} | {h.get('cause')} | {h.get('rank_named')} | "
                   f"{h.get('detection_s', float('nan')):.1f} | {h.get('restart_s', float('nan')):.2f} | {lost} | "
                   f"{h.get('resume_from')} | {len(applied.get('missing', []))} | {len(applied.get('twice', []))} | "
                   f"{r.get('wsp_violations')} | {h.get('loss_jump', {}).get('ok')} | {r['ok'] and h['ok']} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  app.run(main)
