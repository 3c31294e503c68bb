"""Every entry point under scripts/ and experiments/ runs end to end in its seconds-long mode and prints JSON."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from hetpipe_jax.paths import REPO_ROOT



def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
  """Runs ``python args`` from the repo root as the scripts' users do (no test XLA_FLAGS); fails on a non-zero exit."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                        check=False)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  return proc


def _finite(*xs) -> bool:
  return all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in xs)


def test_bench_partitioner_quick():
  out = json.loads(_run(["scripts/bench_partitioner.py", "--quick"], timeout=120).stdout)
  assert out["quick"] is True
  cases = out["cases"]
  assert {c["model"] for c in cases} == {"resnet152_imagenet", "vgg19_imagenet"}
  dp = [c for c in cases if "dp_seconds" in c]
  plans = [c for c in cases if "plan_seconds" in c]
  assert len(dp) == 8 and len(plans) == 9
  x4 = [c for c in plans if "hetpipe_paper_x4" in c["case"]]
  assert len(x4) == 1 and x4[0]["target_seconds"] == 30.0 and x4[0]["allocation_search"]["max_vw_gpus"] == 5
  assert sum(x4[0]["vw_sizes"]) == 64 and x4[0]["target_met"] == (x4[0]["plan_seconds"] <= 30.0)
  assert all(_finite(c["dp_seconds"], c["max_stage_time_ms"]) and c["max_stage_time_ms"] > 0 for c in dp)
  assert all(_finite(c["plan_seconds"], c["predicted_total_minibatches_per_s"], c["num_inflight"]) for c in plans)


def test_bench_engine_quick():
  out = json.loads(_run(["scripts/bench_engine.py", "--quick"], timeout=120).stdout)
  assert out["quick"] is True and len(out["cases"]) == 2
  for c in out["cases"]:
    assert c["target_s"] is None and c["meets_target"] is None
    assert _finite(c["wall_s"], c["us_per_task"], c["simulated_minibatches_per_s"], c["simulated_makespan_s"])
    assert c["num_tasks"] > 0 and c["simulated_minibatches_per_s"] > 0
    assert c["max_clock_distance"] <= c["staleness_bound"] + 1


def test_bench_runtime_quick():
  out = json.loads(_run(["scripts/bench_runtime.py", "--quick"], timeout=180).stdout)
  assert out["quick"] is True
  host = out["host_overhead"]
  assert host["num_tasks"] > 0 and _finite(host["host_overhead_us_per_task"], host["wall_us_per_task"])
  assert _finite(*out["single_thread_launch"].values())
  wake = out["wakeup_latency"]
  assert wake["sleep_1ms_overshoot_us"]["n"] == 10 and wake["queue_handoff_wake_us"]["n"] == 20
  assert all(0 <= v["p50"] < 1e5 for v in wake.values())
  emulated = out["emulated_vs_engine"]
  assert _finite(emulated["measured_mb_per_s"], emulated["predicted_mb_per_s"], emulated["ratio"])
  assert emulated["num_minibatches"] == 3 * emulated["num_inflight"] and emulated["ratio"] > 0
  # The baselines' methods: each runs the 2-4 ms and 8-16 ms cases with the engine running the same method.
  assert set(out["methods"]) == {"pipedream", "gpipe", "1f1b_flush"}
  for method, cases in out["methods"].items():
    assert set(cases) == {"tasks_2_4ms", "tasks_8_16ms"}
    for row in cases.values():
      assert row["method"] == method and _finite(row["measured_mb_per_s"], row["predicted_mb_per_s"])
      assert 0 < row["ratio"] <= 1.5 and row["num_minibatches"] == 3 * row["num_inflight"]
  assert out["targets"]["min_ratio_methods_tasks_2_4ms"] == min(
      c["tasks_2_4ms"]["ratio"] for c in out["methods"].values())


@pytest.mark.mpi
def test_bench_runtime_stage_ranks_quick():
  """The stage-ranks benchmark's quick mode: one VW as one process and with its 3 stages on 3 ranks, under mpiexec."""
  out = json.loads(_run(["scripts/bench_runtime.py", "--stage_ranks", "--quick"], timeout=240).stdout)
  assert out["quick"] is True and "stage_ranks_vs_one_process_no_slack" not in out
  r = out["stage_ranks_vs_one_process"]
  assert r["shortest_task_ms"] >= 20 and r["num_minibatches"] == 3 * r["num_inflight"] and r["runs"] == 1
  for side in ("one_process", "stage_ranks"):
    assert _finite(r[side]["measured_mb_per_s"], r[side]["predicted_mb_per_s"], r[side]["ratio_to_engine"])
    assert r[side]["measured_mb_per_s"] > 0
  assert r["one_process"]["predicted_mb_per_s"] == r["stage_ranks"]["predicted_mb_per_s"]
  assert _finite(r["ratio"]) and r["ratio"] > 0 and r["goal_ratio"] == 0.95


@pytest.mark.mpi
def test_validate_engine_smoke(tmp_path):
  output = tmp_path / "validation.json"
  proc = _run(["experiments/validate_engine.py", "--smoke", f"--output={output}", f"--runs_dir={tmp_path / 'runs'}",
               "--timeout_s=150"], timeout=180)
  result = json.loads(output.read_text())
  assert result["mode"] == "smoke" and result["num_cases"] == 1 and len(result["rows"]) == 1
  assert set(result) >= {"warmup_waves", "tolerance_pct", "latency", "num_pass", "max_abs_error_pct", "total_wall_s"}
  (row,) = result["rows"]
  assert row["case"]["num_vws"] == 2 and row["warmup_waves"] >= 1
  nm = row["case"]["num_inflight"]
  assert row["num_minibatches_per_vw"] % nm == 0 and row["num_minibatches_per_vw"] > nm * row["warmup_waves"]
  for side in ("predicted", "measured"):
    rates = row[side]
    assert _finite(rates["total_mb_per_s"], *rates["per_vw_mb_per_s"], *rates["steady_window_s"]), side
    assert rates["total_mb_per_s"] > 0 and not rates["total_is_sum_of_per_vw"], side
  assert _finite(row["error_pct"], *row["per_vw_error_pct"], row["measured"]["job_wall_s"])
  assert row["case"]["name"] in proc.stdout  # the table


@pytest.mark.mpi
def test_wsp_study_smoke(tmp_path, synthetic_data_dir):
  out = tmp_path / "study"
  proc = _run(["experiments/wsp_study.py", "--smoke", f"--data_dir={synthetic_data_dir}", f"--output_dir={out}"],
              timeout=240)
  result = json.loads(proc.stdout)
  assert result == json.loads((out / "wsp_study.json").read_text())
  assert (out / "wsp_study.png").stat().st_size > 5_000 and "| on_receipt |" in (out / "wsp_study.md").read_text()
  assert set(result["cases"]) == {"default", "het3_d2"}
  for name, case in result["cases"].items():
    engine_rows = case["engine"]
    assert {(r["ps_apply"], r["pull_every_wave"]) for r in engine_rows} == {
        (a, p) for a in ("on_receipt", "clock_aligned") for p in (True, False)}
    for r in engine_rows:
      assert _finite(r["predicted_minibatches_per_s"], r["fraction_with_extra_updates"]) and r["num_waves"] == 10
      if r["ps_apply"] == "clock_aligned":
        assert r["minibatches_with_extra_updates"] == 0
    trained = {r["ps_apply"]: r for r in case["trained"]}
    assert set(trained) == {"on_receipt", "clock_aligned"}
    assert trained["clock_aligned"]["minibatches_with_extra_updates"] == 0
    for mode, r in trained.items():  # each run's own summary and config say the mode that ran
      summary = json.loads((out / f"{name}-{mode}" / "summary.json").read_text())
      config = json.loads((out / f"{name}-{mode}" / "config.json").read_text())
      assert summary["ps_apply"] == config["ps_apply"] == mode
      assert r["test_accuracy"] == summary["test_accuracy"]
  het = result["cases"]["het3_d2"]
  assert {r["mode"] for r in het["trained"]} == {"virtual"} and het["trained"][0]["num_virtual_workers"] == 3
  # 3 VWs at 1x / 1.5x / 3x with D = 2: the fast VWs' newer waves reach the others' weights on receipt.
  assert next(r for r in het["trained"] if r["ps_apply"] == "on_receipt")["minibatches_with_extra_updates"] > 0
  assert all(r["minibatches_with_extra_updates"] > 0 for r in het["engine"] if r["ps_apply"] == "on_receipt")


@pytest.mark.mpi
def test_bench_checkpoint_smoke(tmp_path, synthetic_data_dir):
  """The checkpoint-overhead benchmark: both runs of a pair really ran, with and without checkpoints (stage ranks and
  two shards: the layout whose cut gathers the most)."""
  out = json.loads(_run(["scripts/bench_checkpoint.py", "--smoke", f"--data_dir={synthetic_data_dir}",
                         f"--workdir={tmp_path}", "--layout=stage_ranks_shards"], timeout=300).stdout)
  assert out["smoke"] is True and out["meets_target"] is None and out["layout"] == "stage_ranks_shards"
  (pair,) = out["pairs"]
  with_ckpt = json.loads((tmp_path / "r0_ckpt" / "summary.json").read_text())
  waves = 8 // with_ckpt["num_inflight"]  # 8 minibatches per VW
  assert pair["checkpoint_every_waves"] == 2 and pair["num_checkpoints"] == waves // 2 >= 1
  assert [c["global_clock"] for c in with_ckpt["checkpoints"]] == list(range(2, waves + 1, 2))
  assert all(mb > 0 for mb in pair["checkpoint_mb"]) and _finite(pair["overhead"], pair["checkpoint_barrier_fraction"])
  assert pair["first"] == "with" and pair["cpu_s_with"] > 0 and pair["cpu_s_without"] > 0  # 6 ranks' CPU seconds
  assert 0 < pair["checkpoint_barrier_fraction"] < 1
  assert with_ckpt["num_ps_shards"] == 2 and with_ckpt["applied_waves_count_per_shard"] == [2 * waves] * 2
  assert with_ckpt["stage_rank_of_stage"] == [[2, 4], [3, 5]]  # each VW's second stage on its own rank
  without = json.loads((tmp_path / "r0_none" / "summary.json").read_text())
  assert without["checkpoint_every_waves"] == 0 and without["checkpoints"] == []


@pytest.mark.mpi
def test_methods_throughput_smoke(tmp_path):
  output = tmp_path / "methods.json"
  proc = _run(["experiments/methods_throughput.py", "--smoke", f"--output={output}", f"--runs_dir={tmp_path / 'r'}"],
              timeout=600)
  result = json.loads(output.read_text())
  assert [r["method"] for r in result["rows"]] == ["hetpipe", "pipedream", "gpipe", "1f1b_flush", "horovod"]
  for r in result["rows"]:
    assert _finite(r["steady_images_per_s"], r["run_images_per_s"]) and r["steady_images_per_s"] > 0, r
  assert [r["ranks"] for r in result["rows"]] == [3, 3, 2, 2, 2]
  assert "| horovod | 2 x 1 |" in proc.stdout


def test_records_digest_smoke_and_compare():
  """scripts/records_digest.py: a record file's digest ignores host wall-clock fields and the run directory's path
  (--smoke asserts it), and --compare names the files whose digests differ."""
  out = json.loads(_run(["scripts/records_digest.py", "--smoke"], timeout=60).stdout)
  assert out["minibatches.jsonl"] and out["summary.json"] and out["config.json"] is None
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("records_digest", REPO_ROOT / "scripts" / "records_digest.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  a = {"run": {"summary.json": "1", "weights": "2"}}
  assert mod.compare(a, a) == []
  assert mod.compare(a, {"run": {"summary.json": "1", "weights": "3"}}) == ["run/weights"]
  assert mod.compare(a, {}) == ["run: only in first"]


@pytest.mark.mpi
def test_bench_ps_quick():
  """scripts/bench_ps.py --quick: push + pull through 1 and 2 shards against raw Send/Recv of the same bytes."""
  proc = subprocess.run([sys.executable, "scripts/bench_ps.py", "--quick"], cwd=REPO_ROOT, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout)
  assert sorted((r["num_shards"], r["size_bytes"]) for r in out["rows"]) == [(1, 1024), (1, 1 << 20), (2, 1024),
                                                                             (2, 1 << 20)]
  for r in out["rows"]:
    assert r["waves"] >= 3 and 0 < r["ratio"] < 50 and r["ps_s_per_wave"] > 0 and r["raw_s_per_wave"] > 0


@pytest.mark.parametrize("script,flag,mode", [
    ("experiments/methods_throughput.py", "--num_minibatches=5", "--smoke"),
    ("experiments/validate_engine.py", "--cases=pipedream_2x2", "--smoke"),
    ("experiments/validate_engine.py", "--nolatency", "--smoke"),
    ("experiments/ps_load.py", "--num_vws=3", "--smoke"),
    ("experiments/recovery_drill.py", "--drills=vw", "--smoke"),
    ("experiments/wsp_study.py", "--het3_epochs=1", "--smoke"),
    ("experiments/delay_sweep.py", "--minibatches=3", "--smoke"),
    ("experiments/lm_check.py", "--runs=config", "--smoke"),
    ("scripts/bench_checkpoint.py", "--num_minibatches=3", "--smoke"),
    ("experiments/fsdp_validate.py", "--steps=5", "--quick"),
    ("scripts/bench_engine.py", "--repeats=2", "--quick"),
    ("scripts/engine_fingerprint.py", "--num_cases=4", "--quick"),
    ("scripts/bench_ps.py", "--sizes_kb=4", "--quick"),
    ("scripts/bench_runtime.py", "--runs=2", "--quick"),
    ("experiments/paper/convergence.py", "--seeds=3", "--quick"),
    ("experiments/staleness_study.py", "--lm_minibatches=100", "--quick"),
])
def test_a_smoke_mode_refuses_a_flag_it_replaces(tmp_path, script, flag, mode):
  """Each --smoke (or --quick) mode picks its own run length, cases or model: a flag it replaces, given beside it,
  used to be dropped (the run recorded the mode's values); now one ``error:`` line names it, exit 2, before any
  work."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  proc = subprocess.run([sys.executable, str(REPO_ROOT / script), mode, flag], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120, check=False)
  name = flag.split("=")[0].replace("--no", "--")
  assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
  assert proc.stderr.startswith(f"error: {mode} sets ") and f"; {name} would not run: leave it out" in proc.stderr
  assert list(tmp_path.iterdir()) == []  # nothing written (the scripts' outputs default to paths under the cwd)
