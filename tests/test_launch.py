"""The launcher (``python -m hetpipe_jax.launch``): rank mapping, hostfiles, the dry run, and a real run of a two-node
ED plan on one machine (every node mapped to localhost) with sharded parameter servers and local placement."""

import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax import recovery
from hetpipe_jax.jobs.job_config import plan_nodes
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.mpi import rank_layout
from hetpipe_jax.planning import plan_format

ED_LOCAL = "experiments/plans/local_cpu_2node_mlp_tiny_ed_local.json"
ED4 = "experiments/plans/local_cpu_4node_mlp_tiny_ed.json"  # 4 nodes x 2 CPU "GPUs": 2 VWs x 4 stages, one per node
HD4 = "experiments/plans/local_cpu_4node_mlp_tiny_hd.json"  # 2 VWs x 4 stages, two per node
NP_CPU = "experiments/plans/local_cpu_cnn_b64.json"


def _launch(*args, timeout=240):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  return subprocess.run([sys.executable, "-m", "hetpipe_jax.launch", *args], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_hostfile_syntax_and_node_mapping():
  assert rank_layout.read_hostfile("# cluster\nnodeA:4\nnodeB\n\nnodeA:2  # again\n") == ["nodeA", "nodeB"]
  with pytest.raises(rank_layout.LaunchError, match="line 1 'a b': expected MPICH syntax"):
    rank_layout.read_hostfile("a b\n")
  assert rank_layout.node_hosts(["n0", "n1"], []) == {"n0": "localhost", "n1": "localhost"}
  assert rank_layout.node_hosts(["n0", "n1"], ["h0", "h1", "h2"]) == {"n0": "h0", "n1": "h1"}
  with pytest.raises(rank_layout.LaunchError, match="2 hosts for a plan with 3 nodes"):
    rank_layout.node_hosts(["a", "b", "c"], ["h0", "h1"])


def test_ranks_follow_the_jobs_layout():
  plan = plan_format.load_plan(ED_LOCAL)
  slots = rank_layout.map_ranks(plan, plan_nodes(plan), 2, ["localhost"])
  assert [(s.rank, s.role, s.nodes, s.host) for s in slots] == [
      (0, "ps shard 0 (lead)", ("n0",), "localhost"), (1, "ps shard 1", ("n1",), "localhost"),
      (2, "VW 0", ("n0", "n1"), "localhost"), (3, "VW 1", ("n0", "n1"), "localhost")]
  assert rank_layout.machinefile(slots) == "localhost:1\n" * 4
  # An ED VW spans both nodes: on two hosts it would need stage ranks, which the launcher says plainly.
  with pytest.raises(rank_layout.LaunchError, match="VW 0's stages run on nodes n0, n1, mapped to different hosts"):
    rank_layout.map_ranks(plan, plan_nodes(plan), 2, ["h0", "h1"])
  # NP: one VW per node maps onto its own host.
  np_plan = plan_format.load_plan(NP_CPU)
  slots = rank_layout.map_ranks(np_plan, plan_nodes(np_plan), 1, ["h0"])
  assert [s.host for s in slots] == ["h0"] * 3 and slots[1].devices == tuple(np_plan.virtual_workers[0].devices)


def test_stage_ranks_map_every_stage_to_its_nodes_host():
  """With stage ranks an ED VW spans hosts: rank S+v runs its stage 0 on stage 0's node's host, one rank per further
  stage follows (or one per further node with the node grouping, HD: two stages per node)."""
  plan = plan_format.load_plan(ED4)
  hosts = ["h0", "h1", "h2", "h3"]
  slots = rank_layout.map_ranks(plan, plan_nodes(plan), 4, hosts, "gpu")
  assert len(slots) == 4 + 2 + 6
  host_of = dict(zip(plan_nodes(plan), hosts))
  for s in slots[4:]:
    assert s.host == host_of[s.nodes[0]] and len(s.nodes) == 1 and len(s.devices) == 1
  assert [(s.rank, s.role) for s in slots[4:7]] == [(4, "VW 0 stage 0"), (5, "VW 1 stage 0"), (6, "VW 0 stage 1")]
  vw0 = plan.virtual_workers[0]
  assert [s.nodes[0] for s in slots if s.role.startswith("VW 0")] == [g.split("/")[0] for g in vw0.gpus]
  hd = plan_format.load_plan(HD4)
  slots = rank_layout.map_ranks(hd, plan_nodes(hd), 4, hosts, "node")
  assert [(s.rank, s.role, s.nodes) for s in slots[4:]] == [
      (4, "VW 0 stages 0,1", ("n0",)), (5, "VW 1 stages 0,1", ("n1",)), (6, "VW 0 stages 2,3", ("n2",)),
      (7, "VW 1 stages 2,3", ("n3",))]
  assert slots[6].devices == (0, 1) and slots[6].host == "h2"


def test_dry_run_prints_the_mapping_and_the_command(tmp_path):
  hosts = tmp_path / "hosts"
  hosts.write_text("localhost:4\n")  # 2 shards + 2 VWs
  proc = _launch(f"--plan={ED_LOCAL}", f"--hostfile={hosts}", "--dry_run", f"--workdir={tmp_path / 'run'}", "--",
                 "--config.num_minibatches=8")
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout
  assert "ps shard 0 (lead)" in out and "VW 1" in out and out.count("localhost:1") == 4
  command = next(line for line in out.splitlines() if line.startswith("command: "))
  assert " -n 4 " in command and "--config.num_ps_shards=2" in command and "--config.num_minibatches=8" in command
  assert f"--config.plan={ED_LOCAL}" in command and "-f " in command
  assert not (tmp_path / "run").exists()  # a dry run starts nothing


def test_dry_run_with_stage_ranks(tmp_path):
  hosts = tmp_path / "hosts"
  hosts.write_text("a:2\nb:2\nc:2\nd:2\n")
  proc = _launch(f"--plan={HD4}", f"--hostfile={hosts}", "--dry_run", "--stage_ranks", "--stage_rank_grouping=node",
                 f"--workdir={tmp_path / 'run'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  command = next(line for line in proc.stdout.splitlines() if line.startswith("command: "))
  assert " -n 8 " in command and "--config.stage_ranks=True" in command
  assert "--config.stage_rank_grouping=node" in command
  assert "VW 0 stages 2,3" in proc.stdout


def test_dry_run_names_each_ranks_gpus(tmp_path):
  """Each rank sees only its plan GPUs: the 4-node ED plan with stage ranks (2 VWs x 4 stages, one per node; VW v on
  GPU v of every node) gives shards none, each stage rank its stage's node-local GPU, in the printed table and in
  the command's -genv HETPIPE_RANK_DEVICES (which every rank reads before jax starts)."""
  proc = _launch(f"--plan={ED4}", "--dry_run", "--stage_ranks", f"--workdir={tmp_path / 'run'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  plan = plan_format.load_plan(ED4)
  expected = [()] * 4 + [(plan.virtual_workers[v].devices[0],) for v in range(2)]
  expected += [(plan.virtual_workers[v].devices[s],) for v in range(2) for s in range(1, 4)]
  table = ";".join(",".join(map(str, ids)) or "-" for ids in expected)
  assert table == "-;-;-;-;0;1;0;0;0;1;1;1"
  command = next(line for line in proc.stdout.splitlines() if line.startswith("command: "))
  assert f" -genv HETPIPE_RANK_DEVICES '{table}' " in command
  lines = proc.stdout.split("visible GPUs per rank")[1].splitlines()[1:13]
  assert [line.split() for line in lines] == [[str(r), entry] for r, entry in enumerate(table.split(";"))]


def test_rank_devices_restrict_cuda_on_gpu_and_change_nothing_on_cpu():
  """HETPIPE_RANK_DEVICES on a rank: GPU: CUDA_VISIBLE_DEVICES = its GPUs (a shard: none, on the host's CPU), a
  stage's plan GPU becomes its place among them; CPU: the environment is untouched, the table still returned; a
  malformed table or one of the wrong length is an error naming the variable."""
  from hetpipe_jax.mpi import rank_devices
  env = {"HETPIPE_RANK_DEVICES": "-;2,3;1"}
  got = rank_devices.apply(1, 3, "gpu", env)
  assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and got.gpus == (2, 3) and got.local_index(3) == 1
  with pytest.raises(rank_devices.RankDevicesError, match="GPU 1 is not among"):
    got.local_index(1)
  env = {"HETPIPE_RANK_DEVICES": "-;2,3;1"}
  rank_devices.apply(0, 3, "gpu", env)
  assert env["CUDA_VISIBLE_DEVICES"] == "" and env["JAX_PLATFORMS"] == "cpu"
  env = {"HETPIPE_RANK_DEVICES": "-;2,3;1"}
  got = rank_devices.apply(2, 3, "cpu", env)
  assert env == {"HETPIPE_RANK_DEVICES": "-;2,3;1"} and got.applied == "none (cpu)" and got.local_index(1) == 1
  assert got.table == ((), (2, 3), (1,))
  assert rank_devices.apply(0, 3, "gpu", {}) is None
  with pytest.raises(rank_devices.RankDevicesError, match="HETPIPE_RANK_DEVICES.*3 ranks' entries; the job has 4"):
    rank_devices.apply(0, 4, "gpu", {"HETPIPE_RANK_DEVICES": "-;2,3;1"})
  with pytest.raises(rank_devices.RankDevicesError, match="rank 1's entry 'x'"):
    rank_devices.parse_table("-;x")


@pytest.mark.mpi
def test_a_bad_rank_device_table_stops_every_rank(tmp_path, synthetic_data_dir):
  """A HETPIPE_RANK_DEVICES that does not fit the job stops every rank before any work: one error line naming it,
  non-zero exit, no hang."""
  from tests.mpi_util import mpiexec
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(PYTHONPATH=str(REPO_ROOT), HETPIPE_RANK_DEVICES="-;0")
  proc = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-m", "mpi4py", "-m", "hetpipe_jax.train",
                         "--config=experiments/configs/tiny.py", f"--workdir={tmp_path / 'run'}",
                         f"--config.data_dir={synthetic_data_dir}", "--config.check_counts=False",
                         "--config.progress=False"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode != 0
  assert "error: HETPIPE_RANK_DEVICES='-;0' has 2 ranks' entries; the job has 3 ranks" in proc.stderr, proc.stderr


def test_bad_hostfile_is_one_error_line(tmp_path):
  hosts = tmp_path / "hosts"
  hosts.write_text("h0\nh1\n")
  proc = _launch(f"--plan={ED_LOCAL}", f"--hostfile={hosts}", "--dry_run")
  assert proc.returncode == 2 and proc.stderr.startswith("error: VW 0's stages run on nodes n0, n1"), proc.stderr
  proc = _launch("--plan=missing.json", "--dry_run")
  assert proc.returncode == 2 and "error: --plan=missing.json" in proc.stderr


@pytest.mark.parametrize("flag,needs", [("--stage_rank_grouping=node", "--stage_ranks"),
                                        ("--watchdog_s=60.5", "--max_restarts=K"),
                                        ("--cluster=hetpipe_paper", "--max_restarts=K")])
def test_a_flag_given_without_the_flag_it_needs_is_refused(tmp_path, flag, needs):
  """The launcher used to drop ``--stage_rank_grouping=node`` without ``--stage_ranks`` (and the recovery flags
  without ``--max_restarts``) and run without them; now it exits 2 naming both, before printing any command."""
  proc = _launch(f"--plan={ED_LOCAL}", "--dry_run", flag, f"--workdir={tmp_path / 'run'}")
  name = flag.split("=")[0]
  assert proc.returncode == 2 and proc.stderr.startswith(f"error: {flag} is used only with {needs}"), proc.stderr
  assert f"leave {name} out" in proc.stderr and "command:" not in proc.stdout


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


@pytest.mark.mpi
def test_launch_runs_an_all_reduce_plan_without_a_ps_rank(tmp_path, synthetic_data_dir):
  """A gpipe plan has no parameter server: the launcher used to lay out a PS shard rank and pass
  ``--config.num_ps_shards=1``, which the job refuses for gpipe, so no all-reduce plan could be launched. Now its
  rank table is the VWs alone and the run trains; ``--num_ps_shards`` with it is one error line."""
  plan = tmp_path / "gpipe.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  made = subprocess.run([sys.executable, "-m", "hetpipe_jax.plan", "--cluster=local_cpu", "--model=mlp_tiny",
                         "--batch_size=32", "--num_vws=2", "--method=gpipe", "--num_inflight=2", f"--output={plan}"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert made.returncode == 0, made.stderr[-3000:]
  refused = _launch(f"--plan={plan}", "--dry_run", "--num_ps_shards=2", f"--workdir={tmp_path / 'no'}")
  assert refused.returncode == 2, refused.stderr[-3000:]
  assert "error: --num_ps_shards=2: the plan's method 'gpipe' has no parameter server" in refused.stderr
  workdir = tmp_path / "run"
  proc = _launch(f"--plan={plan}", "--config=experiments/configs/tiny.py", f"--workdir={workdir}", "--",
                 "--config.method=gpipe", f"--config.data_dir={synthetic_data_dir}", "--config.check_counts=False",
                 "--config.progress=False", "--config.num_minibatches=4", "--config.eval_every_epochs=0")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "ps shard" not in proc.stdout and "num_ps_shards" not in proc.stdout.split("command:")[1]
  assert (workdir / "ranks.hosts").read_text() == "localhost:1\n" * 2
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["method"] == "gpipe" and summary["allreduce"]["replicas_identical"]
  assert summary["num_minibatches"] == 2 * 4 and summary["checkpoint_every_waves"] == 0


def _check_stage_rank_run(workdir, plan_path, grouping, num_minibatches):
  """A launched run with stage ranks and one PS shard per node: outputs, ranks per stage, every shard applied every
  wave once, WSP's bounds, and the final weights equal the per-shard replay of the recorded versions."""
  import jax
  import numpy as np
  import optax
  from hetpipe_jax import models
  from hetpipe_jax.data import fashion_mnist, sharding
  from hetpipe_jax.jobs import checkpoint
  from hetpipe_jax.ps.shards import ShardLayout
  from hetpipe_jax.runtime.param_layout import ParamLayout
  from tests.mpi_util import read_jsonl
  from tests.replay import read_applied_order, replay_final_weights
  plan = plan_format.load_plan(plan_path)
  summary = json.loads((workdir / "summary.json").read_text())
  config = json.loads((workdir / "config.json").read_text())
  assert config["stage_ranks"] is True and config["stage_rank_grouping"] == grouping
  groups = [rank_layout.stage_groups([g.split("/")[0] for g in vw.gpus], grouping) for vw in plan.virtual_workers]
  assert summary["stage_rank_of_stage"] == [rank_layout.stage_ranks_of_vw(4, groups, v) for v in range(2)]
  assert summary["num_ps_shards"] == 4 and summary["ps_placement"] == "local"
  nm = summary["num_inflight"]
  num_waves = num_minibatches // nm
  assert summary["applied_waves_count_per_shard"] == [2 * num_waves] * 4
  assert summary["applied_waves_in_order_per_shard"] == [True] * 4
  records = read_jsonl(workdir / "minibatches.jsonl")
  assert len(records) == 2 * num_minibatches
  d = config["staleness_bound"]
  assert all(r["version_global_clock"] >= r["local_clock_at_injection"] - d for r in records)
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  layout = ParamLayout.from_layer_params(params0)
  shard_layout = ShardLayout.build(layout.layer_offsets, summary["ps_shards"]["layer_shards"], 4)
  logs = [read_applied_order(workdir, s) for s in range(4)]
  dataset = fashion_mnist.load_fashion_mnist(config["data_dir"], expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, 2, v, config["batch_size"], 0) for v in range(2)]
  expected = replay_final_weights(records, spec, params0, optax.sgd(config["learning_rate"]), sources, nm, logs[0],
                                  shards=list(zip(shard_layout.index, logs)))
  actual = layout.flatten(checkpoint.restore_weights(workdir / "checkpoint"))
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("plan_path, grouping, ranks", [(ED4, "gpu", 12), (HD4, "node", 8)])
def test_launch_runs_4_node_ed_and_hd_plans_with_stage_ranks_and_sharded_ps(tmp_path, synthetic_data_dir, plan_path,
                                                                            grouping, ranks):
  """The 4-node cluster's ED plan (every VW on all four nodes: one rank per stage) and HD plan (two stages per node:
  one rank per node of a VW), launched on one machine with stage ranks and 4 PS shards (local placement)."""
  workdir = tmp_path / "run"
  mb = 12
  proc = _launch(f"--plan={plan_path}", "--config=experiments/configs/tiny.py", f"--workdir={workdir}",
                 "--stage_ranks", f"--stage_rank_grouping={grouping}", "--",
                 f"--config.data_dir={synthetic_data_dir}", "--config.check_counts=False", "--config.progress=False",
                 f"--config.num_minibatches={mb}", "--config.checkpoint_every_waves=0", "--config.optimizer=sgd",
                 "--config.learning_rate=0.05", timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (workdir / "ranks.hosts").read_text() == "localhost:1\n" * ranks
  _check_stage_rank_run(workdir, plan_path, grouping, mb)


@pytest.mark.mpi
@pytest.mark.parametrize("placement", ["local", "default"])
def test_stage_ranks_move_ps_bytes_between_their_own_nodes_and_shards(tmp_path, synthetic_data_dir, placement):
  """Stage ranks push and pull their own layers' parts straight to and from the shards (HetPipe §8.1), so the bytes
  the transport counts per rank pair, mapped to the plan's nodes, are the planner's: the two-node ED plan with
  ``local`` placement moves no PS byte between nodes (each stage rank talks only to its own node's shard), with
  ``default`` placement the cross-node bytes per wave equal planning/ps_placement's prediction within 1%; each
  shard applied every wave once (a wave counted once all its parts arrived)."""
  workdir = tmp_path / "run"
  proc = _launch(f"--plan={ED_LOCAL}", "--config=experiments/configs/tiny.py", f"--workdir={workdir}",
                 "--stage_ranks", "--", f"--config.data_dir={synthetic_data_dir}", "--config.check_counts=False",
                 "--config.progress=False", "--config.num_minibatches=8", "--config.checkpoint_every_waves=0",
                 f"--config.ps_placement={placement}", timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["stage_rank_of_stage"] == [[2, 4], [3, 5]] and summary["ps_placement"] == placement
  config = json.loads((workdir / "config.json").read_text())  # each rank's GPUs: recorded, a no-op on CPU
  assert config["rank_visible_devices"] == [[], [], [0], [1], [0], [1]]
  assert config["rank_devices_applied"] == "none (cpu)"
  assert (workdir / "ranks.devices").read_text() == "0 -\n1 -\n2 0\n3 1\n4 0\n5 1\n"
  ps_bytes = summary["ps_bytes"]
  assert ps_bytes["attribution"] == "ranks"
  nodes = ps_bytes["rank_nodes"]
  assert nodes["0"] != nodes["1"] and nodes["2"] == nodes["3"] == nodes["0"] and nodes["4"] == nodes["5"] == nodes["1"]
  pairs = ps_bytes["by_rank_pair"]
  assert all(pairs.get(f"{r}->{s}", 0) > 0 for r in (4, 5) for s in ((1,) if placement == "local" else (0, 1)))
  assert summary["applied_waves_in_order_per_shard"] == [True, True]
  assert summary["applied_waves_count_per_shard"] == [8, 8]  # 2 VWs x 4 waves on each shard
  if placement == "local":
    assert ps_bytes["predicted_crossing_nodes_per_wave"] == 0
    assert ps_bytes["crossing_nodes"] == 0 and not ps_bytes["crossing_nodes_by_rank_pair"]
    assert all(pairs.get(f"{r}->0", 0) == 0 for r in (4, 5))  # stage 1's layers never reach node 0's shard
  else:
    predicted = ps_bytes["predicted_crossing_nodes_per_wave"]
    assert predicted > 0 and ps_bytes["crossing_nodes"] > 0
    assert ps_bytes["crossing_nodes_per_wave"] == pytest.approx(predicted, rel=0.01)


def _plan_cli(*args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(REPO_ROOT)
  return subprocess.run([sys.executable, "-m", "hetpipe_jax.plan", *args], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


def test_a_gpus_device_index_defaults_to_its_index_on_its_node(tmp_path):
  """Issue 23 defect 1: the paper's cluster file has no local_devices, so every stage's GPU index was null and the
  README's launch stopped. A GPU's device index is its index within its node (``V/2``: device 2), the cluster file's
  ``local_devices`` overrides it, older plans with null devices read the same default, and a plan whose index is
  still unusable is refused naming the GPU and what to change."""
  out = tmp_path / "plan.json"
  r = _plan_cli("--cluster=hetpipe_paper", "--model=cnn", "--batch_size=64", "--policy=ED", "--num_vws=4",
                f"--output={out}")
  assert r.returncode == 0, r.stderr[-2000:]
  written = json.loads(out.read_text())["virtual_workers"]  # plain json, apart from the code under test
  for vw in written:
    assert vw["devices"] == [int(g.split("/")[1]) for g in vw["gpus"]], vw
  assert sorted(vw["devices"] for vw in written) == [[v] * 4 for v in range(4)]  # ED: VW v on GPU v of every node
  # The cluster file's local_devices overrides one GPU; the others keep their index on their node.
  cluster = json.loads((REPO_ROOT / "experiments/clusters/hetpipe_paper.json").read_text())
  cluster["local_devices"] = {"R/1": 3, "R/3": 1}
  (tmp_path / "cluster.json").write_text(json.dumps(cluster))
  r = _plan_cli(f"--cluster={tmp_path / 'cluster.json'}", "--model=cnn", "--batch_size=64", "--policy=ED",
                "--num_vws=4", f"--output={out}")
  assert r.returncode == 0, r.stderr[-2000:]
  for vw in json.loads(out.read_text())["virtual_workers"]:
    assert vw["devices"] == [cluster["local_devices"].get(g, int(g.split("/")[1])) for g in vw["gpus"]], vw
  # A plan written with null devices (before the default) reads as the default, and the launcher maps it.
  old = json.loads((REPO_ROOT / "experiments/plans/hetpipe_paper_cnn_b64_ed.json").read_text())
  assert all(d is None for vw in old["virtual_workers"] for d in vw["devices"])
  plan = plan_format.load_plan(str(REPO_ROOT / "experiments/plans/hetpipe_paper_cnn_b64_ed.json"))
  assert [list(vw.devices) for vw in plan.virtual_workers] == [
      [int(g.split("/")[1]) for g in vw["gpus"]] for vw in old["virtual_workers"]]
  # The steps: the paper's ED plan, a hostfile of four `localhost:5` lines (one host, 20 slots), a dry run.
  hosts = tmp_path / "hosts"
  hosts.write_text("localhost:5\n" * 4)
  r = _plan_cli("--cluster=hetpipe_paper", "--model=cnn", "--batch_size=64", "--policy=ED", "--num_vws=4",
                f"--output={out}")
  assert r.returncode == 0, r.stderr[-2000:]
  proc = _launch(f"--plan={out}", f"--hostfile={hosts}", "--dry_run", f"--workdir={tmp_path / 'run'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  command = next(line for line in proc.stdout.splitlines() if line.startswith("command: "))
  vw_gpus = [vw["devices"][0] for vw in json.loads(out.read_text())["virtual_workers"]]
  assert f" -genv HETPIPE_RANK_DEVICES '-;-;-;-;{';'.join(map(str, vw_gpus))}' -n 8 " in command
  # An index that is still unusable (a hand-edited plan) names the GPU and the fix, in the launcher's one error line.
  bad = json.loads(out.read_text())
  bad["virtual_workers"][1]["devices"][2] = -1
  (tmp_path / "bad.json").write_text(json.dumps(bad))
  proc = _launch(f"--plan={tmp_path / 'bad.json'}", f"--hostfile={hosts}", "--dry_run")
  gpu = bad["virtual_workers"][1]["gpus"][2]
  assert proc.returncode == 2 and proc.stderr.count("error:") == 1, proc.stderr
  assert f"virtual worker 1: GPU {gpu} has device index -1" in proc.stderr
  assert "set the cluster file's local_devices for it and re-plan" in proc.stderr


def test_hostfile_slots_limit_the_ranks_on_each_host_unless_oversubscribed(tmp_path):
  """Issue 23 defect 5: a host gets at most its hostfile slots (``host`` alone: 1; a host on several lines: their
  sum); more is refused naming the host, its slots and its ranks, unless ``--oversubscribe``."""
  assert rank_layout.hostfile_slots("a:3\nb\n# c:9\na:2  # again\n") == {"a": 5, "b": 1}
  with pytest.raises(rank_layout.LaunchError, match="line 1 'a:0': a host needs at least 1 slot"):
    rank_layout.hostfile_slots("a:0\n")
  plan = plan_format.load_plan(ED4)  # 4 nodes; with stage ranks: per host 1 shard + 2 ranks of the VWs' stages
  slots = rank_layout.map_ranks(plan, plan_nodes(plan), 4, ["h0", "h1", "h2", "h3"], "gpu")
  per_host = {h: [s.rank for s in slots if s.host == h] for h in ("h0", "h1", "h2", "h3")}
  assert {h: len(r) for h, r in per_host.items()} == {"h0": 3, "h1": 3, "h2": 3, "h3": 3}
  rank_layout.check_slots(slots, {"h0": 3, "h1": 3, "h2": 3, "h3": 3})  # exactly enough
  ranks = ", ".join(map(str, per_host["h2"]))
  with pytest.raises(rank_layout.LaunchError,
                     match=rf"host h2 has 2 slots in the hostfile but the plan puts 3 ranks on it \(ranks {ranks}\)"
                           r".*--oversubscribe"):
    rank_layout.check_slots(slots, {"h0": 3, "h1": 3, "h2": 2, "h3": 3})
  rank_layout.check_slots(slots, {"h0": 1, "h1": 1, "h2": 1, "h3": 1}, oversubscribe=True)
  # The case through the CLI: two 1-slot hosts for a plan needing 3 ranks on each.
  hosts = tmp_path / "hosts"
  hosts.write_text("node-a:1\nnode-b:1\n")
  proc = _launch(f"--plan={ED_LOCAL}", f"--hostfile={hosts}", "--stage_ranks", "--dry_run")
  assert proc.returncode == 2 and proc.stderr.count("error:") == 1, proc.stderr
  assert "error: host node-a has 1 slot in the hostfile but the plan puts 3 ranks on it (ranks 0, 2, 3)" in proc.stderr
  proc = _launch(f"--plan={ED_LOCAL}", f"--hostfile={hosts}", "--stage_ranks", "--dry_run", "--oversubscribe")
  assert proc.returncode == 0, proc.stderr[-2000:]
  machinefile = proc.stdout.split("ranks.hosts:\n")[1].split("visible GPUs")[0].split()
  assert machinefile == ["node-a:1", "node-b:1", "node-a:1", "node-a:1", "node-b:1", "node-b:1"]
  hosts.write_text("node-a:3\nnode-b:3\n")
  proc = _launch(f"--plan={ED_LOCAL}", f"--hostfile={hosts}", "--stage_ranks", "--dry_run")
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_restarts_share_a_compilation_cache_that_the_user_can_name_or_turn_off(tmp_path):
  compilation_cache_env = recovery.compilation_cache_env
  work = tmp_path / "run"
  env = compilation_cache_env("auto", str(work), {"PATH": "/bin"})
  assert env["JAX_COMPILATION_CACHE_DIR"] == str((work / "jax_cache").resolve())
  assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0" and env["PATH"] == "/bin"
  assert env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] == "0"
  mine = {"JAX_COMPILATION_CACHE_DIR": "/data/cache", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}
  env = compilation_cache_env("auto", str(work), mine)  # the user's own cache and threshold are kept
  assert (env["JAX_COMPILATION_CACHE_DIR"], env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) == ("/data/cache", "2")
  assert compilation_cache_env(str(tmp_path / "c"), str(work), mine)["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "c")
  assert "JAX_COMPILATION_CACHE_DIR" not in compilation_cache_env("", str(work), mine)
  assert mine["JAX_COMPILATION_CACHE_DIR"] == "/data/cache"  # the caller's dict is not changed
  # The cache survives a start-over: set_aside_outputs keeps it in the workdir.
  (work / "jax_cache").mkdir(parents=True)
  (work / "metrics.jsonl").write_text("")
  recovery.set_aside_outputs(work, 0)
  assert (work / "jax_cache").is_dir() and not (work / "metrics.jsonl").exists()
