"""Measured images/s of every method on the main job's setting, side by side with HetPipe, from one run.

The main job (``experiments/configs/default.py``): the default CNN on Fashion-MNIST, batch 64 per VW, 2 VWs (2
workers for Horovod) on this machine's CPU devices. Each method runs as the real MPI job (``hetpipe_jax.train``):

* ``hetpipe``: the default config as it is (its plan: 2 VWs x 2 stages, partition 0:2,2:7, Nm = 2, D = 1);
* ``pipedream``: the plan's two partitions, Nm = NOAM = 2, D = 1 (WSP through the PS);
* ``gpipe`` and ``1f1b_flush``: the same partitions, M micro-batches per step (``--num_microbatches``, default 4),
  all-reduce BSP (2 ranks, no PS);
* ``horovod``: 2 workers, the whole model on one device each, M = 1.

Every run trains ``--num_minibatches`` minibatches per VW (not the main job's 5 epochs: a throughput measurement);
images/s is the steady state of ``minibatches.jsonl`` on the VWs' common clock (``engine_report.steady_rates`` with
``--warmup_waves`` warm-up waves, as ``validate_engine``), times the examples per (micro-)batch; the whole run's
``summary.json`` rate (compilation included) is shown too. Prints a Markdown table and writes JSON (``--output``).

  .venv/bin/python experiments/methods_throughput.py [--smoke] [--output=methods.json] [--methods=hetpipe,gpipe]

``--smoke`` (CI): synthetic data, a few minibatches per method; checks the script end to end, not a measurement.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

if str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:  # run as a file: find the package
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags, logging  # noqa: E402

from hetpipe_jax import flag_checks  # noqa: E402
from hetpipe_jax.paths import REPO_ROOT  # noqa: E402
from hetpipe_jax.rules import methods  # noqa: E402
from hetpipe_jax.sim import engine_report  # noqa: E402

_SMOKE = flags.DEFINE_bool("smoke", False, "Seconds-long end-to-end check on synthetic data (CI).")
_NUM_MB = flags.DEFINE_integer("num_minibatches", 160, "Minibatches (steps) per VW of each run.")
_M = flags.DEFINE_integer("num_microbatches", 4, "GPipe / 1F1B-flush micro-batches per step.")
_WARMUP = flags.DEFINE_integer("warmup_waves", 3, "Waves (steps) per VW left out of the steady state.")
_METHODS = flags.DEFINE_list("methods", list(methods.HARNESS_METHODS), "Methods to run.")
_OUTPUT = flags.DEFINE_string("output", "", "Write the results as JSON here.")
_RUNS_DIR = flags.DEFINE_string("runs_dir", "", "Where the runs go (default: a new /tmp/methods_* dir).")
_TIMEOUT_S = flags.DEFINE_integer("timeout_s", 900, "Wall-clock limit of one run.")

_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
_MPIEXEC = REPO_ROOT / ".venv" / "bin" / "mpiexec"
PARTITION = "0:2,2:7"  # the main job's plan (experiments/plans/local_cpu_cnn_b64.json)


def overrides(method: str, num_microbatches: int) -> dict:
  """The config overrides that run ``method`` on the main job's setting (module docstring)."""
  if method == "hetpipe":
    return {}
  common = {"method": method, "plan": "", "num_virtual_workers": 2}
  if method == "pipedream":
    return {**common, "num_stages": 2, "partition": PARTITION, "num_inflight": 2}
  if method == "horovod":
    return {**common, "num_stages": 1, "partition": "", "num_inflight": 1}
  return {**common, "num_stages": 2, "partition": PARTITION, "num_inflight": num_microbatches}


def run_method(method: str, workdir: pathlib.Path, num_minibatches: int, num_microbatches: int, extra: dict,
               timeout_s: int, warmup_waves: int) -> dict:
  """Runs one method's MPI job; returns its measured rates.

  Raises:
    RuntimeError: the job failed (with the tail of its output).
  """
  spec = methods.get_method(method)
  ranks = 2 if not spec.uses_ps else 3
  ov = {**overrides(method, num_microbatches), "num_minibatches": num_minibatches, "progress": False,
        "checkpoint_every_waves": 0, "eval_every_epochs": 0.0, **extra}
  cmd = [str(_MPIEXEC), "-n", str(ranks), str(_PYTHON), "-m", "mpi4py", "-m", "hetpipe_jax.train",
         "--config=experiments/configs/default.py", f"--workdir={workdir}"] + [f"--config.{k}={v}"
                                                                              for k, v in ov.items()]
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
  env.pop("XLA_FLAGS", None)
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
  wall = time.perf_counter() - t0
  if proc.returncode != 0:
    raise RuntimeError(f"{method}: job exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
  summary = json.loads((workdir / "summary.json").read_text())
  records = [json.loads(line) for line in (workdir / "minibatches.jsonl").read_text().splitlines() if line.strip()]
  n = summary["num_virtual_workers"]
  per_wave = summary["num_inflight"]  # (micro-)batches per wave or step in the records
  examples = summary["batch_size"] // per_wave if spec.is_flush else summary["batch_size"]
  starts = [summary["per_vw"][str(v)]["start_unix_s"] for v in range(n)]
  origin = min(starts)
  completions = []
  for v in range(n):
    times = sorted((r["minibatch_id"], r["complete_time_s"]) for r in records if r["vw_id"] == v)
    completions.append([t + starts[v] - origin for _, t in times])
  _, total, window = engine_report.steady_rates(completions, per_wave, warmup_waves=warmup_waves)
  return {"method": method, "num_vws": n, "ranks": ranks, "num_stages": summary["num_stages"],
          "partition": summary["partition"], "num_inflight": summary["num_inflight"],
          "setting": summary["method_settings"], "steady_images_per_s": total * examples,
          "run_images_per_s": summary["images_per_s"], "steady_window_s": list(window),
          "test_accuracy": summary["test_accuracy"], "final_train_loss": summary["final_train_loss"],
          "job_wall_s": wall, "workdir": str(workdir)}


def format_table(rows: list[dict]) -> str:
  base = next((r["steady_images_per_s"] for r in rows if r["method"] == "hetpipe"), None)
  lines = ["| method | VWs x stages | Nm / M | steady images/s | vs HetPipe | whole-run images/s | test acc. |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    kind = "M" if methods.get_method(r["method"]).is_flush else "Nm"
    rel = f"{r['steady_images_per_s'] / base:.2f}x" if base else "-"
    lines.append(f"| {r['method']} | {r['num_vws']} x {r['num_stages']} | {kind}={r['num_inflight']} | "
                 f"{r['steady_images_per_s']:.0f} | {rel} | {r['run_images_per_s']:.0f} | "
                 f"{r['test_accuracy']:.3f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  root = pathlib.Path(_RUNS_DIR.value or tempfile.mkdtemp(prefix="methods_", dir="/tmp"))
  root.mkdir(parents=True, exist_ok=True)
  extra: dict = {}
  num_mb = _NUM_MB.value
  if _SMOKE.value:
    flag_checks.refuse_replaced("--smoke", ["num_minibatches", "warmup_waves"])
    from hetpipe_jax.data import synthetic  # pylint: disable=g-import-not-at-top
    data = synthetic.write_synthetic_fashion_mnist(root / "data", 1024, 64)
    extra = {"data_dir": str(data), "check_counts": False}
    num_mb = 8
  rows = []
  t0 = time.perf_counter()
  for method in _METHODS.value:
    methods.get_method(method)
    row = run_method(method, root / method, num_mb, _M.value, extra, _TIMEOUT_S.value,
                     1 if _SMOKE.value else _WARMUP.value)
    logging.info("%s: %.0f images/s steady (%.0f over the whole run), job %.0f s", method,
                 row["steady_images_per_s"], row["run_images_per_s"], row["job_wall_s"])
    rows.append(row)
  print(format_table(rows))
  result = {"setting": "experiments/configs/default.py (cnn, batch 64, 2 VWs / workers, CPU devices)",
            "num_minibatches_per_vw": num_mb, "warmup_waves": _WARMUP.value, "smoke": _SMOKE.value,
            "total_wall_s": time.perf_counter() - t0, "rows": rows}
  engine_report.print_json(result, _OUTPUT.value)


if __name__ == "__main__":
  app.run(main)
