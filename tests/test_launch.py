"""The launcher (``python -m hetpipe_jax.launch``): rank mapping, hostfiles, the dry run, and a real run of a two-node
ED plan on one machine (every node mapped to localhost) with sharded parameter servers and local placement."""

import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax.jobs.job_config import plan_nodes
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.planning import plan_format, rank_map

ED_LOCAL = "experiments/plans/local_cpu_2node_mlp_tiny_ed_local.json"
NP_CPU = "experiments/plans/local_cpu_cnn_b64.json"


def _launch(*args, timeout=240):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  return subprocess.run([sys.executable, "-m", "hetpipe_jax.launch", *args], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_hostfile_syntax_and_node_mapping():
  assert rank_map.read_hostfile("# cluster\nnodeA:4\nnodeB\n\nnodeA:2  # again\n") == ["nodeA", "nodeB"]
  with pytest.raises(rank_map.LaunchError, match="line 1 'a b': expected MPICH syntax"):
    rank_map.read_hostfile("a b\n")
  assert rank_map.node_hosts(["n0", "n1"], []) == {"n0": "localhost", "n1": "localhost"}
  assert rank_map.node_hosts(["n0", "n1"], ["h0", "h1", "h2"]) == {"n0": "h0", "n1": "h1"}
  with pytest.raises(rank_map.LaunchError, match="2 hosts for a plan with 3 nodes"):
    rank_map.node_hosts(["a", "b", "c"], ["h0", "h1"])


def test_ranks_follow_the_jobs_layout():
  plan = plan_format.load_plan(ED_LOCAL)
  slots = rank_map.map_ranks(plan, plan_nodes(plan), 2, ["localhost"])
  assert [(s.rank, s.role, s.nodes, s.host) for s in slots] == [
      (0, "ps shard 0 (lead)", ("n0",), "localhost"), (1, "ps shard 1", ("n1",), "localhost"),
      (2, "VW 0", ("n0", "n1"), "localhost"), (3, "VW 1", ("n0", "n1"), "localhost")]
  assert rank_map.machinefile(slots) == "localhost:1\n" * 4
  # An ED VW spans both nodes: on two hosts it would need stage ranks, which the launcher says plainly.
  with pytest.raises(rank_map.LaunchError, match="VW 0's stages run on nodes n0, n1, mapped to different hosts"):
    rank_map.map_ranks(plan, plan_nodes(plan), 2, ["h0", "h1"])
  # NP: one VW per node maps onto its own host.
  np_plan = plan_format.load_plan(NP_CPU)
  slots = rank_map.map_ranks(np_plan, plan_nodes(np_plan), 1, ["h0"])
  assert [s.host for s in slots] == ["h0"] * 3 and slots[1].devices == tuple(np_plan.virtual_workers[0].devices)


def test_dry_run_prints_the_mapping_and_the_command(tmp_path):
  hosts = tmp_path / "hosts"
  hosts.write_text("localhost\n")
  proc = _launch(f"--plan={ED_LOCAL}", f"--hostfile={hosts}", "--dry_run", f"--workdir={tmp_path / 'run'}", "--",
                 "--config.num_minibatches=8")
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout
  assert "ps shard 0 (lead)" in out and "VW 1" in out and out.count("localhost:1") == 4
  command = next(line for line in out.splitlines() if line.startswith("command: "))
  assert " -n 4 " in command and "--config.num_ps_shards=2" in command and "--config.num_minibatches=8" in command
  assert f"--config.plan={ED_LOCAL}" in command and "-f " in command
  assert not (tmp_path / "run").exists()  # a dry run starts nothing


def test_bad_hostfile_is_one_error_line(tmp_path):
  hosts = tmp_path / "hosts"
  hosts.write_text("h0\nh1\n")
  proc = _launch(f"--plan={ED_LOCAL}", f"--hostfile={hosts}", "--dry_run")
  assert proc.returncode == 2 and proc.stderr.startswith("error: VW 0's stages run on nodes n0, n1"), proc.stderr
  proc = _launch("--plan=missing.json", "--dry_run")
  assert proc.returncode == 2 and "error: --plan=missing.json" in proc.stderr


@pytest.mark.mpi
def test_launch_runs_an_ed_plan_with_local_placement_and_no_cross_node_ps_bytes(tmp_path, synthetic_data_dir):
  """ED + local (HetPipe §8.1), launched on one machine: each layer's shard is on the node that runs it, so no PS
  byte crosses (mapped) nodes, while both shards served both VWs."""
  workdir = tmp_path / "run"
  proc = _launch(f"--plan={ED_LOCAL}", "--config=experiments/configs/tiny.py", f"--workdir={workdir}", "--",
                 f"--config.data_dir={synthetic_data_dir}", "--config.check_counts=False", "--config.progress=False",
                 "--config.num_minibatches=8", "--config.checkpoint_every_waves=0")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (workdir / "ranks.hosts").read_text() == "localhost:1\n" * 4
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["num_ps_shards"] == 2 and summary["ps_placement"] == "local"
  assert summary["ps_shards"]["layer_shards"] == [None, 0, 1, 1]
  ps_bytes = summary["ps_bytes"]
  assert ps_bytes["predicted_crossing_nodes_per_wave"] == 0 and ps_bytes["crossing_nodes"] == 0
  assert all(ps_bytes["by_rank_pair"][pair] > 0 for pair in ("2->0", "2->1", "3->0", "3->1", "0->2", "1->3"))
  assert summary["applied_waves_in_order_per_shard"] == [True, True]
  assert summary["applied_waves_count_per_shard"] == [8, 8]  # 2 VWs x 4 waves on each shard
