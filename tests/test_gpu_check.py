"""scripts/gpu_check.sh's CPU rehearsal (issue 28): every step runs on CPU devices and gpu_check.json holds each
step's fields, checked against closed forms (task counts, layer counts, the bytes a stage must at least hold)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess

import pytest

from hetpipe_jax.paths import REPO_ROOT

SCRIPT = str(REPO_ROOT / "scripts" / "gpu_check.sh")


def _run(out: pathlib.Path, *args: str, timeout: float = 540) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "OUT")}
  return subprocess.run(["bash", SCRIPT, "--cpu", f"--out={out}", f"--work_dir={out}.work", *args], cwd=REPO_ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_cpu_rehearsal_runs_every_step(tmp_path):
  """``gpu_check.py --cpu`` runs every step, the in-process measurements of ``scripts/gpu_measure.py`` (profile,
  pipeline, memory) included, each in its own process: CI's smoke of both scripts."""
  out = tmp_path / "out"
  proc = _run(out)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((out / "gpu_check.json").read_text())
  assert report["mode"] == "cpu rehearsal" and report["all_ok"] is True
  steps = report["steps"]
  assert list(steps) == ["env", "pytest_gpu", "main_job", "profile", "pipeline", "memory"]
  assert all(r["status"] == "ok" and r["seconds"] > 0 for r in steps.values()), steps
  # What comes back from a GPU loan: the report, three plots and the two measured profiles, nothing deeper.
  assert sorted(p.name for p in out.iterdir()) == sorted([
      "gpu_check.json", "main_job_metrics.png", "memory.png", "profile.png", "profile_cnn_b8.json",
      "profile_gpt2_small_cpu_rehearsal_b2.json"])

  env = steps["env"]["result"]
  # The set-up's venv runs every pinned version, and the report says so package by package.
  assert env["pinned_versions_ran"] is True and env["pinned"]["jax"]["ran"] == env["pinned"]["jax"]["pinned"]
  assert env["versions"]["jax"] and env["mpi_library"].startswith("MPICH") and env["default_backend"] == "cpu"

  # pytest -m gpu collected the GPU test(s) and skipped them here (no nvidia-smi), failing none.
  counts = steps["pytest_gpu"]["result"]["counts"]
  assert counts.get("skipped", 0) >= 1 and not counts.get("failed") and "tests/test_setup_gpu.py" in \
      steps["pytest_gpu"]["result"]["files"]

  main = steps["main_job"]["result"]
  assert main["platform"] == "cpu" and main["num_virtual_workers"] == 2 and main["num_stages"] == 2
  assert main["num_minibatches"] == 2 * 16 and 0.0 <= main["test_accuracy"] <= 1.0 and main["minibatches_per_s"] > 0

  profile = steps["profile"]["result"]
  assert set(profile["models"]) == {"cnn", "gpt2_small_cpu_rehearsal"}
  for name, num_layers in (("cnn", 7), ("gpt2_small_cpu_rehearsal", 14)):
    m = profile["models"][name]
    assert len(m["layers"]) == num_layers and m["fitted_efficiency"] > 0
    # The fitted efficiency is the one at which the roofline's total equals the measured total.
    ideal = sum(r["roofline_ms_at_efficiency_1"] for r in m["layers"])
    assert m["fitted_efficiency"] == pytest.approx(ideal / m["measured_total_ms"], rel=1e-9)
    if m["fitted_efficiency"] <= 1:
      assert sum(r["roofline_ms_at_fitted"] for r in m["layers"]) == pytest.approx(m["measured_total_ms"], rel=1e-6)
    saved = json.loads((out / m["profile_file"]).read_text())
    assert saved["measured"] is True and len(saved["layers"]) == num_layers

  pipe = steps["pipeline"]["result"]
  num_stages, n = len(pipe["partition"]), pipe["minibatches"]
  # Every minibatch runs a forward and a backward on each non-last stage and one forward+backward on the last.
  assert pipe["num_tasks"] == n * (2 * num_stages - 1)
  assert pipe["useful_compute_ratio"] == pytest.approx(n * pipe["whole_model_step_ms"] / 1e3 / pipe["runtime_wall_s"],
                                                       rel=1e-9)
  assert 0 < pipe["useful_compute_ratio"] and pipe["host_overhead_us_per_task"] > 0

  memory = steps["memory"]["result"]
  assert [st["stage"] for st in memory["stages"]] == [0, 1, 2, 3]
  for st in memory["stages"]:
    b = st["model_breakdown"]
    # Lower bound (closed form): the weight versions (held + 1), the wave's delta and the optimizer state are live
    # together; a non-last stage also keeps its held minibatches' residuals.
    floor = b["params"] * (st["held"] + 2) + b["optimizer_state"]
    assert st["live_arrays_peak_bytes"] >= floor, st
    assert st["measured_bytes"] >= st["live_arrays_peak_bytes"] and math.isfinite(st["ratio"]) and st["ratio"] > 0
    assert st["held"] == (1 if st["is_last"] else memory["num_inflight"])


def test_a_failing_step_is_recorded_and_the_rest_run(tmp_path):
  """A step past its limit is recorded as a timeout; the next step still runs; the exit is non-zero."""
  out = tmp_path / "out"
  proc = _run(out, "--steps=profile,env", "--step_timeout_s=profile:0.5", timeout=120)
  assert proc.returncode == 1, proc.stdout + proc.stderr
  report = json.loads((out / "gpu_check.json").read_text())
  assert report["all_ok"] is False
  assert report["steps"]["profile"]["status"] == "timeout" and report["steps"]["profile"]["timeout_s"] == 0.5
  assert report["steps"]["env"]["status"] == "ok"


@pytest.mark.parametrize("arg, message", [
    ("--steps=env,nonsense", "--steps has unknown steps ['nonsense']"),
    ("--step_timeout_s=main_job:-3", "--step_timeout_s='main_job:-3': give STEP:SECONDS"),
])
def test_bad_arguments_stop_before_any_work(tmp_path, arg, message):
  out = tmp_path / "out"
  proc = _run(out, arg, timeout=60)
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr
  assert not out.exists()


FAKE_PIP = '''
import pathlib, sys
args = sys.argv[1:]
assert args[0] == "download", args
dest = pathlib.Path(args[args.index("-d") + 1])
assert args[args.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in args, args
for spec in [a for a in args if "==" in a]:
  name, version = spec.split("==")
  (dest / f"{name}-{version}-py3-none-any.whl").write_bytes(b"w" * 1000)
'''


def test_gpu_wheels_makes_the_carry_over(tmp_path, synthetic_data_dir):
  """scripts/gpu_wheels.sh asks pip for the three wheels at requirements.txt's pins for CPython 3.12 and copies the
  four Fashion-MNIST files (a stand-in pip: no download in the suite)."""
  (tmp_path / "pip.py").write_text(FAKE_PIP)
  carry = tmp_path / "carry"
  env = dict(os.environ, GPU_CARRY=str(carry), HETPIPE_DATA_DIR=str(synthetic_data_dir),
             PIP=f"{os.sys.executable} {tmp_path / 'pip.py'}")
  proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gpu_wheels.sh")], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=60, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  pins = dict(line.split("==") for line in (REPO_ROOT / "requirements.txt").read_text().split("\n")
              if "==" in line and not line.startswith("#"))
  want = sorted(f"{n}-{pins[n].split()[0]}-py3-none-any.whl" for n in ("ml_collections", "mpi4py", "mpich"))
  assert sorted(p.name for p in (carry / "wheels").iterdir()) == want
  for f in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
            "t10k-labels-idx1-ubyte.gz"):
    assert (carry / "fashion-mnist" / f).read_bytes() == (synthetic_data_dir / f).read_bytes()
  assert "of the 64 MiB a device call carries" in proc.stdout
