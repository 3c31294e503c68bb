"""Every entry point runs end to end in a seconds-long mode: the main job's script and `train --mode=virtual`.

(`plan` and `simulate` run in tests/test_plan_cli.py and tests/test_trace.py; `validate_engine` and the benchmark
scripts in tests/test_scripts_smoke.py; `train` under MPI in tests/test_mpi_job.py.)
"""

import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax.paths import REPO_ROOT
from tests.mpi_util import read_jsonl

PLAN_DECIDED = ("num_virtual_workers", "num_stages", "partition", "num_inflight")


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = str(REPO_ROOT)
  env.update(extra)
  return env


def _check_outputs(workdir):
  """config.json and summary.json agree on every plan-decided setting; every output file is there."""
  config = json.loads((workdir / "config.json").read_text())
  summary = json.loads((workdir / "summary.json").read_text())
  for name in PLAN_DECIDED:
    assert config[name] == summary[name], name
    assert name in config["setting_sources"]
  assert summary["plan"] == config["plan"] != ""  # the plan's path in both (summary.json held True here)
  for name in ("metrics.jsonl", "minibatches.jsonl", "ps_applied.jsonl", "metrics.png", "checkpoint"):
    assert (workdir / name).exists(), name
  assert (workdir / "metrics.png").stat().st_size > 5_000
  assert summary["applied_waves_in_order"] is True
  assert summary["applied_waves_count"] == len(read_jsonl(workdir / "ps_applied.jsonl"))
  assert 0.0 <= summary["test_accuracy"] <= 1.0
  return config, summary


@pytest.mark.mpi
def test_run_main_script_smoke(tmp_path, synthetic_data_dir):
  """`bash scripts/run_main.sh` (set-up + the default config from its plan) with 4 minibatches per VW."""
  workdir = tmp_path / "main"
  proc = subprocess.run(
      ["bash", "scripts/run_main.sh", "--config.num_minibatches=4", "--config.check_counts=False",
       "--config.progress=False", "--config.eval_every_epochs=0"],
      cwd=REPO_ROOT, env=_env(WORKDIR=str(workdir), HETPIPE_DATA_DIR=str(synthetic_data_dir)), capture_output=True,
      text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  config, summary = _check_outputs(workdir)
  plan = json.loads((REPO_ROOT / config["plan"]).read_text())
  assert summary["num_inflight"] == plan["num_inflight"] and config["setting_sources"]["num_inflight"] == "plan"
  assert summary["num_minibatches"] == 4 * len(plan["virtual_workers"])


def test_train_virtual_mode_cli_smoke(tmp_path, synthetic_data_dir):
  """`python -m hetpipe_jax.train --mode=virtual` with the paper's 16-GPU plan (paper_virtual.py: emulate_plan=True):
  the plan's task times are used and recorded. Given ``emulate_plan=False`` with no other times, the run used to take
  the plan's times anyway and record True; now it is refused naming the setting (unset, virtual time takes them:
  tests/test_job_config.py)."""
  args = [sys.executable, "-m", "hetpipe_jax.train", "--mode=virtual", "--config=experiments/configs/paper_virtual.py",
          f"--config.data_dir={synthetic_data_dir}", "--config.check_counts=False", "--config.progress=False",
          "--config.num_minibatches=6", "--config.eval_every_epochs=0"]
  refused = subprocess.run(args + [f"--workdir={tmp_path / 'refused'}", "--config.emulate_plan=False"], cwd=REPO_ROOT,
                           env=_env(), capture_output=True, text=True, timeout=300)
  assert refused.returncode == 2, refused.stderr[-3000:]
  assert "error: config.emulate_plan=False leaves --mode=virtual without task durations" in refused.stderr
  workdir = tmp_path / "virtual"
  proc = subprocess.run(args + [f"--workdir={workdir}"], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  config, summary = _check_outputs(workdir)
  plan = json.loads((REPO_ROOT / config["plan"]).read_text())
  assert summary["mode"] == "virtual" and summary["time_unit"] == "simulated seconds"
  assert config["emulate_plan"] is True  # the value that ran: the plan's GPU types gave the task durations
  assert summary["num_virtual_workers"] == len(plan["virtual_workers"]) == 4
  assert summary["num_inflight"] == plan["num_inflight"]
  assert summary["simulated_time_s"] > 0 and summary["host_wall_time_s"] > 0
  assert summary["shared_nic"] is True  # the engine's network rule as it ran (on by default)


def test_train_rejects_a_conflicting_setting_before_any_work(tmp_path):
  """One `error:` line naming both values, exit 2, and nothing written."""
  workdir = tmp_path / "never"
  proc = subprocess.run(
      [sys.executable, "-m", "hetpipe_jax.train", "--mode=virtual", "--config=experiments/configs/paper_virtual.py",
       f"--workdir={workdir}", "--config.num_stages=2"],
      cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "error: config.num_stages=2 but the plan" in proc.stderr and "[4, 4, 4, 4] stages" in proc.stderr
  assert not workdir.exists()


@pytest.mark.parametrize("workers", ["two", "-1", "2x"])
def test_run_tests_refuses_a_bad_worker_count_before_set_up(workers):
  """scripts/run_tests.sh: HETPIPE_TEST_WORKERS that is not a number of workers (empty: the default, 2) is one error
  naming it, exit 2, and nothing runs (no set-up line, no pytest)."""
  proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=REPO_ROOT, env=_env(HETPIPE_TEST_WORKERS=workers),
                        capture_output=True, text=True, timeout=30, check=False)
  assert proc.returncode == 2, proc.stderr
  assert f"HETPIPE_TEST_WORKERS={workers} must be a number of workers" in proc.stderr
  assert "setup:" not in proc.stdout + proc.stderr and "passed" not in proc.stdout


def test_plan_flag_and_config_plan_naming_different_plans_are_refused(tmp_path):
  """``--plan`` replaced a ``--config.plan`` given beside it without a word; two different plans are now one
  ``error:`` line and exit 2 (the same plan twice, or ``--config.plan=`` cleared, still runs from ``--plan``)."""
  proc = subprocess.run(
      [sys.executable, "-m", "hetpipe_jax.train", "--mode=virtual", "--config=experiments/configs/tiny.py",
       f"--workdir={tmp_path / 'run'}", "--plan=experiments/plans/local_cpu_cnn_b64.json",
       "--config.plan=experiments/plans/local_cpu_2node_mlp_tiny_ed_local.json"],
      cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert ("error: --plan=experiments/plans/local_cpu_cnn_b64.json and --config.plan=experiments/plans/"
          "local_cpu_2node_mlp_tiny_ed_local.json name different plans: give one") in proc.stderr
  assert not (tmp_path / "run" / "summary.json").exists()

