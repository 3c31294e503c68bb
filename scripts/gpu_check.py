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

``--cpu`` is the rehearsal CI runs: every step on CPU devices at smoke sizes (synthetic Fashion-MNIST, a GPT of the
same layer structure at toy width), in well under a minute of work per step.

  scripts/gpu_check.sh [--cpu] [--out=DIR] [--steps=env,profile]     # the wrapper sets up carried wheels and data
  python scripts/gpu_check.py --out=DIR [--cpu] [--steps=...]
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402  # pylint: disable=wrong-import-position

from hetpipe_jax.paths import REPO_ROOT  # noqa: E402  # pylint: disable=wrong-import-position

STEPS = ("env", "pytest_gpu", "main_job", "profile", "pipeline", "memory")
# Wall-clock limit of each step's process (s; the memory step's: of each stage's). The whole check must end within
# 8 minutes on an H100.
STEP_TIMEOUT_S = {"env": 60, "pytest_gpu": 150, "main_job": 200, "profile": 120, "pipeline": 120, "memory": 60}
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint",
            "mpi4py", "mpich", "numpy", "scipy", "ml_collections", "absl-py", "tqdm", "matplotlib", "pytest")
PARTITION = ((0, 3), (3, 7), (7, 11), (11, 14))  # the GPT's 14 layers (embedding, 12 blocks, head) in 4 stages
NUM_INFLIGHT = 4
MAIN_JOB_GOAL = 0.88
PIPELINE_GOAL = 0.90
MEMORY_TOLERANCE = 0.20

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


def _gpt_spec(cpu: bool):
  """The GPT-2-small shape on a GPU; on CPU the same 14-layer structure at toy width."""
  from hetpipe_jax import models
  from hetpipe_jax.models import gpt
  if cpu:
    return gpt.gpt("gpt2_small_cpu_rehearsal", vocab_size=256, seq_len=32, d_model=32, num_heads=2, num_blocks=12)
  return models.get_model("gpt2_small")


def _gpt_batch(cpu: bool) -> int:
  return 2 if cpu else _GPT_BATCH.value


def _cluster_for(device):
  """The cluster file whose GPU type describes ``device`` (None when there is none)."""
  from hetpipe_jax.planning import cluster
  if device.platform == "cpu":
    return cluster.load_cluster("local_cpu")
  kind = device.device_kind
  for name, tag in (("h200", "H200"), ("h100", "H100")):
    if tag in kind:
      return cluster.load_cluster(name)
  return None


def _gpt_data(spec, batch: int, seed: int):
  """Random token minibatches ``p -> (int32 [b, seq], int32 [b, seq])`` (the pipeline's numerics do not matter)."""
  import numpy as np
  seq = spec.input_shape[0]

  def get(p):
    rng = np.random.default_rng(seed + p)
    tokens = rng.integers(0, spec.num_classes, (batch, seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]
  return get


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


def _profile_table(prof, costs, gpu, config) -> tuple[list[dict], float | None]:
  """Per layer: measured ms (``prof``) against the roofline of ``costs``' FLOPs and bytes at efficiency 1 and at
  the fitted efficiency (``costs``: a cost-analysis profile of the same model and batch)."""
  import dataclasses
  from hetpipe_jax.planning import cost_model
  rows, fitted = [], None
  if gpu is not None:
    ideal = dataclasses.replace(gpu, measured_device_kind=None, roofline_efficiency=1.0)
    merged = dataclasses.replace(costs, measured=True, layers=tuple(
        dataclasses.replace(c, fwd_time_ms=m.fwd_time_ms, bwd_time_ms=m.bwd_time_ms)
        for c, m in zip(costs.layers, prof.layers)))
    fitted = cost_model.calibrate_efficiency(merged, ideal)
    at_fit = dataclasses.replace(gpu, measured_device_kind=None, roofline_efficiency=min(fitted, 1.0))
  for layer, cost in zip(prof.layers, costs.layers):
    row = {"layer": layer.name, "fwd_ms": layer.fwd_time_ms, "bwd_ms": layer.bwd_time_ms,
           "fwd_gflop": cost.fwd_flops / 1e9, "bwd_gflop": cost.bwd_flops / 1e9,
           "fwd_gflop_device_cost_analysis": layer.fwd_flops / 1e9,
           "bwd_gflop_device_cost_analysis": layer.bwd_flops / 1e9}
    if gpu is not None:
      one = dataclasses.replace(costs, measured=False, layers=(cost,))
      row["roofline_ms_at_efficiency_1"] = float(cost_model.layer_times_ms(one, ideal, config)[0])
      row["roofline_ms_at_fitted"] = float(cost_model.layer_times_ms(one, at_fit, config)[0])
      row["efficiency"] = row["roofline_ms_at_efficiency_1"] / (layer.fwd_time_ms + layer.bwd_time_ms)
    rows.append(row)
  return rows, fitted


def _cpu_cost_profile(model: str, batch: int, cpu: bool, work: pathlib.Path):
  """The cost-analysis profile the planner uses for a GPU it has not measured (XLA's CPU backend: it counts every
  dot's FLOPs, where the GPU backend's cost analysis leaves out cuBLAS / cuDNN custom calls), made in a CPU-only
  process."""
  from hetpipe_jax.planning import profile_format
  path = work / f"costs_{model}_b{batch}.json"
  code = ("import sys; sys.path.insert(0, '.'); from scripts import gpu_check; from hetpipe_jax.runtime import "
          "profiler; from hetpipe_jax.planning import profile_format as pf; "
          f"spec = gpu_check._spec_named({model!r}, {cpu}); "
          f"pf.save_profile(profiler.profile_model(spec, {batch}, measure=False, optimizer='adam'), {str(path)!r})")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        check=False, timeout=90)
  if proc.returncode != 0:
    raise RuntimeError(f"the CPU cost analysis of {model} failed:\n{proc.stderr[-2000:]}")
  return profile_format.load_profile(str(path))


def _spec_named(name: str, cpu: bool):
  from hetpipe_jax import models
  return _gpt_spec(cpu) if name == _gpt_spec(cpu).name else models.get_model(name)


def step_profile(cpu: bool, out: pathlib.Path, work: pathlib.Path) -> dict:
  import jax
  from hetpipe_jax import models
  from hetpipe_jax.planning import cost_model, profile_format
  from hetpipe_jax.runtime import profiler
  device = jax.devices()[0]
  clus = _cluster_for(device)
  gpu = next(iter(clus.gpu_types.values())) if clus is not None else None
  config = cost_model.CostModelConfig()
  result = {"device_kind": device.device_kind, "cluster": clus.name if clus else None,
            "gpu_type": gpu.name if gpu else None,
            "roofline_source": "FLOPs and bytes of XLA's CPU cost analysis (what the planner uses for a GPU it has "
                               "not measured; the GPU backend's cost analysis leaves out cuBLAS / cuDNN calls: "
                               "*_device_cost_analysis)",
            "models": {}}
  for spec, batch in ((models.get_model("cnn"), 64 if not cpu else 8), (_gpt_spec(cpu), _gpt_batch(cpu))):
    t0 = time.perf_counter()
    prof = profiler.profile_model(spec, batch, measure=True, repeats=_REPEATS.value if not cpu else 2,
                                  optimizer="adam", device=device)
    path = out / f"profile_{spec.name}_b{batch}.json"
    profile_format.save_profile(prof, str(path))
    costs = _cpu_cost_profile(spec.name, batch, cpu, work)
    rows, fitted = _profile_table(prof, costs, gpu, config)
    seq = spec.input_shape[0] if spec.input_dtype == "int32" else None
    result["models"][spec.name] = {
        "batch_size": batch, "sequence_length": seq, "seconds": time.perf_counter() - t0,
        "measured_total_ms": sum(r["fwd_ms"] + r["bwd_ms"] for r in rows),
        "fitted_efficiency": fitted, "profile_file": path.name,
        "planner_path": os.path.relpath(profile_format.default_profile_path(spec.name, batch, prof.device_kind, True),
                                        REPO_ROOT),
        "layers": rows}
  _plot_profile(result, out / "profile.png")
  return result


def _plot_profile(result: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = list(result["models"])
  fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
  for ax, name in zip(axes[0], names):
    m = result["models"][name]
    rows = m["layers"]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["fwd_ms"] + r["bwd_ms"] for r in rows], 0.4, label="measured fwd+bwd")
    if rows and "roofline_ms_at_fitted" in rows[0]:
      ax.bar([x + 0.2 for x in xs], [r["roofline_ms_at_fitted"] for r in rows], 0.4,
             label=f"roofline at fitted efficiency {m['fitted_efficiency']:.3f}")
    ax.set_xticks(list(xs), [r["layer"] for r in rows], rotation=90, fontsize=7)
    ax.set_ylabel("ms per minibatch")
    ax.set_title(f"{name}, batch {m['batch_size']} on {result['device_kind']}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _build_vw(spec, stages, params0, tx, batch, staleness_bound: int = 0):
  from hetpipe_jax.ps import param_server
  from hetpipe_jax.runtime import virtual_worker
  from hetpipe_jax.runtime.param_layout import ParamLayout
  layout = ParamLayout.from_layer_params(params0)
  server = param_server.ParameterServer(layout.flatten(params0), 1)
  return virtual_worker.VirtualWorker(0, stages, layout, params0, tx, NUM_INFLIGHT, staleness_bound,
                                      param_server.LocalPSClient(server, 0), _gpt_data(spec, batch, 0),
                                      num_virtual_workers=1)


def _median_s(fn, repeats: int) -> float:
  import jax
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def step_pipeline(cpu: bool, out: pathlib.Path, work: pathlib.Path) -> dict:
  del out, work
  import jax
  import numpy as np
  import optax
  from hetpipe_jax import models
  from hetpipe_jax.runtime import objectives
  from hetpipe_jax.runtime import stages as stages_lib
  spec, batch = _gpt_spec(cpu), _gpt_batch(cpu)
  device = jax.devices()[0]
  tx = optax.adam(1e-4)
  n = _PIPELINE_MINIBATCHES.value if not cpu else 8
  if n % NUM_INFLIGHT:
    raise ValueError(f"--pipeline_minibatches={n} must be a multiple of Nm = {NUM_INFLIGHT}")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  stages = stages_lib.build_stages(spec, PARTITION, [device] * len(PARTITION), tx)
  requested, out_of_memory = batch, []
  while True:  # all four stages on one device: a smaller GPU (an H100 at batch 8) may not hold them; halve and say so
    try:
      t0 = time.perf_counter()
      _build_vw(spec, stages, params0, tx, batch).run(2 * NUM_INFLIGHT)  # compiles every stage function
      warm_s = time.perf_counter() - t0
      gc.collect()  # the warm-up VW's buffers leave the device
      break
    except Exception as e:  # pylint: disable=broad-except  # XlaRuntimeError; anything else is raised again
      if "RESOURCE_EXHAUSTED" not in str(e) or batch == 1:
        raise
      out_of_memory.append({"batch_size": batch, "error": str(e)[:300]})
      batch //= 2
      del e
      gc.collect()
  # The whole model as one jitted training step (forward, loss, backward, Adam) on the same device.
  loss_fn = objectives.get_objective(spec.objective).loss
  params = jax.device_put(params0, device)
  opt_state = jax.device_put(tx.init(params), device)

  @jax.jit
  def train_step(p, o, x, y):
    loss, g = jax.value_and_grad(lambda q: loss_fn(models.apply_layers(spec.layers, q, x), y))(p)
    delta, o = tx.update(g, o, p)
    return optax.apply_updates(p, delta), o, loss

  x, y = (jax.device_put(a, device) for a in _gpt_data(spec, batch, 0)(0))
  step_s = _median_s(lambda: train_step(params, opt_state, x, y), _REPEATS.value if not cpu else 3)
  del params, opt_state, x, y, train_step  # free the whole model's buffers before the VWs run
  gc.collect()
  by_bound = {}
  for bound in _PIPELINE_BOUNDS.value:  # D = 0 first: the headline; D >= 1 lets the PS channel overlap the exchange
    vw = _build_vw(spec, stages, params0, tx, batch, int(bound))
    by_bound[int(bound)] = vw.run(n)
    del vw
    gc.collect()  # the VW's weights, versions and optimizer states leave the device before the next one
  stats = by_bound[int(_PIPELINE_BOUNDS.value[0])]
  per_task = lambda s: 1e6 * s / stats.num_tasks  # noqa: E731
  host_overhead = stats.host_busy_s - stats.update_s - stats.sync_s - stats.inject_s + stats.executor_book_s
  ratio = n * step_s / stats.wall_time_s
  result = {
      "model": spec.name, "batch_size": batch, "batch_size_requested": requested, "out_of_memory": out_of_memory,
      "sequence_length": spec.input_shape[0],
      "partition": [list(r) for r in PARTITION], "num_inflight": NUM_INFLIGHT,
      "staleness_bound": int(_PIPELINE_BOUNDS.value[0]),
      "device": f"{device.platform}:{device.id} {device.device_kind}", "minibatches": n,
      "warm_up_s": warm_s, "runtime_wall_s": stats.wall_time_s,
      "runtime_minibatches_per_s": n / stats.wall_time_s,
      "whole_model_step_ms": 1e3 * step_s, "whole_model_minibatches_per_s": 1 / step_s,
      "useful_compute_ratio": ratio,
      "host_overhead_us_per_task": per_task(host_overhead),
      "scheduler_thread_busy_us_per_task": per_task(stats.host_busy_s),
      "weight_update_and_push_us_per_task": per_task(stats.update_s),
      "wave_push_s": stats.push_s, "pull_install_s": stats.sync_s, "ps_channel": stats.ps_channel,
      "ps_channel_busy_s": stats.ps_channel_s,
      "per_wave_push_ms": 1e3 * stats.push_s / (n // NUM_INFLIGHT),
      "per_wave_pull_install_ms": 1e3 * stats.sync_s / max(stats.num_pulls, 1), "num_pulls": stats.num_pulls,
      "wave_bytes": 4 * sum(int(np.prod(np.shape(a))) for a in jax.tree.leaves(params0)),
      "pull_install_us_per_task": per_task(stats.sync_s),
      "wait_for_ps_s": stats.wait_s, "num_tasks": stats.num_tasks,
      "note": "useful_compute_ratio = minibatches x the whole model's jitted step / the runtime's wall time, all 4 "
              "stages on one device (no overlap between stages is possible there); the runtime's wall also holds "
              "HetPipe's per-minibatch stage updates and every wave's push to and pull from the in-process PS "
              "(device <-> host copies of the wave's update and the global weights)",
  }
  result["by_staleness_bound"] = {
      str(d): {"runtime_wall_s": st.wall_time_s, "useful_compute_ratio": n * step_s / st.wall_time_s,
               "ps_channel": st.ps_channel, "ps_channel_busy_s": st.ps_channel_s, "wait_for_ps_s": st.wait_s,
               "scheduler_thread_busy_s": st.host_busy_s} for d, st in by_bound.items()}
  if not cpu:
    result["goal"] = PIPELINE_GOAL
    result["goal_met"] = ratio >= PIPELINE_GOAL
  return result


def _stage_bytes_on(device) -> int:
  import jax
  return int(sum(a.nbytes for a in jax.live_arrays() if device in a.devices()))


def step_memory_stage(cpu: bool, out: pathlib.Path, work: pathlib.Path, s: int) -> dict:
  """One stage alone on the device at its conservative peak; measured bytes against the memory model."""
  del out, work
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from hetpipe_jax import models
  from hetpipe_jax.planning import cluster, cost_model
  from hetpipe_jax.runtime import profiler
  from hetpipe_jax.runtime import stages as stages_lib
  spec, batch = _gpt_spec(cpu), _gpt_batch(cpu)
  device = jax.devices()[0]
  tx = optax.adam(1e-4)
  num_stages = len(PARTITION)
  start, end = PARTITION[s]
  is_last = s == num_stages - 1
  # The planner's number for this stage: the cost model on a cost-analysis profile made on this device.
  prof = profiler.profile_model(spec, batch, measure=False, optimizer="adam", device=device)
  clus = _cluster_for(device) or cluster.load_cluster("h100")  # any GPU type: capacity is not used here
  costs = cost_model.build_stage_costs(prof, clus, cost_model.CostModelConfig(method="hetpipe"))
  model_bytes = costs.stage_memory_bytes(start, end, is_last, num_stages, NUM_INFLIGHT)
  layers = prof.layers[start:end]
  breakdown = {"params": sum(l.param_bytes for l in layers),
               "optimizer_state": sum(l.optimizer_state_bytes for l in layers),
               "stash_per_minibatch": sum(l.stash_bytes for l in layers),
               "input_activation": int(costs.boundary_bytes[start]),
               "received_gradient": int(costs.boundary_bytes[end]) if end < spec.num_layers else 0,
               "workspace": int(costs.workspace_max[start, end])}
  # The stage alone, with the runtime's own jitted functions.
  st = stages_lib.build_stages(spec, PARTITION, [device] * num_stages, tx)[s]
  stats0 = device.memory_stats() or {}
  base = _stage_bytes_on(device)
  params = jax.device_put(models.init_layer_params(spec, jax.random.key(0))[start:end], device)
  opt_state = jax.device_put(tx.init(params), device)
  wave_delta = jax.device_put(jax.tree.map(jnp.zeros_like, params), device)
  no_clip = jax.device_put(np.float32(0), device)  # the global norm, read only when clipping is on (it is off)
  shapes = models.activation_shapes(spec, batch)
  rng = np.random.default_rng(s)
  seq = spec.input_shape[0]

  def stage_input():
    if s == 0:
      return jax.device_put(rng.integers(0, spec.num_classes, (batch, seq)).astype(np.int32), device)
    return jax.device_put(rng.standard_normal(shapes[start - 1]).astype(np.float32), device)

  live, temps = [], {}
  sample = lambda: live.append(_stage_bytes_on(device) - base)  # noqa: E731
  h = 1 if is_last else NUM_INFLIGHT
  if is_last:
    for _ in range(2):
      labels = jax.device_put(rng.integers(0, spec.num_classes, (batch, seq)).astype(np.int32), device)
      loss, grads, gin = st.forward_backward(params, stage_input(), labels)
      jax.block_until_ready(gin)
      sample()
      params, opt_state, wave_delta = st.update(params, opt_state, grads, wave_delta, no_clip)
      del loss, grads, gin
      jax.block_until_ready(params)
      sample()
    x0 = stage_input()
    temps["forward_backward"] = st.forward_backward.lower(params, x0, labels).compile().memory_analysis()
  else:
    versions, vjps = [params], []
    zero = jax.tree.map(jnp.zeros_like, params)
    for _ in range(h):  # h forwards, each on the newest version; a minibatch completes between injections
      act, vjp = st.forward(versions[-1], stage_input())
      vjps.append(vjp)
      jax.block_until_ready(act)
      del act  # the next stage's input, counted there
      new, opt_state, wave_delta = st.update(versions[-1], opt_state, zero, wave_delta, no_clip)
      versions.append(new)
      jax.block_until_ready(new)
      sample()
    del zero
    grads_in = [jax.device_put(rng.standard_normal(shapes[end - 1]).astype(np.float32), device) for _ in range(h)]
    sample()
    x0 = stage_input()
    temps["forward"] = st.forward.lower(versions[0], x0).compile().memory_analysis()
    temps["backward"] = st.backward.lower(vjps[0], grads_in[0]).compile().memory_analysis()
    for k in range(h):
      grads, gin = st.backward(vjps[k], grads_in[k])
      vjps[k] = grads_in[k] = None
      jax.block_until_ready(grads)
      sample()
      new, opt_state, wave_delta = st.update(versions[-1], opt_state, grads, wave_delta, no_clip)
      versions[k] = None
      versions.append(new)
      del grads, gin
      jax.block_until_ready(new)
      sample()
  temp_bytes = max(int(getattr(m, "temp_size_in_bytes", 0) or 0) for m in temps.values())
  from hetpipe_jax.runtime import xla_memory
  one_minibatch = xla_memory.stage_memory(spec, (start, end), batch, is_last=is_last, optimizer="adam",
                                          device=device).peak_bytes
  stats = device.memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    measured = int(stats["peak_bytes_in_use"]) - int(stats0.get("bytes_in_use", 0))
    source = "memory_stats peak_bytes_in_use (XLA's allocator) minus the bytes in use before the stage was placed"
  else:
    measured = max(live) + temp_bytes
    source = "largest sum of the device's live arrays + the largest compiled temp buffer (no memory_stats here)"
  return {"stage": s, "layers": [start, end], "is_last": is_last, "held": h, "model_bytes": model_bytes,
          "measured_bytes": measured, "measured_source": source, "ratio": measured / model_bytes,
          "live_arrays_peak_bytes": max(live), "compiled_temp_bytes": temp_bytes,
          "xla_programs_one_minibatch_bytes": one_minibatch,
          "compiled": {k: {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
                           "temp": int(m.temp_size_in_bytes), "alias": int(m.alias_size_in_bytes)}
                       for k, m in temps.items()},
          "model_breakdown": breakdown}


def memory_summary(stages: list[dict], cpu: bool) -> dict:
  result = {"num_inflight": NUM_INFLIGHT, "partition": [list(r) for r in PARTITION], "stages": stages,
            "tolerance": MEMORY_TOLERANCE,
            "misses": [st["stage"] for st in stages if abs(st["ratio"] - 1) > MEMORY_TOLERANCE]}
  if not cpu:
    result["goal_met"] = not result["misses"]
  return result


def _plot_memory(memory: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  stages = memory["stages"]
  fig, ax = plt.subplots(figsize=(6, 4))
  xs = range(len(stages))
  ax.bar([x - 0.2 for x in xs], [st["model_bytes"] / 2**30 for st in stages], 0.4, label="memory model")
  ax.bar([x + 0.2 for x in xs], [st["measured_bytes"] / 2**30 for st in stages], 0.4, label="measured (XLA)")
  for x, st in zip(xs, stages):
    ax.text(x, max(st["model_bytes"], st["measured_bytes"]) / 2**30, f"{st['ratio']:.2f}", ha="center",
            va="bottom", fontsize=8)
  ax.set_xticks(list(xs), [f"stage {st['stage']}\nlayers {st['layers'][0]}-{st['layers'][1]}" for st in stages])
  ax.set_ylabel("GiB")
  ax.set_title(f"Per-stage peak, Nm = {memory['num_inflight']} (labels: measured / model)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


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
  fns = {"env": step_env, "pytest_gpu": step_pytest_gpu, "main_job": step_main_job, "profile": step_profile,
         "pipeline": step_pipeline}
  suffix = f"_{stage}" if stage is not None else ""
  try:
    result = step_memory_stage(cpu, out, work, stage) if step == "memory" else fns[step](cpu, out, work)
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
        record["result"] = memory_summary([r["result"] for r in ok], cpu)
        _plot_memory(record["result"], out / "memory.png")
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
