"""The paper-reproduction scripts (experiments/paper/): calibration, Nm chosen by the engine, results, REPRODUCTION.md
(HetPipe §8)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from experiments.paper import calibration
from experiments.paper import common
from experiments.paper import paper_tables as pt
from experiments.paper import reproduction
from experiments.paper import waiting as waiting_lib
from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.planning import allocator
from hetpipe_jax.planning import compare as compare_lib
from hetpipe_jax.planning import planner


def _run(args, timeout=240):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout, check=False)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  return proc


def test_calibration_recovers_known_efficiencies_from_horovod_rates():
  # Round trip: make Table 4's Horovod rates with the engine from known efficiencies (each new type the slowest
  # where the fit needs it), then fit: the efficiencies come back. The oracle is the engine's all-reduce BSP run,
  # the fit a closed-form inversion of it.
  base = common.load_cluster()
  truth = {"TITAN V": 0.40, "TITAN RTX": 0.25, "Quadro P4000": 0.55, "GeForce RTX 2060": 0.35}
  true_cluster = calibration.Calibration(truth, [], list(truth)).apply(base)
  profiles = {m: common.load_profile(m) for m in pt.MODELS}
  table = {m: {col: calibration.horovod_images_per_s(true_cluster, profiles[m],
                                                       calibration.horovod_gpus(base, pt.TABLE4_NODES[col]), 400)
               for col in pt.TABLE4_COLUMNS} for m in pt.MODELS}
  cal = calibration.fit(base, profiles, table)
  assert cal.order == ["TITAN V", "TITAN RTX", "Quadro P4000", "GeForce RTX 2060"]
  for t, e in truth.items():
    assert cal.efficiency[t] == pytest.approx(e, rel=0.01), t
  assert all(c["identifies_type"] for c in cal.cells)


def test_paper_calibration_uses_only_the_horovod_cells_and_fits_them():
  cluster, cal = calibration.calibrate()
  assert len(calibration.CALIBRATION_CELLS) == 7
  assert all(m == "horovod" for m, _, _ in calibration.CALIBRATION_CELLS)
  assert not any(calibration.is_calibration_cell("hetpipe", m, c) for m in pt.MODELS for c in pt.TABLE4_COLUMNS)
  assert set(cal.efficiency) == set(pt.NODE_TYPES.values())
  assert all(0.05 < e < 1 for e in cal.efficiency.values())
  assert {t.name: t.roofline_efficiency for t in cluster.gpu_types.values()} == cal.efficiency
  # One efficiency per type shared by both models: each cell is fitted to within the two models' disagreement
  # (TITAN V: VGG-19 implies 0.385, ResNet-152 0.323, so +-9%), never exactly and never far.
  profile = common.load_profile("resnet152_imagenet")
  gpus = calibration.horovod_gpus(cluster, pt.TABLE4_NODES["V4R4"])
  rate = calibration.horovod_images_per_s(cluster, profile, gpus, 200)
  assert rate == pytest.approx(pt.TABLE4_HOROVOD["resnet152_imagenet"]["V4R4"], rel=0.05)


def test_calibrated_cluster_file_carries_the_fitted_efficiencies(tmp_path):
  path = tmp_path / "cal.json"
  proc = _run(["experiments/paper/calibration.py", "--quick", f"--results_dir={tmp_path / 'r'}",
               f"--write_cluster={path}"])
  assert "TITAN RTX" in proc.stdout
  loaded = cluster_lib.load_cluster(str(path))
  _, cal = calibration.calibrate()
  assert loaded.name == "hetpipe_paper_calibrated"
  assert {n: t.roofline_efficiency for n, t in loaded.gpu_types.items()} == pytest.approx(cal.efficiency)
  data = json.loads((tmp_path / "r" / "calibration.json").read_text())
  assert len(data["claims"]) == 7 and all(c["calibrated"] for c in data["claims"])
  assert data["efficiency"] == pytest.approx(cal.efficiency)


def test_planner_fixes_hetpipe_num_inflight_or_says_why_not():
  cluster = cluster_lib.load_cluster("hetpipe_paper")
  profile = common.load_profile("resnet152_imagenet")
  free = planner.make_plan(cluster, profile, planner.PlannerConfig(policy="NP", num_vws=4))
  max_m = min(vw.max_num_inflight for vw in free.virtual_workers)
  for nm in (1, max_m):
    plan = planner.make_plan(cluster, profile, planner.PlannerConfig(policy="NP", num_vws=4, num_inflight=nm))
    assert plan.num_inflight == nm
  with pytest.raises(allocator.AllocationError, match=f"num_inflight={max_m + 1} does not fit"):
    planner.make_plan(cluster, profile, planner.PlannerConfig(policy="NP", num_vws=4, num_inflight=max_m + 1))
  with pytest.raises(allocator.AllocationError, match="cannot be fixed with policy 'auto'"):
    planner.make_plan(cluster, profile, planner.PlannerConfig(policy="auto", num_vws=4, num_inflight=2))


def test_num_inflight_chosen_by_the_engine_is_the_fastest_engine_run():
  cluster = common.sub_cluster(cluster_lib.load_cluster("hetpipe_paper"), ["V", "R"])
  profile = common.load_profile("resnet152_imagenet")
  config = common.compare_config(quick=True)
  pc = planner.PlannerConfig(policy="ED", num_vws=4, ps_placement="local")
  choice = compare_lib.choose_num_inflight_by_engine(cluster, profile, pc, config, max_num_inflight=4)
  assert sorted(choice.rates) == [1, 2, 3, 4]
  best = max(choice.rates.values())
  assert choice.rates[choice.plan.num_inflight] == pytest.approx(best, rel=0.001)
  assert choice.row.images_per_s == choice.rates[choice.plan.num_inflight]
  # Each candidate is an independent engine run of the plan at that Nm (oracle: run it again by hand).
  for nm in (1, 3):
    plan = planner.make_plan(cluster, profile, dataclasses.replace(pc, num_inflight=nm))
    row = compare_lib.run_plan(plan, profile, cluster, config, "ED", "local")
    assert row.images_per_s == pytest.approx(choice.rates[nm], rel=1e-12)
  # More minibatches in flight help an ED pipeline of 2 GPUs until it saturates.
  assert choice.rates[2] > choice.rates[1] * 1.3
  with pytest.raises(ValueError, match="hetpipe NP/ED/HD"):
    compare_lib.choose_num_inflight_by_engine(cluster, profile, dataclasses.replace(pc, policy="auto"), config)


def test_sub_cluster_keeps_named_nodes_and_rejects_unknown_ones():
  cluster = cluster_lib.load_cluster("hetpipe_paper")
  sub = common.sub_cluster(cluster, ["R", "V"])
  assert [n.name for n in sub.nodes] == ["V", "R"] and len(sub.gpus()) == 8
  with pytest.raises(ValueError, match="unknown node 'X'"):
    common.sub_cluster(cluster, ["V", "X"])


def test_quick_modes_and_reproduction_page(tmp_path):
  results = tmp_path / "results"
  out = tmp_path / "REPRODUCTION.md"
  _run(["experiments/paper/reproduction.py", "--quick", f"--results_dir={results}", f"--output={out}"])
  for name in ("calibration", "table3", "fig4", "table4"):
    data = json.loads((results / f"{name}.json").read_text())
    assert data["claims"] and data["markdown"] and (results / f"{name}.png").stat().st_size > 1000
    for c in data["claims"]:
      assert set(reproduction.CLAIM_KEYS) <= set(c)
    if name != "calibration":  # the HetPipe predictions record the in-flight memory count they used
      assert data["inflight_memory"] == common.INFLIGHT_MEMORY == "schedule"
  # Table 4: Horovod cells are the calibration set, HetPipe cells predictions with their Nm and concurrency.
  t4 = json.loads((results / "table4.json").read_text())
  assert [r["column"] for r in t4["rows"]] == ["V4", "V4R4"]
  for r in t4["rows"]:
    h, p = r["horovod"], r["hetpipe"]
    assert h["calibrated"] and not p["calibrated"]
    assert p["concurrent_minibatches"] == p["num_inflight"] * p["num_vws"]
    assert p["num_vws"] == pt.TABLE4_NUM_VWS[r["column"]]
    assert p["paper"] == pt.TABLE4_HETPIPE[r["model"]][r["column"]]
    # Bounds: positive, and below every GPU running the whole model at its own compute speed.
    profile = common.load_profile(r["model"])
    cluster, _ = calibration.calibrate()
    gpus = calibration.horovod_gpus(cluster, pt.TABLE4_NODES[r["column"]])
    bound = sum(1e3 * 32 / calibration.whole_model_ms(profile, cluster, g.gpu_type, None) for g in gpus)
    assert 0.2 * bound < p["ours"] < bound
    assert p["ours"] == max(p["engine_images_per_s_by_num_inflight"].values())
  claims = [c for c in t4["claims"] if "HetPipe" in c["claim"]]
  assert claims and not any(c["calibrated"] for c in claims)
  f4 = json.loads((results / "fig4.json").read_text())
  bars = f4["bars"]["resnet152_imagenet"]
  assert set(bars) == {"NP", "ED", "HD", "ED-local", "Horovod"}
  assert bars["Horovod"]["gpus"] == 12
  # Local placement removes the PS bytes between nodes: ED-local moves fewer bytes than ED at the same Nm.
  if bars["ED"]["num_inflight"] == bars["ED-local"]["num_inflight"]:
    assert bars["ED-local"]["cross_node_bytes_per_step"] < bars["ED"]["cross_node_bytes_per_step"]
  # Horovod's ring over 3 nodes: 3 crossings of 2 (N-1)/N x params (N = 12).
  params = sum(l.param_bytes for l in common.load_profile("resnet152_imagenet").layers)
  assert bars["Horovod"]["cross_node_bytes_per_step"] == pytest.approx(3 * 2 * 11 / 12 * params, rel=1e-6)
  # Waiting statistics: both pull policies, D = 0 and D = 4 per (policy, jitter CV); the paper's policy (pull only
  # when D requires it) waits at D = 4 with deterministic times, ours (a pull at every wave end) never does.
  wt = json.loads((results / "waiting.json").read_text())
  assert {(r["pull_policy"], r["cv"]) for r in wt["rows"]} == {(p, cv) for p in waiting_lib.POLICIES
                                                                 for cv in waiting_lib.QUICK_CVS}
  for r in wt["rows"]:
    assert r["mean_wait_s"]["d0"] > 0 and r["mean_wait_s"]["d4"] <= r["mean_wait_s"]["d0"]
    assert r["max_clock_distance"]["0"] <= 1 and r["max_clock_distance"]["4"] <= 5
  still = {r["pull_every_wave"]: r for r in wt["rows"] if r["cv"] == 0}
  assert still[False]["mean_wait_s"]["d4"] > 0 and still[True]["mean_wait_s"]["d4"] == 0
  assert wt["claims"] and not any(c["calibrated"] for c in wt["claims"])
  page = out.read_text()
  assert "Waiting statistics vs timing jitter" in page
  assert "not run yet" in page  # the convergence sections (branch paper-conv)
  assert "![Table 4" in page and "calibration | " in page and "prediction | " in page
  assert "Quick mode" in page


def test_reproduction_tolerates_missing_files_and_rejects_bad_claims(tmp_path):
  page = reproduction.render(reproduction.load_results(str(tmp_path)), str(tmp_path))
  for stem, title, _, paper_claims in reproduction.SECTIONS:
    assert f"## {title}" in page
    assert all(pc.replace("|", "\\|") in page for pc in paper_claims)
  assert page.count("| not run yet |") == sum(len(s[3]) for s in reproduction.SECTIONS)
  good = {"claims": [common.claim("c1", 1, 2, "+100%", "because", "cmd", False)], "markdown": "| t |",
          "png": "x.png"}
  (tmp_path / "newexp.json").write_text(json.dumps(good))
  page = reproduction.render(reproduction.load_results(str(tmp_path)), str(tmp_path))
  assert "## newexp" in page and "| c1 | 1 | 2 | +100% | because | prediction | `cmd` |" in page
  bad = {"claims": [{"claim": "c", "paper": 1}]}
  (tmp_path / "table4.json").write_text(json.dumps(bad))
  with pytest.raises(ValueError, match="table4.json: claims\\[0\\] lacks"):
    reproduction.load_results(str(tmp_path))


def test_compare_with_nm_by_engine_is_never_slower_than_the_planners_nm():
  # The engine-chosen Nm is the best of every Nm the planner could pick, so each HetPipe NP/ED/HD row is at least
  # the closed-form row (same D, same engine); the others are untouched.
  cluster = common.sub_cluster(cluster_lib.load_cluster("hetpipe_paper"), ["V", "R"])
  profile = common.load_profile("resnet152_imagenet")
  base = compare_lib.CompareConfig(num_vws=4, num_waves=8)
  table, _ = compare_lib.compare(cluster, profile, base)
  tuned, _ = compare_lib.compare(cluster, profile, dataclasses.replace(base, num_inflight_by_engine=True))
  changed = 0
  for a, b in zip(table, tuned):
    assert a.label == b.label
    if a.method == "hetpipe" and a.allocation in compare_lib.PIPELINE_POLICIES and a.memory_fits:
      assert b.images_per_s >= a.images_per_s * (1 - 1e-9), a.label
      changed += b.num_inflight != a.num_inflight
    else:
      assert b.images_per_s == a.images_per_s, a.label
  assert changed >= 1  # the closed form (no synchronisation, no PS time) does not pick the engine's best everywhere
