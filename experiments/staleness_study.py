r"""Staleness and its remedies: held-out quality of HetPipe and PipeDream at Nm in {1, 2, 4} and D in {0, 1, 4}.

HetPipe's speed comes from staleness: up to Nm minibatches in flight inside a VW (each gradient taken at weights up
to Nm - 1 local updates old) and up to D waves of drift between VWs (HetPipe §4-§5). This study measures what that
staleness costs in held-out quality after a fixed number of minibatches, and what the remedies buy back: optimizers
made for delay (``nadam`` with b1 = 0.99, ``nadamw``, ``muon``), delay-compensated gradients
(``delay_compensation=dc``, DC-ASGD), staleness-scaled wave updates at the PS (``ps_staleness_scaling``) and, where
the checkout has them, weight prediction and PipeMare's in-VW step scaling.

Every row is one ``python -m hetpipe_jax.train --mode=virtual`` run in its own process (virtual time: the numerics
are exact whatever the timing; the task times are synthetic, ``emulate_stage_ms``, or a paper-scale ``timing_plan``).
Its command is recorded in the results and each finished run is kept under ``--output_dir/runs/`` (rerunning the
script reuses them; ``--rerun`` starts afresh), so a grid can run in batches (``--groups``, ``--rows``) and the tables
are rebuilt from whatever has finished.

* Models (``TASKS``): ``lm``: ``gpt_bytes`` on the text corpus (``fortunes``), held-out bits/byte after
  ``--lm_minibatches`` minibatches in all (every VW together); ``cnn``: the default CNN on Fashion-MNIST, test
  accuracy after one epoch.
* Variants (``VARIANTS``): an optimizer and its settings, plus at most the remedies; each names the variant whose
  Nm = 1, D = 0 run is its reference (same optimizer, same data order: a remedy that is the identity without
  staleness shares its optimizer's reference).
* The grid (``GRID``): rows of (group, task, method, variant, VWs, Nm, D, seeds), grouped by the goal they measure.
* Time to target on the paper's cluster (group ``paper``): the proxy ``mlp_tiny`` numerics under the VGG-19 timing
  plans that ``compare`` and ``experiments/paper/convergence.py`` make (ED-local HetPipe, Horovod on the paper's 16
  GPUs, 1F1B-flush at its planned M), with the cost model calibrated on the paper's Horovod cells.

Run from the repo root (full mode: ``nice -n 10``, minutes to hours on 2 cores; see REPRODUCTION.md):

  nice -n 10 .venv/bin/python experiments/staleness_study.py --jobs=2 --output_dir=experiments/results/staleness
  .venv/bin/python experiments/staleness_study.py --quick --text_dir=DIR --fashion_dir=DIR --output_dir=/tmp/s  # CI

Writes ``staleness_study.json``, ``staleness_study.md`` and ``staleness_study.png`` into ``--output_dir`` (and, with
``--results_dir``, ``staleness.json`` for REPRODUCTION.md) and prints a JSON summary (the goals and the table; its
``output``: the full JSON's path), which ``scripts/record.py`` can keep. ``--aggregate_only`` rebuilds everything
from the finished runs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time

if str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:  # run as a file: find the package
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags, logging  # noqa: E402

from experiments.staleness_grid import (EXTENSION, GRID, HETPIPE_FIT, QUICK_GRID, RERUN_COMMAND, VARIANTS,  # noqa: E402
                                        Row, Task, make_tasks)
from experiments.staleness_report import (PAPER_GROUPS, aggregate, goals, markdown, paper_results,  # noqa: E402
                                          paper_time_to_target, partial_record, plot,
                                          time_to_target, value_at)  # noqa: F401  (re-exported)
from hetpipe_jax import flag_checks  # noqa: E402
from hetpipe_jax.paths import REPO_ROOT, write_json  # noqa: E402



def available_fields() -> set[str]:
  """The config fields this checkout's default config has (a variant's ``needs`` is checked against them)."""
  from experiments.configs import default  # pylint: disable=g-import-not-at-top
  return set(default.get_config().keys())


def num_train(task: Task) -> int:
  """Training examples of ``task``'s data (to turn evaluation counts into ``eval_every_epochs``)."""
  if task.name == "lm" or task.overrides.get("dataset") == "text":
    from hetpipe_jax.data import text  # pylint: disable=g-import-not-at-top
    from hetpipe_jax import models  # pylint: disable=g-import-not-at-top
    model = task.overrides.get("model", "gpt_bytes")
    seq_len = models.load_model(model).input_shape[0]
    return len(text.load_text_dataset(text.parse_paths(task.overrides.get("data_dir", "")), seq_len).train_inputs)
  return 0


def run_config(task: Task, row: Row, seed: int, plans: dict, n_train: int) -> dict:
  """The config fields of one run (besides the config file's)."""
  v = VARIANTS[row.variant]
  f = {**task.overrides, **v.overrides, "method": row.method, "num_virtual_workers": row.num_vws,
       "num_inflight": row.nm, "staleness_bound": row.d, "seed": seed}
  allreduce = row.method in ("horovod", "1f1b_flush", "gpipe")
  f["num_stages"] = 1 if row.method == "horovod" else task.num_stages
  if task.name == "paper":
    plan = plans[row.timing]
    if (plan["num_vws"], plan["num_inflight"]) != (row.num_vws, row.nm):
      raise ValueError(f"{row.key}: the {row.timing} timing plan has {plan['num_vws']} VWs and Nm/M "
                       f"{plan['num_inflight']}; the row asks {row.num_vws} and {row.nm}")
    f.update(timing_plan=plan["path"], num_virtual_workers=plan["num_vws"], num_stages=plan["num_stages"][0],
             num_inflight=row.nm)
    f.pop("emulate_stage_ms", None)
    if allreduce:
      f["pull_every_wave"] = True
  elif row.method == "horovod":
    f["emulate_stage_ms"] = "20"
  if allreduce:  # the all-reduce methods average the VWs' gradients: N times the rate (the linear scaling rule)
    base = f.get("learning_rate", 1e-3)
    f["learning_rate"] = base * f["num_virtual_workers"]
  if task.minibatches:
    per_vw = task.minibatches // f["num_virtual_workers"]
    f["num_minibatches"] = per_vw
    if n_train:
      f["eval_every_epochs"] = per_vw / (task.evals + 1) / (n_train // f["num_virtual_workers"] // f.get(
          "batch_size", 32))
  else:
    f["eval_every_epochs"] = f.get("num_epochs", 1.0) / (task.evals + 1)
  return f


def command(task: Task, fields: dict, workdir: pathlib.Path) -> list[str]:
  """The run's command line (recorded; replayable from the repo root)."""
  return [".venv/bin/python", "-m", "hetpipe_jax.train", "--mode=virtual", f"--config={task.config}",
          f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in fields.items()]


def run_one(task: Task, row: Row, seed: int, fields: dict, out: pathlib.Path, rerun: bool, timeout_s: int,
            start: bool = True, kept: dict | None = None) -> dict:
  """Runs (or reuses) one seed of ``row``; returns its record (the command, the config, the curve, the result).

  Reused: a finished record with the same command (``out/runs/<key>.json``, else ``kept``: the one the results file
  keeps, :func:`kept_records`; a failed run runs again), or a finished run directory (``summary.json``) whose
  ``<key>.cmd`` is the same command (a run that outlived the study process that started it; while its ``<key>.pid``
  runs, this waits).
  """
  key = f"{row.key}.s{seed}"
  record_path = out / "runs" / f"{key}.json"
  cmd_path = out / "runs" / f"{key}.cmd"
  workdir = out / "runs" / key
  cmd = command(task, fields, workdir)
  if record_path.exists() and not rerun:
    rec = json.loads(record_path.read_text())
    if rec["command"] == shlex.join(cmd) and rec["returncode"] == 0:
      return rec
  elif kept is not None and not rerun and kept.get("returncode") == 0 and kept.get("command") == shlex.join(cmd):
    return kept
  pid_path = out / "runs" / f"{key}.pid"
  same = not rerun and cmd_path.exists() and cmd_path.read_text() == shlex.join(cmd)
  if same and pid_path.exists():  # started by an earlier study process and maybe still running: wait for it
    pid = int(pid_path.read_text())
    while _alive(pid):
      time.sleep(10)
  if same and (workdir / "summary.json").exists():
    rec = _record(task, row, seed, fields, cmd, workdir, None, 0, "")
  elif not start:  # --wait_only: a run that ended without its summary is not started again
    return {"key": key, "row": dataclasses.asdict(row), "seed": seed, "command": shlex.join(cmd),
            "returncode": None}
  else:
    if workdir.exists():
      shutil.rmtree(workdir)
    cmd_path.parent.mkdir(parents=True, exist_ok=True)
    cmd_path.write_text(shlex.join(cmd))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(os.environ.get("TMPDIR", "/tmp")) /
                                                     "hetpipe_staleness_jax_cache"))
    logging.info("[staleness] run %s: %s", key, shlex.join(cmd))
    t0 = time.perf_counter()
    with subprocess.Popen([sys.executable] + cmd[1:], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
      pid_path.write_text(str(proc.pid))
      try:
        output, _ = proc.communicate(timeout=timeout_s)
      except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    rec = _record(task, row, seed, fields, cmd, workdir, time.perf_counter() - t0, proc.returncode, output)
  write_json(rec, record_path)
  logging.info("[staleness] %s: %s in %s host s", key, rec.get("final", "failed"), rec["host_s"])
  return rec


def _alive(pid: int) -> bool:
  """Whether process ``pid`` exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except OSError:
    return False


def _record(task: Task, row: Row, seed: int, fields: dict, cmd: list[str], workdir: pathlib.Path,
            host_s: float | None, returncode: int, output: str) -> dict:
  """A finished run's record, read from its ``summary.json`` (checked against the fields the study asked for)."""
  rec = {"key": f"{row.key}.s{seed}", "row": dataclasses.asdict(row), "seed": seed, "command": shlex.join(cmd),
         "config": fields, "host_s": host_s, "returncode": returncode}
  if returncode != 0:
    rec["error"] = output[-2000:]
    logging.warning("[staleness] %s failed (exit %d): %s", rec["key"], returncode, rec["error"][-500:])
    return rec
  s = json.loads((workdir / "summary.json").read_text())
  for k in ("method", "num_virtual_workers", "num_inflight", "staleness_bound"):
    if s[k] != fields[k]:
      raise RuntimeError(f"{workdir}/summary.json says {k}={s[k]!r}, the study asked {fields[k]!r}")
  bits = task.metric == "test_bits_per_byte"
  mb_per_clock = s["num_minibatches"] / max(1, s["global_clock"])

  def quality(e):
    return e["test_loss"] / math.log(2) if bits else e["test_accuracy"]

  curve = [(e["global_clock"] * mb_per_clock, e["simulated_time_s"], quality(e)) for e in s["evaluations"]]
  if not curve or curve[-1][0] < s["num_minibatches"]:
    curve.append((s["num_minibatches"], s["simulated_time_s"], s[task.metric]))
  if rec["host_s"] is None:
    rec["host_s"] = s.get("host_wall_time_s")
  rec.update(final=s[task.metric], curve=curve, num_minibatches=s["num_minibatches"],
             num_minibatches_per_vw=s["num_minibatches_per_vw"], simulated_time_s=s["simulated_time_s"],
             minibatches_per_s=s["minibatches_per_s"], optimizer=s["optimizer"],
             method_settings=s.get("method_settings"), extra_updates=s.get("extra_updates"),
             dataset_info=_dataset_info(workdir))
  for big in ("checkpoint", "minibatches.jsonl"):  # the record keeps what the tables need
    p = workdir / big
    if p.is_dir():
      shutil.rmtree(p, ignore_errors=True)
    else:
      p.unlink(missing_ok=True)
  return rec


def _dataset_info(workdir: pathlib.Path) -> dict:
  try:
    return json.loads((workdir / "config.json").read_text()).get("dataset_info", {})
  except (OSError, ValueError):
    return {}


def paper_plans(out: pathlib.Path, rows) -> dict[str, dict]:
  """The paper-scale VGG-19 timing plans of the ``paper`` rows on the calibrated ``hetpipe_paper`` cluster:
  ED-local HetPipe at Nm 4 (4 VWs), Horovod on the paper's 16 GPUs and 1F1B-flush at the planner's allocation and M.
  """
  want = sorted({r.timing for r in rows if r.task == "paper"})
  if not want:
    return {}
  from experiments.paper import timing_plans  # pylint: disable=g-import-not-at-top
  plans = {}
  # a timing key "hetpipe" is the plan on the Horovod-fitted cluster, "hetpipe@hetpipe_fit" on the HetPipe-fitted one
  for cal, suffix, sub in (("horovod", "", "plans"), ("hetpipe", HETPIPE_FIT, "plans_hetpipe_fit")):
    names = [w.removesuffix(suffix) for w in want if (w.endswith(suffix) if suffix else "@" not in w)]
    if names:
      got = timing_plans.vgg19_study_plans(out / sub, names, calibration=cal)
      plans.update({n + suffix: v for n, v in got.items()})
  return plans


def kept_records(out: pathlib.Path, quick: bool) -> dict[str, dict]:
  """The finished runs' records by key: those ``out/staleness_study.json`` keeps (of the same mode, ``quick``), then
  each ``out/runs/<key>.json``, which replaces its key's. The results file keeps every run's record, so a fresh
  clone (whose ``runs/`` folders are not committed) rebuilds the tables and adds runs to them.

  Raises:
    ValueError: ``out/staleness_study.json`` is not JSON (a run stopped while writing it: remove it to start afresh).
  """
  records: dict[str, dict] = {}
  kept = out / "staleness_study.json"
  if kept.exists():
    try:
      prev = json.loads(kept.read_text())
    except ValueError as e:
      raise ValueError(f"{kept} is not JSON ({e}): remove it to rebuild the tables from {out / 'runs'} alone") from e
    if prev.get("quick") == quick:
      records.update(prev.get("records", {}))
  for p in sorted((out / "runs").glob("*.json")) if (out / "runs").exists() else []:
    rec = json.loads(p.read_text())
    records[rec["key"]] = rec
  return records


def main(argv):
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  quick = FLAGS.quick
  if quick:  # its own grid (QUICK_GRID) and run lengths
    flag_checks.refuse_replaced("--quick", ["lm_minibatches", "extensions"])
  tasks = make_tasks(quick, FLAGS.lm_minibatches, FLAGS.text_dir, FLAGS.fashion_dir)
  grid = QUICK_GRID if quick else GRID + EXTENSION
  groups = sorted({r.group for r in grid})
  unknown = [g for g in FLAGS.groups if g not in groups]
  if unknown:
    raise app.UsageError(f"--groups: unknown {unknown}; known: {groups}")
  rows = [r for r in grid if (not FLAGS.groups or r.group in FLAGS.groups) and re.search(FLAGS.rows, r.key)
          and (quick or FLAGS.extensions or r in GRID)]
  out = pathlib.Path(FLAGS.output_dir or "runs/staleness_study")
  if not out.is_absolute():
    out = REPO_ROOT / out
  out.mkdir(parents=True, exist_ok=True)
  fields = available_fields()
  missing = {r.key: f"needs config.{VARIANTS[r.variant].needs}, which this checkout lacks" for r in grid
             if VARIANTS[r.variant].needs and VARIANTS[r.variant].needs not in fields}
  todo = [r for r in rows if r.key not in missing]
  t0 = time.perf_counter()
  plans = paper_plans(out, todo) if not FLAGS.aggregate_only else {}
  n_train = {name: num_train(t) for name, t in tasks.items()}
  jobs = sorted(((r, s) for r in todo for s in range(r.seeds)), key=lambda j: j[1])  # every row's seed 0 first
  if FLAGS.wait_only:  # only the runs an earlier study process started (their <key>.pid): wait, then read them
    jobs = [(r, s) for r, s in jobs if (out / "runs" / f"{r.key}.s{s}.pid").exists()]
  records = kept_records(out, quick)
  if not FLAGS.aggregate_only:
    with concurrent.futures.ThreadPoolExecutor(max(1, FLAGS.jobs)) as pool:
      futures = {pool.submit(run_one, tasks[r.task], r, s, run_config(tasks[r.task], r, s, plans, n_train[r.task]),
                             out, FLAGS.rerun, FLAGS.timeout_s, not FLAGS.wait_only, records.get(f"{r.key}.s{s}")):
                 (r, s) for r, s in jobs}
      for f in concurrent.futures.as_completed(futures):
        rec = f.result()
        if rec["returncode"] is not None:
          records[rec["key"]] = rec
  shown_rows = [r for r in grid if not FLAGS.groups or r.group in FLAGS.groups] if FLAGS.aggregate_only else rows
  if FLAGS.partial:  # unfinished runs' evaluations so far (a run killed or still running)
    for r in shown_rows:
      for seed in range(r.seeds):
        key = f"{r.key}.s{seed}"
        if records.get(key, {}).get("returncode") != 0:
          part = partial_record(tasks[r.task], r, seed, out)
          if part:
            records[key] = part
  at = {}
  for item in FLAGS.at_minibatches:
    name, _, n = item.partition("=")
    if name not in tasks or not n.isdigit():
      raise app.UsageError(f"--at_minibatches: {item!r} is not TASK=N with TASK in {sorted(tasks)}")
    at[name] = int(n)
  table = aggregate(tasks, shown_rows, records, missing, at)
  paper = {g: p for g in PAPER_GROUPS if (p := paper_time_to_target(table, records, tasks, g))}
  keys = {f"{r.key}.s{s}" for r in grid for s in range(r.seeds)}  # every row's runs: a subset's run keeps the rest
  result = {"experiment": "staleness and its remedies (issue 25 item 5), virtual time", "quick": quick,
            "tasks": {n: {"label": t.label, "metric": t.metric, "config": t.config, "minibatches": t.minibatches,
                          "overrides": t.overrides} for n, t in tasks.items()},
            "variants": {n: dataclasses.asdict(v) for n, v in VARIANTS.items()},
            "rows_requested": [r.key for r in rows], "not_run": {k: v for k, v in missing.items()
                                                               if k in {r.key for r in shown_rows}},
            "plans": plans, "table": table, "paper_time_to_target": paper,
            "records": {k: v for k, v in sorted(records.items()) if k in keys},
            "host_seconds": time.perf_counter() - t0,
            "command": shlex.join([".venv/bin/python", "experiments/staleness_study.py"] + sys.argv[1:]),
            "rerun_command": RERUN_COMMAND, "at_minibatches": at, "partial": FLAGS.partial}
  result["goals"] = goals(table, paper)
  md = markdown(result)
  (out / "staleness_study.md").write_text(md)
  plot(result, out / "staleness_study.png")
  result["markdown"] = md
  write_json(result, out / "staleness_study.json")
  if FLAGS.results_dir:
    write_json(paper_results(result, out / "staleness_study.png"), pathlib.Path(FLAGS.results_dir) / "staleness.json")
  # The last JSON document of stdout (scripts/record.py keeps it as a dated record): the goals and the table.
  print(json.dumps({"output": str(out / "staleness_study.json"), "command": result["command"],
                    "goals": result["goals"], "paper_time_to_target": paper,
                    "table": [{k: t[k] for k in ("key", "seeds_run", "seeds_requested", "quality",
                                                   "gap_to_reference", "not_run")} for t in table]}, indent=1))


def define_flags() -> None:
  """The script's flags (defined when it runs, so that tests can import it)."""
  flags.DEFINE_bool("quick", False, "Seconds-long end-to-end check (CI): tiny models, a few minibatches.")
  flags.DEFINE_string("output_dir", "", "Where runs and results go (default runs/staleness_study).")
  flags.DEFINE_list("groups", [], "Only these groups of GRID (default: all).")
  flags.DEFINE_string("rows", "", "Only rows whose key matches this regular expression (default: all).")
  flags.DEFINE_integer("jobs", 1, "Runs at a time (each is one process).")
  flags.DEFINE_bool("extensions", False, "Also run the EXTENSION rows (else they are reported as not run).")
  flags.DEFINE_bool("rerun", False, "Run every selected row again instead of reusing finished runs.")
  flags.DEFINE_list("at_minibatches", [], "TASK=N (e.g. lm=150): that task's quality is its evaluation at N "
                    "minibatches (every VW together) instead of the final one.")
  flags.DEFINE_bool("partial", False, "Also read unfinished runs (their metrics.jsonl evaluations so far); with "
                    "--at_minibatches they count where they reached that point.")
  flags.DEFINE_bool("wait_only", False, "Start no run: wait for the runs earlier study processes started (and "
                    "left running), record them, and rebuild the tables.")
  flags.DEFINE_bool("aggregate_only", False, "Run nothing: rebuild the tables from finished runs.")
  flags.DEFINE_string("text_dir", "", "The lm task's text ('' = /usr/share/games/fortunes).")
  flags.DEFINE_string("fashion_dir", "", "Fashion-MNIST directory ('' = the default lookup).")
  flags.DEFINE_integer("lm_minibatches", 600, "The lm task's minibatches in all (every VW together); 2,400 for "
                       "the issue's second point.")
  flags.DEFINE_integer("timeout_s", 3600, "Per run.")
  flags.DEFINE_string("results_dir", "", "Also write staleness.json (claims, table, plot) here for "
                      "experiments/paper/reproduction.py (REPRODUCTION.md): experiments/paper/results.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
