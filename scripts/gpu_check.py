"""The GPU check (issue 28): one command that proves the CUDA path on a borrowed GPU and writes one JSON.

Steps, in order, each timed, each in its own process (a crash, hang or out-of-memory in one is recorded and the rest
still run), results merged into ``<out>/gpu_check.json`` after every step:

* ``env``: GPU name, memory and driver (nvidia-smi), the JAX devices and default matmul precision, the versions of
  jax, jaxlib, flax, optax, orbax-checkpoint, mpi4py, the MPI library, ..., against ``requirements.txt``'s pins
  (``pinned_versions_ran``: whether every pinned package ran at its pinned version).
* ``pytest_gpu``: ``pytest -m gpu`` (the GPU-only tests; ``HETPIPE_TEST_PLATFORM=gpu`` keeps ``tests/conftest.py``
  from forcing the CPU platform).
* ``main_job``: the main job (the default CNN on Fashion-MNIST, 2 VWs x 2 stages, Nm = 2, D = 1, both VWs' stages on
  GPU 0) under mpiexec with ``--config.platform=gpu``, shortened to ``--main_epochs``; test accuracy (goal >= 0.88)
  and minibatches/s.
* ``profile``: the per-layer profiler (:mod:`hetpipe_jax.runtime.profiler`) on the device for the default CNN at
  batch 64 and a GPT-2-small-shaped model (``gpt2_small``: 12 blocks, d_model 768, vocabulary 50,257, batch
  ``--gpt_batch`` x 1,024 tokens); per layer the measured forward/backward ms against the cost model's roofline for
  the GPU type (``experiments/clusters/h100.json`` / ``h200.json``), and the fitted efficiency
  (``cost_model.calibrate_efficiency``). The measured profiles are written under ``<out>`` with the path the planner
  reads them from (``planner_path``).
* ``pipeline``: one VW of 4 stages of the GPT-2-small shape on the one device under the runtime
  (:class:`~hetpipe_jax.runtime.virtual_worker.VirtualWorker`, HetPipe, Nm = 4, D = 0, an in-process PS) against one
  jitted training step of the whole model on the same device: ``useful_compute_ratio`` = minibatches x whole-model
  step time / the runtime's wall time (goal >= 0.90), and the runtime's host overhead per task.
* ``memory``: per stage of that VW, a fresh process that holds what the stage holds at its conservative peak (Nm
  forwards' residuals and Nm + 1 weight versions, then Nm backwards; the last stage one forward+backward) with the
  runtime's own jitted stage functions; its peak bytes as XLA's allocator reports them (``memory_stats()``
  ``peak_bytes_in_use``; on CPU, which reports none, the largest sum of live arrays plus the largest compiled temp
  buffer) against the planner's memory model for that stage (:meth:`cost_model.StageCosts.stage_memory_bytes`):
  ``ratio = measured / model`` per stage (goal within +-20%).

The three in-process measurements (profile, pipeline, memory) live in :mod:`scripts.gpu_measure`; this script holds
the flags, the environment, test and main-job steps, and the orchestration. ``--cpu`` is the rehearsal CI runs: every
step on CPU devices at smoke sizes (synthetic Fashion-MNIST, a GPT of the same layer structure at toy width), in well
under a minute of work per step.

  scripts/gpu_check.sh [--cpu] [--out=DIR] [--steps=env,profile]     # the wrapper sets up carried wheels and data
  python scripts/gpu_check.py --out=DIR [--cpu] [--steps=...]
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402  # pylint: disable=wrong-import-position

from hetpipe_jax.paths import REPO_ROOT  # noqa: E402  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_measure  # noqa: E402  # pylint: disable=wrong-import-position
from gpu_measure import PARTITION  # noqa: E402  # pylint: disable=wrong-import-position

STEPS = ("env", "pytest_gpu", "main_job", "profile", "pipeline", "memory")
# Wall-clock limit of each step's process (s; the memory step's: of each stage's). The whole check must end within
# 8 minutes on an H100.
STEP_TIMEOUT_S = {"env": 60, "pytest_gpu": 150, "main_job": 200, "profile": 120, "pipeline": 120, "memory": 60}
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint",
            "mpi4py", "mpich", "numpy", "scipy", "ml_collections", "absl-py", "tqdm", "matplotlib", "pytest")
MAIN_JOB_GOAL = 0.88

_OUT = flags.DEFINE_string("out", None, "Output directory (default: $OUT, else runs/gpu_check-<time>).")
_CPU = flags.DEFINE_bool("cpu", False, "Rehearsal: every step on CPU devices at smoke sizes.")
_STEPS = flags.DEFINE_list("steps", list(STEPS), f"Steps to run, in this order: {','.join(STEPS)}.")
_STEP = flags.DEFINE_string("step", None, "Internal: run this one step in this process and write its JSON.")
_STAGE = flags.DEFINE_integer("stage", None, "Internal (memory step): the stage this process measures.")
_MAIN_EPOCHS = flags.DEFINE_float("main_epochs", 3.0, "main_job: passes over Fashion-MNIST on the GPU (the default "
                                  "config's cosine schedule over this many; 1 epoch reaches 0.86 on CPU, 5 reach 0.91).")
_GPT_BATCH = flags.DEFINE_integer("gpt_batch", 8, "profile / pipeline / memory: sequences per minibatch of the "
                                  "GPT-2-small shape (1,024 tokens each).")
_PIPELINE_MINIBATCHES = flags.DEFINE_integer("pipeline_minibatches", 32, "pipeline: timed minibatches (a multiple "
                                             "of Nm = 4), after a warm-up of 2 waves.")
_WORK_DIR = flags.DEFINE_string("work_dir", None, "Intermediate files (each step's JSON, the main job's run, logs; "
                                "default: a new folder under the system's temp dir). Only the final products go to "
                                "--out: gpu_check.json, the plots and the measured profiles (a GPU loan brings back "
                                "at most 8 files).")
_STEP_TIMEOUT = flags.DEFINE_list("step_timeout_s", [], "Override step limits, e.g. main_job:300,profile:200 (the "
                                   "memory step's applies to each stage's process).")
_PIPELINE_BOUNDS = flags.DEFINE_list("pipeline_staleness_bounds", ["0", "1"], "pipeline: the staleness bounds D run "
                                      "(the first is the headline ratio; D >= 1 lets a wave's PS exchange overlap the "
                                      "next wave's compute).")
_REPEATS = flags.DEFINE_integer("repeats", 10, "profile / pipeline: timed repetitions per measurement.")


# ---------------------------------------------------------------------------------------------------------------
# Sizes and models


def _gpt_batch(cpu: bool) -> int:
  return 2 if cpu else _GPT_BATCH.value


# ---------------------------------------------------------------------------------------------------------------
# Steps (each runs in its own process and returns a JSON-able dict)


def step_env(cpu: bool, out: pathlib.Path, work: pathlib.Path) -> dict:
  del out, work
  result = {"python": sys.version.split()[0], "executable": sys.executable}
  smi = shutil.which("nvidia-smi")
  if smi:
    q = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True, check=False)
    result["nvidia_smi"] = [dict(zip(("name", "memory_total", "driver"), (f.strip() for f in line.split(","))))
                            for line in q.stdout.strip().splitlines()] if q.returncode == 0 else q.stderr.strip()
  else:
    result["nvidia_smi"] = None
  pins = {}
  for line in (REPO_ROOT / "requirements.txt").read_text().splitlines():
    m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line)
    if m:
      pins[m.group(1).lower().replace("_", "-")] = m.group(2)
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  norm = {k.lower().replace("_", "-"): v for k, v in versions.items()}
  pinned = {name: {"pinned": want, "ran": norm.get(name)} for name, want in pins.items() if name in norm}
  result["versions"] = versions
  result["pinned"] = pinned
  result["pinned_versions_ran"] = all(v["pinned"] == v["ran"] for v in pinned.values())
  mpi = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version().strip())"],
                       capture_output=True, text=True, check=False, timeout=30)
  result["mpi_library"] = (mpi.stdout.strip().splitlines() or [""])[0] if mpi.returncode == 0 else mpi.stderr[-500:]
  import jax
  result["jax_devices"] = [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()]
  result["default_backend"] = jax.default_backend()
  result["jax_default_matmul_precision"] = str(jax.config.jax_default_matmul_precision)
  result["env"] = {k: os.environ.get(k) for k in ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                  "CUDA_VISIBLE_DEVICES", "HETPIPE_DATA_DIR")}
  if not cpu and jax.default_backend() != "gpu":
    raise RuntimeError(f"no GPU backend: jax.devices() = {result['jax_devices']}")
  return result


def _pytest_counts(text: str) -> dict:
  last = [line for line in text.strip().splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|error)",
                                                                    line)]
  counts = {}
  for n, what in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", last[-1] if last else ""):
    counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
  return counts


def step_pytest_gpu(cpu: bool, out: pathlib.Path, work: pathlib.Path) -> dict:
  del out
  env = dict(os.environ)
  if not cpu:
    env["HETPIPE_TEST_PLATFORM"] = "gpu"
  # The modules that hold GPU tests (collecting every module would make a missing CPU-only dependency fail the step).
  files = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "tests").glob("test_*.py")
                 if "pytest.mark.gpu" in p.read_text())
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *files, "-p", "no:cacheprovider"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False,
                        timeout=STEP_TIMEOUT_S["pytest_gpu"] - 10)
  (work / "pytest_gpu.log").write_text(proc.stdout + proc.stderr)
  counts = _pytest_counts(proc.stdout)
  result = {"files": files, "returncode": proc.returncode, "counts": counts, "tail": proc.stdout[-1500:]}
  if proc.returncode != 0 or counts.get("failed") or counts.get("error"):
    raise RuntimeError(f"pytest -m gpu failed (exit {proc.returncode}): {counts}\n{proc.stdout[-2000:]}")
  if not cpu and not counts.get("passed"):
    raise RuntimeError(f"pytest -m gpu ran no GPU test on a GPU machine: {counts}")
  return result


def step_main_job(cpu: bool, out: pathlib.Path, work: pathlib.Path) -> dict:
  workdir = work / "main_job"
  if workdir.exists():
    shutil.rmtree(workdir)
  mpiexec = shutil.which("mpiexec", path=str(pathlib.Path(sys.executable).parent) + os.pathsep
                         + os.environ.get("PATH", ""))
  args = [mpiexec, "-n", "3", sys.executable, "-m", "mpi4py", "-m", "hetpipe_jax.train",
          "--config=experiments/configs/default.py", f"--workdir={workdir}", "--config.plan=",
          "--config.num_virtual_workers=2", "--config.num_stages=2", "--config.partition=0:2,2:7",
          "--config.num_inflight=2", "--config.progress=False", "--config.checkpoint_every_waves=0"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  if cpu:
    from hetpipe_jax.data import synthetic
    data = synthetic.write_synthetic_fashion_mnist(work / "synthetic_fmnist", num_train=512, num_test=256)
    args += ["--config.platform=cpu", f"--config.data_dir={data}", "--config.check_counts=False",
             "--config.num_minibatches=16", "--config.eval_every_epochs=0"]
  else:
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # three processes share the one GPU
    args += ["--config.platform=gpu", "--config.stage_devices=0,0", f"--config.num_epochs={_MAIN_EPOCHS.value}",
             "--config.eval_every_epochs=1"]
  t0 = time.perf_counter()
  proc = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False,
                        timeout=STEP_TIMEOUT_S["main_job"] - 10)
  seconds = time.perf_counter() - t0
  (work / "main_job.log").write_text(proc.stdout + proc.stderr)
  if proc.returncode != 0:
    raise RuntimeError(f"main job exited {proc.returncode}:\n{proc.stderr[-3000:]}")
  summary = json.loads((workdir / "summary.json").read_text())
  if (workdir / "metrics.png").exists():
    shutil.copy(workdir / "metrics.png", out / "main_job_metrics.png")
  config = json.loads((workdir / "config.json").read_text())
  result = {"command": " ".join(str(a) for a in args[1:]), "seconds_with_start_up": seconds,
            "log_tail": [line for line in proc.stderr.splitlines() if "[PS]" in line][-6:],
            "platform": config.get("platform"), "stage_devices": config.get("stage_devices"),
            "rank_visible_devices": config.get("rank_visible_devices")}
  for k in ("test_accuracy", "num_minibatches", "wall_time_s", "minibatches_per_s", "images_per_s",
            "num_inflight", "staleness_bound", "num_virtual_workers", "num_stages", "partition"):
    result[k] = summary.get(k)
  if not cpu:
    result["goal_test_accuracy"] = MAIN_JOB_GOAL
    result["goal_met"] = summary["test_accuracy"] >= MAIN_JOB_GOAL
  return result


# ---------------------------------------------------------------------------------------------------------------
# Orchestration


def _run_child(step: str, out: pathlib.Path, work: pathlib.Path, cpu: bool, extra: tuple = ()) -> dict:
  """Runs one step in a fresh process; returns its record (status, seconds, result or error)."""
  path = work / (f"step_{step}" + "".join(f"_{e.split('=')[-1]}" for e in extra) + ".json")
  path.unlink(missing_ok=True)
  args = [sys.executable, os.path.abspath(__file__), f"--step={step}", f"--out={out}", f"--work_dir={work}",
          f"--main_epochs={_MAIN_EPOCHS.value}", f"--gpt_batch={_GPT_BATCH.value}",
          f"--pipeline_minibatches={_PIPELINE_MINIBATCHES.value}", f"--repeats={_REPEATS.value}",
          f"--pipeline_staleness_bounds={','.join(_PIPELINE_BOUNDS.value)}",
          f"--step_timeout_s={','.join(f'{k}:{v}' for k, v in STEP_TIMEOUT_S.items())}", *extra]
  if cpu:
    args.append("--cpu")
  env = dict(os.environ)
  if cpu:
    env["JAX_PLATFORMS"] = "cpu"
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=STEP_TIMEOUT_S[step])
  except subprocess.TimeoutExpired as e:
    tail = (e.stderr or b"")[-2000:]
    return {"status": "timeout", "seconds": time.perf_counter() - t0, "timeout_s": STEP_TIMEOUT_S[step],
            "error": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
  seconds = time.perf_counter() - t0
  if path.exists():
    record = json.loads(path.read_text())
    record["seconds"] = seconds
    return record
  return {"status": "failed", "seconds": seconds, "returncode": proc.returncode,
          "error": (proc.stderr or proc.stdout)[-3000:]}


def _child(step: str, out: pathlib.Path, work: pathlib.Path, cpu: bool, stage: int | None) -> None:
  """Runs ``step`` in this process; writes ``step_<step>.json`` with its status and result or error."""
  batch = _gpt_batch(cpu)
  fns = {"env": lambda: step_env(cpu, out, work), "pytest_gpu": lambda: step_pytest_gpu(cpu, out, work),
         "main_job": lambda: step_main_job(cpu, out, work),
         "profile": lambda: gpu_measure.step_profile(cpu, out, work, batch, _REPEATS.value),
         "pipeline": lambda: gpu_measure.step_pipeline(cpu, batch, _PIPELINE_MINIBATCHES.value,
                                                      [int(d) for d in _PIPELINE_BOUNDS.value], _REPEATS.value),
         "memory": lambda: gpu_measure.step_memory_stage(cpu, batch, stage)}
  suffix = f"_{stage}" if stage is not None else ""
  try:
    result = fns[step]()
    record = {"status": "ok", "result": result}
  except Exception as e:  # pylint: disable=broad-except  # recorded, the check goes on
    record = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
  (work / f"step_{step}{suffix}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")


def _output_dir() -> pathlib.Path:
  if _OUT.value:
    return pathlib.Path(_OUT.value).resolve()
  if os.environ.get("OUT"):
    return pathlib.Path(os.environ["OUT"]).resolve()
  return REPO_ROOT / "runs" / time.strftime("gpu_check-%Y%m%d-%H%M%S")


def main(argv) -> None:
  del argv
  unknown = [s for s in _STEPS.value if s not in STEPS]
  if unknown:
    print(f"error: --steps has unknown steps {unknown}; choose from {','.join(STEPS)}", file=sys.stderr)
    sys.exit(2)
  for item in _STEP_TIMEOUT.value:
    name, _, seconds = item.partition(":")
    try:
      if name not in STEPS or float(seconds) <= 0:
        raise ValueError
    except ValueError:
      print(f"error: --step_timeout_s={item!r}: give STEP:SECONDS with STEP in {','.join(STEPS)} and SECONDS > 0",
            file=sys.stderr)
      sys.exit(2)
    STEP_TIMEOUT_S[name] = float(seconds)
  out = _output_dir()
  out.mkdir(parents=True, exist_ok=True)
  cpu = _CPU.value
  work = pathlib.Path(_WORK_DIR.value or tempfile.mkdtemp(prefix="gpu_check_")).resolve()
  work.mkdir(parents=True, exist_ok=True)
  if _STEP.value is not None:
    _child(_STEP.value, out, work, cpu, _STAGE.value)
    return
  report = {"mode": "cpu rehearsal" if cpu else "gpu", "started_unix_s": time.time(), "work_dir": str(work),
            "steps": {}}
  t_all = time.perf_counter()
  json_path = out / "gpu_check.json"
  for step in [s for s in STEPS if s in _STEPS.value]:
    print(f"[gpu_check] {step} ...", flush=True)
    if step == "memory":
      records = [_run_child("memory", out, work, cpu, (f"--stage={s}",)) for s in range(len(PARTITION))]
      ok = [r for r in records if r["status"] == "ok"]
      record = {"status": "ok" if len(ok) == len(records) else "failed",
                "seconds": sum(r["seconds"] for r in records)}
      if ok:
        record["result"] = gpu_measure.memory_summary([r["result"] for r in ok], cpu)
        gpu_measure.plot_memory(record["result"], out / "memory.png")
      failed = [dict(r, stage=s) for s, r in enumerate(records) if r["status"] != "ok"]
      if failed:
        record["failed_stages"] = failed
    else:
      record = _run_child(step, out, work, cpu)
    report["steps"][step] = record
    report["total_seconds"] = time.perf_counter() - t_all
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"[gpu_check] {step}: {record['status']} in {record['seconds']:.1f} s"
          + (f": {record.get('error', '')[-300:]}" if record["status"] != "ok" else ""), flush=True)
  report["all_ok"] = all(r["status"] == "ok" for r in report["steps"].values())
  json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
  print(json.dumps({k: report[k] for k in ("mode", "all_ok", "total_seconds")}), flush=True)
  print(f"[gpu_check] wrote {json_path}", flush=True)
  sys.exit(0 if report["all_ok"] else 1)


if __name__ == "__main__":
  app.run(main)
