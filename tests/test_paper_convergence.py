"""experiments/paper/convergence.py --quick end to end: HetPipe §8.4's configurations, their timing plans, the
times to target, the speed-ups and waiting statistics recomputed from the recorded curves, and the shared claims."""

import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax.paths import REPO_ROOT

CLAIM_KEYS = {"claim", "paper", "ours", "difference", "why", "command", "calibrated"}


@pytest.fixture(scope="module")
def result(tmp_path_factory, synthetic_data_dir):
  out = tmp_path_factory.mktemp("convergence")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  proc = subprocess.run([sys.executable, "experiments/paper/convergence.py", "--quick", f"--data_dir={synthetic_data_dir}",
                         f"--output_dir={out}"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
                        check=False)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  assert proc.stdout.strip().endswith("convergence.json")
  return out, json.loads((out / "convergence.json").read_text())


def test_configurations_are_the_papers(result):
  """Figure 5: Horovod and HetPipe on the 12 GPUs without the RTX 2060s, HetPipe on 16; Figure 6: 16 GPUs, D 0/4/32;
  HetPipe is ED (every VW one GPU of each node) with four VWs; Horovod one replica per GPU."""
  _, r = result
  pc = r["per_config"]
  assert list(pc) == ["fig5_horovod12", "fig5_hetpipe12", "fig5_hetpipe16", "fig6_horovod16", "fig6_d0", "fig6_d4",
                      "fig6_d32"]
  want = {"fig5_horovod12": (12, 12, 0), "fig5_hetpipe12": (12, 4, 0), "fig5_hetpipe16": (16, 4, 0),
          "fig6_horovod16": (16, 16, 0), "fig6_d0": (16, 4, 0), "fig6_d4": (16, 4, 4), "fig6_d32": (16, 4, 32)}
  for name, (gpus, vws, d) in want.items():
    p = pc[name]
    assert (p["plan"]["gpus"], p["plan"]["num_vws"], p["staleness_bound"]) == (gpus, vws, d), name
    assert p["timing_model"] == ("resnet152_imagenet" if name.startswith("fig5") else "vgg19_imagenet")
    plan = json.loads((REPO_ROOT / p["plan"]["path"]).read_text())
    assert plan["model"] == p["timing_model"] and plan["batch_size"] == 32
    # The timing cluster: the paper's nodes (without G for 12 GPUs), every type at the recorded fitted efficiency.
    cluster = json.loads(open(plan["cluster"]).read())
    assert "".join(n["name"] for n in cluster["nodes"]) == ("VRQ" if name.startswith("fig5") and gpus == 12 else
                                                            "VRGQ")
    assert r["calibrated_cost_model"] is True and len(r["roofline_efficiency"]) == 4
    assert {t["name"]: t["roofline_efficiency"] for t in cluster["gpu_types"]} == r["roofline_efficiency"]
    assert all(0 < e <= 1 for e in r["roofline_efficiency"].values())
    if p["method"] == "hetpipe":
      nodes = {"VRQ"} if gpus == 12 else {"VRGQ"}
      assert {"".join(sorted(g, key="VRGQ".index)) for g in p["plan"]["vw_gpus"]} == nodes
      assert plan["ps_placement"]["policy"] == "local" and plan["policy"] == "ED"
      assert p["plan"]["num_inflight"] == plan["num_inflight"] >= 1
    else:
      assert sorted({g[0] for g in p["plan"]["vw_gpus"]}) == sorted("VRQ" if gpus == 12 else "VRGQ")
      assert p["plan"]["num_inflight"] == 1 and len(p["plan"]["our_memory_model_gpus"]) <= gpus


def test_horovod_time_is_steps_times_slowest_replica_plus_allreduce(result):
  """All-reduce BSP closed form: step k's update is on every replica at k x (the slowest replica's whole-model time
  + the all-reduce), when its evaluation is stamped; the run ends when the last step's compute does (the engine's
  makespan). The learning rate is N times the per-VW rate (linear scaling)."""
  _, r = result
  for name in ("fig5_horovod12", "fig6_horovod16"):
    p = r["per_config"][name]
    plan = json.loads((REPO_ROOT / p["plan"]["path"]).read_text())
    compute_s = max(vw["stage_time_ms"][0] for vw in plan["virtual_workers"]) / 1000
    allreduce_s = p["plan"]["allreduce_s"]
    assert allreduce_s > 0.01 * compute_s
    for run in p["runs"]:
      steps = round((run["simulated_time_s"] + allreduce_s) / (compute_s + allreduce_s))
      assert steps == 3  # --quick: 3 epochs of 512 examples, one step of N x 32 each
      assert run["simulated_time_s"] == pytest.approx(steps * compute_s + (steps - 1) * allreduce_s, rel=1e-6)
      times = [t for t, _ in run["curve"]]
      assert times[:-1] == pytest.approx([k * (compute_s + allreduce_s) for k in range(1, steps)], rel=1e-6)
      assert times[-1] == run["simulated_time_s"]
      assert run["learning_rate"] == pytest.approx(r["learning_rate"] * p["plan"]["num_vws"])
  for name in ("fig5_hetpipe12", "fig6_d4"):
    assert all(run["learning_rate"] == r["learning_rate"] for run in r["per_config"][name]["runs"])


def test_times_speedups_and_waits_follow_from_the_recorded_curves(result):
  _, r = result
  target = r["target_accuracy"]
  pc = r["per_config"]
  for name, p in pc.items():
    for run, t in zip(p["runs"], p["time_to_target_s"]):
      assert run["curve"], name
      hits = [s for s, acc in run["curve"] if acc >= target]
      assert t == (hits[0] if hits else None), name
      assert all(0.0 <= acc <= 1.0 for _, acc in run["curve"])
      assert [s for s, _ in run["curve"]] == sorted(s for s, _ in run["curve"])
      assert run["minibatches_per_s"] > 0 and run["mean_wait_s"] >= 0 and run["mean_idle_s"] >= 0
  assert len(r["speedups"]) == 6
  for s in r["speedups"]:
    fast, slow = pc[s["faster"]]["time_to_target_s"], pc[s["slower"]]["time_to_target_s"]
    want = [None if a is None or b is None else 1 - a / b for a, b in zip(fast, slow)]
    assert s["time_reduction_per_seed"] == pytest.approx(want)
  w = r["waiting"]
  d0 = sum(x["mean_wait_s"] for x in pc["fig6_d0"]["runs"]) / len(pc["fig6_d0"]["runs"])
  d4 = sum(x["mean_wait_s"] for x in pc["fig6_d4"]["runs"]) / len(pc["fig6_d4"]["runs"])
  assert d0 > 0  # D = 0: every wave end waits for the pull round trip
  assert w["mean_wait_s"]["d0"] == pytest.approx(d0) and w["wait_d4_over_d0"] == pytest.approx(d4 / d0)
  # A larger D never waits longer on identical ED VWs; Horovod's replicas wait in every all-reduce.
  assert d4 <= d0 and pc["fig6_horovod16"]["mean_wait_s"]["mean"] > 0


def test_claims_png_and_markdown_follow_the_shared_convention(result):
  out, r = result
  claims = r["claims"]
  assert len(claims) == 8 and all(set(c) == CLAIM_KEYS for c in claims)
  assert [c["paper"] for c in claims] == [0.35, 0.39, 0.29, 0.28, 0.49, -0.047, 0.62, 0.18]
  assert all(c["calibrated"] is False and "--quick" in c["command"] for c in claims)
  assert all(isinstance(c["ours"], (int, float, str)) for c in claims)
  assert (out / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert r["png"].endswith("convergence.png") and r["markdown"] == (out / "convergence.md").read_text()
  assert "not its ImageNet accuracy" in r["markdown"] and "| HetPipe D=32 (vgg19) | 16 (4) |" in r["markdown"]
  assert "not its ImageNet accuracy" in r["note"]
