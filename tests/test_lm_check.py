"""experiments/lm_check.py: the LM config's 15-minute check, end to end in its smoke mode, and its settings check."""

import json
import os
import subprocess
import sys

import pytest

from experiments import lm_check
from hetpipe_jax.paths import REPO_ROOT


def _env():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  return env


@pytest.mark.mpi
def test_lm_check_smoke(tmp_path, text_dir):
  """One MPI run of lm.py through scripts/run_main.sh: the preset's and the override's settings are what ran (read
  back from config.json), and the row's derived numbers follow from the run's own summary."""
  proc = subprocess.run([sys.executable, "experiments/lm_check.py", "--smoke", f"--text_dir={text_dir}",
                         f"--output_dir={tmp_path}"], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                        timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  assert out == json.loads((tmp_path / "lm_check.json").read_text()) and out["smoke"] is True
  (row,) = out["runs"]
  assert row["returncode"] == 0 and row["run"] == "muon_nm2_d1:learning_rate=0.002"
  s = row["settings"]
  assert (s["optimizer"], s["muon_consistent_rms"], s["num_inflight"], s["staleness_bound"]) == ("muon", 0.2, 2, 1)
  assert s["learning_rate"] == 0.002 and s["num_minibatches"] == 4
  summary = json.loads((tmp_path / "0_muon_nm2_d1" / "summary.json").read_text())
  entropy = json.loads((tmp_path / "0_muon_nm2_d1" / "config.json").read_text())["dataset_info"][
      "unigram_entropy_bits_per_byte"]
  assert row["test_bits_per_byte"] == round(summary["test_bits_per_byte"], 4)
  assert row["below_entropy"] == round(1 - summary["test_bits_per_byte"] / entropy, 4)
  assert row["wall_s_with_setup"] >= row["training_s"] > 0
  assert row["target_met"] is False  # 4 minibatches cannot get 40% below the entropy


@pytest.mark.parametrize("bad,match", [("sgd_nm2", "NAME must be one of"), ("config:lr", "must be key=value")])
def test_a_bad_run_is_one_error_naming_it(bad, match):
  with pytest.raises(ValueError, match=match):
    lm_check.parse_run(bad)


def test_the_cli_refuses_a_bad_run_before_any_work(tmp_path):
  proc = subprocess.run([sys.executable, "experiments/lm_check.py", "--runs=config,bogus",
                         f"--output_dir={tmp_path / 'out'}"], cwd=REPO_ROOT, env=_env(), capture_output=True,
                        text=True, timeout=120, check=False)
  assert proc.returncode == 1 and proc.stdout == ""
  assert proc.stderr.strip().splitlines()[-1].startswith("error: --runs: 'bogus': NAME must be one of")
  assert not (tmp_path / "out").exists()
