"""WSP as the paper defines it vs our variants: PS application mode and pull policy, predicted and trained.

HetPipe §5: "When the parameter server receives the updates ũ from the virtual worker, the parameter server updates
the global version of the weights as w_global = w_global + ũ" (``ps_apply=on_receipt``), and a VW pulls only when
the staleness bound requires it (``pull_every_wave=False``). Our variants: ``ps_apply=clock_aligned`` (wave c is
added once every VW pushed it) and ``pull_every_wave=True`` (a non-waiting pull at every wave end). For each case:

* **engine**: the event engine's prediction for the case's task times under all four combinations: throughput,
  time waiting for the PS, pulls, and how many minibatches used weights with extra updates (faster VWs' waves beyond
  the global clock);
* **trained**: the real job under both ``ps_apply`` modes (the case's pull policy): test accuracy, the measured
  fraction of minibatches with extra updates, and the run's time, read from each run's ``summary.json``.

Cases: ``default`` is the main job (``experiments/configs/default.py`` under MPI: 2 VWs of the local_cpu plan, D = 1);
``het3_d2`` is 3 heterogeneous VWs (emulated stage times 1x, 1.5x, 3x) with D = 2 in virtual time (deterministic
simulated time with real numerics). Run from the repo root:

  .venv/bin/python experiments/wsp_study.py [--cases=default,het3_d2] [--engine_only] [--output_dir=runs/wsp_study]
  .venv/bin/python experiments/wsp_study.py --smoke --data_dir=DIR  # CI: tiny model, a few minibatches

Writes ``wsp_study.json``, ``wsp_study.md`` and ``wsp_study.png`` in ``--output_dir`` and prints the JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

if str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:  # run as a file: find the package
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags, logging  # noqa: E402

from hetpipe_jax import flag_checks  # noqa: E402
from hetpipe_jax.paths import REPO_ROOT, write_json  # noqa: E402

_CASES = flags.DEFINE_list("cases", ["default", "het3_d2"], "Cases to run (see the module docstring).")
_ENGINE_ONLY = flags.DEFINE_bool("engine_only", False, "Only the engine's predictions (seconds); no training runs.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Seconds-long end-to-end check (CI): mlp_tiny, 8 minibatches per VW.")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "Fashion-MNIST directory ('' = the default lookup).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "", "Where runs and results go (default runs/wsp_study-<time>).")
_HET3_EPOCHS = flags.DEFINE_float("het3_epochs", 2.0, "Epochs of the het3_d2 case (all VWs together).")
_TIMEOUT_S = flags.DEFINE_integer("timeout_s", 1800, "Per training run.")

PS_APPLY = ("on_receipt", "clock_aligned")
PULL_POLICIES = ((False, "paper: pull when the bound requires it"), (True, "ours: non-waiting pull every wave"))


@dataclasses.dataclass(frozen=True)
class Case:
  """One study case: a config file, overrides, and how it runs (``mpi`` ranks or ``virtual``)."""

  name: str
  config: str
  overrides: dict
  mode: str  # "mpi" or "virtual"
  num_vws: int
  description: str


def make_cases(smoke: bool, data_dir: str, het3_epochs: float) -> dict[str, Case]:
  """The study's cases; ``smoke`` shrinks each to a few minibatches of ``mlp_tiny`` (synthetic data allowed)."""
  common = {"progress": False}
  if data_dir:
    common["data_dir"] = data_dir
  het = {"plan": "", "num_virtual_workers": 3, "num_stages": 2, "staleness_bound": 2,
         "emulate_stage_ms": "20,20;30,30;60,60", "num_epochs": het3_epochs}
  if smoke:
    tiny = {"check_counts": False, "num_minibatches": 8, "eval_every_epochs": 0.0}
    return {
        "default": Case("default", "experiments/configs/tiny.py", {**common, **tiny, "emulate_stage_ms": "5,5"},
                        "mpi", 2, "smoke: tiny.py under MPI (2 VWs at 5 ms per stage, D = 1)"),
        "het3_d2": Case("het3_d2", "experiments/configs/tiny.py",
                        {**common, **tiny, **{k: v for k, v in het.items() if k != "num_epochs"}}, "virtual", 3,
                        "smoke: tiny.py, 3 VWs at 1x/1.5x/3x, D = 2, virtual time"),
    }
  return {
      "default": Case("default", "experiments/configs/default.py", dict(common), "mpi", 2,
                      "the main job: default.py under MPI (2 VWs x 2 stages of the local_cpu plan, Nm 2, D = 1)"),
      "het3_d2": Case("het3_d2", "experiments/configs/default.py", {**common, **het}, "virtual", 3,
                      f"default CNN, 3 VWs x 2 stages at 1x/1.5x/3x (20/30/60 ms per stage), Nm 2, D = 2, "
                      f"{het3_epochs:g} epochs, virtual time"),
  }


def _load_config(case: Case):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("study_config", REPO_ROOT / case.config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.update(case.overrides)
  return config


def engine_predictions(case: Case, smoke: bool) -> list[dict]:
  """The engine on the case's task times under both ``ps_apply`` modes and both pull policies."""
  from hetpipe_jax.jobs import job_config  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.rules import records as records_lib  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.sim import engine  # pylint: disable=g-import-not-at-top

  config = _load_config(case)
  from hetpipe_jax.jobs import emulation  # pylint: disable=g-import-not-at-top
  settings = job_config.resolve_job(config)
  times = emulation.emulated_task_times(settings, plan_times=not config.emulate_stage_ms.strip())
  num_waves = 10 if smoke else 200
  rows = []
  for pull_every_wave, policy in PULL_POLICIES:
    for ps_apply in PS_APPLY:
      cfg = engine.EngineConfig(num_waves=num_waves, num_inflight=settings.num_inflight,
                                staleness_bound=settings.staleness_bound, pull_every_wave=pull_every_wave,
                                ps_apply=ps_apply, records=True)
      report = engine.run(times, cfg)
      rows.append({"case": case.name, "ps_apply": ps_apply, "pull_every_wave": pull_every_wave,
                   "pull_policy": policy, "num_waves": num_waves, "num_inflight": settings.num_inflight,
                   "staleness_bound": settings.staleness_bound,
                   "predicted_minibatches_per_s": report.total_minibatches_per_s,
                   "wait_s_per_vw": [v.wait_s for v in report.vws], "pulls_per_vw": [v.num_pulls for v in report.vws],
                   "makespan_s": report.makespan_s, **records_lib.extra_update_stats(report.minibatch_records)})
  return rows


def train(case: Case, ps_apply: str, workdir: pathlib.Path, timeout_s: int) -> dict:
  """Runs the case's real job with ``ps_apply``; returns the summary's key results."""
  args = [f"--config={case.config}", f"--workdir={workdir}"]
  args += [f"--config.{k}={v}" for k, v in {**case.overrides, "ps_apply": ps_apply}.items()]
  py = sys.executable
  if case.mode == "mpi":
    mpiexec = pathlib.Path(py).parent / "mpiexec"
    cmd = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(case.num_vws + 1), py, "-m", "mpi4py", "-m",
           "hetpipe_jax.train", *args]
  else:
    cmd = [py, "-m", "hetpipe_jax.train", "--mode=virtual", *args]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  logging.info("run %s/%s: %s", case.name, ps_apply, " ".join(cmd))
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"{case.name} with ps_apply={ps_apply} failed (exit {proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")
  summary = json.loads((workdir / "summary.json").read_text())
  if summary["ps_apply"] != ps_apply:
    raise RuntimeError(f"{workdir}/summary.json says ps_apply={summary['ps_apply']!r}, the study asked {ps_apply!r}")
  return {"case": case.name, "ps_apply": ps_apply, "mode": summary["mode"], "workdir": str(workdir),
          "pull_every_wave": summary["pull_every_wave"], "staleness_bound": summary["staleness_bound"],
          "num_virtual_workers": summary["num_virtual_workers"], "num_inflight": summary["num_inflight"],
          "test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"],
          "time_s": summary["wall_time_s"], "time_unit": summary["time_unit"],
          "minibatches_per_s": summary["minibatches_per_s"], "num_minibatches": summary["num_minibatches"],
          **summary["extra_updates"], "command_wall_s": time.perf_counter() - t0}


def markdown(result: dict) -> str:
  lines = ["# WSP study: PS application mode and pull policy", ""]
  for name, case in result["cases"].items():
    lines += [f"## {name}: {case['description']}", "", "Engine prediction:", "",
              "| pull policy | ps_apply | predicted mb/s | wait s per VW | pulls per VW | minibatches with extra "
              "updates | mean extra waves |", "|---|---|---|---|---|---|---|"]
    for r in case["engine"]:
      lines.append(f"| {r['pull_policy']} | {r['ps_apply']} | {r['predicted_minibatches_per_s']:.2f} | "
                   f"{', '.join(f'{w:.2f}' for w in r['wait_s_per_vw'])} | "
                   f"{', '.join(str(p) for p in r['pulls_per_vw'])} | {100 * r['fraction_with_extra_updates']:.1f}% | "
                   f"{r['mean_extra_updates']:.2f} |")
    if case["trained"]:
      lines += ["", "Trained:", "", "| ps_apply | pull every wave | test accuracy | minibatches with extra updates | "
                "mean extra waves | time | mb/s |", "|---|---|---|---|---|---|---|"]
      for r in case["trained"]:
        lines.append(f"| {r['ps_apply']} | {r['pull_every_wave']} | {r['test_accuracy']:.4f} | "
                     f"{100 * r['fraction_with_extra_updates']:.1f}% | {r['mean_extra_updates']:.2f} | "
                     f"{r['time_s']:.1f} {r['time_unit']} | {r['minibatches_per_s']:.1f} |")
    lines.append("")
  return "\n".join(lines)


def plot(result: dict, path: pathlib.Path) -> None:
  """Test accuracy and the fraction of minibatches with extra updates, per case and ``ps_apply`` mode."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = [r for c in result["cases"].values() for r in c["trained"]]
  if not rows:
    return
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  labels = [f"{r['case']}\n{r['ps_apply']}" for r in rows]
  colors = ["tab:blue" if r["ps_apply"] == "on_receipt" else "tab:gray" for r in rows]
  axes[0].bar(labels, [r["test_accuracy"] for r in rows], color=colors)
  axes[0].set_ylabel("test accuracy")
  lo = min(r["test_accuracy"] for r in rows)
  axes[0].set_ylim(max(0.0, lo - 0.05), 1.0)
  axes[1].bar(labels, [100 * r["fraction_with_extra_updates"] for r in rows], color=colors)
  axes[1].set_ylabel("minibatches with extra updates (%)")
  for ax in axes:
    ax.tick_params(axis="x", labelsize=8)
  fig.suptitle("HetPipe WSP: PS applies updates on receipt (paper) vs clock-aligned")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  smoke = _SMOKE.value
  if smoke:  # the smoke cases run a few minibatches each
    flag_checks.refuse_replaced("--smoke", ["het3_epochs"])
  cases = make_cases(smoke, _DATA_DIR.value, _HET3_EPOCHS.value)
  unknown = [c for c in _CASES.value if c not in cases]
  if unknown:
    raise app.UsageError(f"--cases: unknown {unknown}; choose from {sorted(cases)}")
  out = pathlib.Path(_OUTPUT_DIR.value or f"runs/wsp_study-{time.strftime('%Y%m%d-%H%M%S')}")
  if not out.is_absolute():
    out = REPO_ROOT / out
  out.mkdir(parents=True, exist_ok=True)
  result = {"smoke": smoke, "engine_only": _ENGINE_ONLY.value, "cases": {}}
  for name in _CASES.value:
    case = cases[name]
    entry = {"description": case.description, "mode": case.mode, "engine": engine_predictions(case, smoke),
             "trained": []}
    if not _ENGINE_ONLY.value:
      for ps_apply in PS_APPLY:
        entry["trained"].append(train(case, ps_apply, out / f"{name}-{ps_apply}", _TIMEOUT_S.value))
    result["cases"][name] = entry
    write_json(result, out / "wsp_study.json")  # after every case: nothing finished is lost
  (out / "wsp_study.md").write_text(markdown(result))
  plot(result, out / "wsp_study.png")
  print(json.dumps(result, indent=1))
  print(markdown(result), file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
