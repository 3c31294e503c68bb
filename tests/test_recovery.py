"""Automatic recovery (``launch --max_restarts``): the watchdog rule, naming the failed rank, gone nodes, re-planning
without them, the supervisor's restarts, and the drills end to end."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from hetpipe_jax import recovery
from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.jobs.job_config import ConfigError, resolve_job
from hetpipe_jax.mpi import rank_guard
from hetpipe_jax.mpi import rank_layout
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.planning import plan_format
from hetpipe_jax.planning import planner
from hetpipe_jax.rules import watchdog
from hetpipe_jax import profiles
from experiments.configs import tiny

ED4 = "experiments/plans/local_cpu_4node_mlp_tiny_ed.json"


# --- The watchdog rule -----------------------------------------------------------------------------------------------

def test_watchdog_names_the_silent_vws_longest_first_and_spares_those_the_ps_owes():
  heard = {0: 100.0, 1: 90.0, 2: 80.0, 3: 99.5}
  # At 110 s with a 10 s limit: VW 1 (20 s) and VW 0 (exactly 10 s: the limit counts) are silent; VW 2 (30 s) waits
  # for a held pull; VW 3 (10.5 s) is silent too.
  assert watchdog.silent_vws(110.0, heard, waiting={2}, limit_s=10.0) == [(1, 20.0), (3, 10.5), (0, 10.0)]
  assert watchdog.silent_vws(109.9, {0: 100.0}, waiting=(), limit_s=10.0) == []
  assert watchdog.silent_vws(1e9, heard, waiting=(), limit_s=0.0) == []  # 0: off
  with pytest.raises(ValueError, match="ps_watchdog_s=-1"):
    watchdog.silent_vws(0.0, heard, (), -1.0)


def test_watchdog_gives_a_vw_not_yet_heard_the_start_up_limit():
  heard = {0: 0.0, 1: 0.0}
  assert watchdog.silent_vws(50.0, heard, (), 10.0, unheard={1}, startup_limit_s=300.0) == [(0, 50.0)]
  assert watchdog.silent_vws(300.0, heard, (), 10.0, unheard={1}, startup_limit_s=300.0) == [(0, 300.0), (1, 300.0)]
  # A start-up limit below the limit does not shorten it.
  assert watchdog.silent_vws(9.0, heard, (), 10.0, unheard={1}, startup_limit_s=1.0) == []


def test_watchdog_setting_is_checked_before_any_work():
  c = tiny.get_config()
  c.ps_watchdog_s = -5.0
  with pytest.raises(ConfigError, match=r"config.ps_watchdog_s=-5.0 must be >= 0"):
    resolve_job(c, "mpi")
  c.ps_watchdog_s = 30.0
  c.method = "horovod"
  with pytest.raises(ConfigError, match="config.ps_watchdog_s=30.0 is the parameter server's progress watchdog, which "
                                        "config.method='horovod' does not use"):
    resolve_job(c, "mpi")
  c.method = "hetpipe"
  with pytest.raises(ConfigError, match="config.ps_watchdog_s=30.0: virtual time has no hung ranks to watch"):
    resolve_job(c, "virtual")
  assert resolve_job(c, "mpi").ps.watchdog_s == 30.0


# --- Naming the failed rank ------------------------------------------------------------------------------------------

def _slots():
  return [rank_layout.RankSlot(0, "ps shard 0 (lead)", ("n0",), "h0", ()),
          rank_layout.RankSlot(1, "VW 0", ("n0", "n1"), "h0", (0, 1)),
          rank_layout.RankSlot(2, "VW 1", ("n2",), "h1", (0,))]


def _write(path: pathlib.Path, record: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(record))


BANNER = ("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n=   PID 111 RUNNING AT h0\n=   EXIT CODE: 9\n"
          "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n")


def test_the_rank_that_ended_first_is_named_not_mpichs_lowest_rank(tmp_path):
  # MPICH names rank 0 (PID 111: its clean-up killed it too); the guards saw rank 2 end first.
  _write(tmp_path / "procs/rank0.json", {"rank": 0, "pid": 111, "host": "h0", "started_at": 10.0})
  _write(tmp_path / "procs/rank2.json", {"rank": 2, "pid": 333, "host": "h1", "started_at": 10.0})
  _write(tmp_path / "exits/rank0-111.json", {"rank": 0, "pid": 111, "host": "h0", "time": 20.5, "exit_code": 137,
                                             "signal": 9})
  _write(tmp_path / "exits/rank2-333.json", {"rank": 2, "pid": 333, "host": "h1", "time": 20.1, "exit_code": 137,
                                             "signal": 9})
  _write(tmp_path / "exits/rank1-222.json", {"rank": 1, "pid": 222, "host": "h0", "time": 5.0, "exit_code": 1,
                                             "signal": None})  # an earlier attempt's
  f = recovery.diagnose(BANNER, tmp_path, since=10.0, slots=_slots(), exit_code=9)
  assert (f.cause, f.rank, f.role, f.host, f.nodes, f.devices) == ("killed", 2, "VW 1", "h1", ("n2",), (0,))
  assert f.message == "PID 333 on h1: killed by signal 9" and f.restartable
  # Without the guards' records MPICH's banner is the last resort.
  for p in (tmp_path / "exits").iterdir():
    p.unlink()
  f = recovery.diagnose(BANNER, tmp_path, since=10.0, slots=_slots(), exit_code=9)
  assert (f.cause, f.rank) == ("killed", 0)


def _watchdog_blames_rank_1(workdir: pathlib.Path, at: float) -> None:
  """The lead's failure record of a hang blamed on rank 1 at time ``at``, then its own exit (status 3)."""
  _write(workdir / "failures/rank0-1.json", {"rank": 0, "pid": 1, "host": "h0", "time": at, "error": "HungRankError",
                                             "message": "VW 0 (driver rank 1) sent nothing", "suspect_rank": 1})
  _write(workdir / "exits/rank0-1.json", {"rank": 0, "pid": 1, "host": "h0", "time": at + 0.1, "exit_code": 3,
                                          "signal": None})


def test_a_hang_blamed_by_the_watchdog_comes_first_unless_a_rank_ended_before_and_a_config_error_is_not_restarted(tmp_path):
  _watchdog_blames_rank_1(tmp_path, at=30.0)
  f = recovery.diagnose("", tmp_path, since=10.0, slots=_slots(), exit_code=3)
  assert (f.cause, f.rank, f.role, f.error) == ("hang", 1, "VW 0", "HungRankError") and f.restartable
  # A rank killed before the watchdog fired (a stage rank: its VW's driver fell silent) is named, not the driver.
  killed = tmp_path / "killed"
  _write(killed / "exits/rank2-9.json", {"rank": 2, "pid": 9, "host": "h1", "time": 21.0, "exit_code": 137,
                                         "signal": 9})
  _watchdog_blames_rank_1(killed, at=29.5)
  f = recovery.diagnose("", killed, since=10.0, slots=_slots(), exit_code=9)
  assert (f.cause, f.rank, f.role) == ("killed", 2, "VW 1")
  other = tmp_path / "other"
  _write(other / "failures/rank2-5.json", {"rank": 2, "pid": 5, "host": "h1", "time": 40.0, "error": "ConfigError",
                                           "message": "config.x is bad", "suspect_rank": None})
  _write(other / "exits/rank2-5.json", {"rank": 2, "pid": 5, "host": "h1", "time": 40.2, "exit_code": 2,
                                        "signal": None})
  f = recovery.diagnose("", other, since=10.0, slots=_slots(), exit_code=2)
  assert (f.cause, f.rank, f.error, f.message) == ("error", 2, "ConfigError", "config.x is bad")
  assert not f.restartable


def test_the_rank_guard_records_how_its_child_ended(tmp_path):
  env = dict(os.environ, PMI_RANK="3", PYTHONPATH=str(REPO_ROOT))
  code = subprocess.run([sys.executable, "-m", "hetpipe_jax.mpi.rank_guard", f"--workdir={tmp_path}", "--",
                         sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                        env=env, timeout=60, check=False).returncode
  assert code == 137
  (record,) = rank_guard.read_exits(tmp_path)
  assert (record["rank"], record["signal"], record["exit_code"]) == (3, 9, 137)
  code = subprocess.run([sys.executable, "-m", "hetpipe_jax.mpi.rank_guard", f"--workdir={tmp_path}", "--",
                         sys.executable, "-c", "raise SystemExit(4)"], env=env, timeout=60, check=False).returncode
  assert code == 4
  assert [(r["exit_code"], r["signal"]) for r in rank_guard.read_exits(tmp_path)] == [(137, 9), (4, None)]


# --- Gone nodes and re-planning --------------------------------------------------------------------------------------

def _failure(nodes):
  return recovery.Failure("killed", 1, "VW 0", "h0", tuple(nodes), (0,), 9, "")


def test_a_node_is_gone_when_it_does_not_answer_or_its_rank_fails_again():
  alive = lambda n: n != "n1"  # noqa: E731
  assert recovery.gone_nodes(_failure(["n0", "n1"]), None, alive) == ("n1",)
  assert recovery.gone_nodes(_failure(["n0"]), None, alive) == ()  # transient: restart on the same plan
  assert recovery.gone_nodes(_failure(["n0"]), _failure(["n0"]), alive) == ("n0",)  # fails again
  assert recovery.gone_nodes(_failure(["n0"]), _failure(["n2"]), alive) == ()
  assert recovery.probe_node("n0", "localhost")  # the default probe takes the local host as alive
  assert not recovery.probe_node("n0", "h", probe="test {node} = n1")
  assert recovery.probe_node("n1", "h", probe="test {node} = n1")


def test_replan_without_a_node_equals_planning_on_the_cluster_file_without_it():
  plan = plan_format.load_plan(str(REPO_ROOT / ED4))
  got = recovery.replan(plan, ["n2"], cluster_lib.load_cluster(plan.cluster))
  # Oracle: the cluster JSON with node n2 deleted by hand, planned as `python -m hetpipe_jax.plan` would.
  d = json.loads((REPO_ROOT / "experiments/clusters/local_cpu_4node.json").read_text())
  d["nodes"] = [n for n in d["nodes"] if n["name"] != "n2"]
  d["local_devices"] = {g: i for g, i in d.get("local_devices", {}).items() if not g.startswith("n2/")}
  cluster = cluster_lib.cluster_from_dict(d)
  want = planner.make_plan(cluster, profiles.get_profile(plan.model, plan.batch_size, cluster, None),
                           planner.PlannerConfig(policy="ED", num_vws=2))
  assert [vw.gpus for vw in got.virtual_workers] == [vw.gpus for vw in want.virtual_workers]
  assert [vw.partition for vw in got.virtual_workers] == [vw.partition for vw in want.virtual_workers]
  assert got.num_inflight == want.num_inflight and got.policy == "ED" and got.method == plan.method
  assert len(got.virtual_workers) == 2 and all(len(vw.gpus) == 3 for vw in got.virtual_workers)
  assert not any(g.startswith("n2/") for vw in got.virtual_workers for g in vw.gpus)
  with pytest.raises(ValueError, match="has no node n9"):
    recovery.replan(plan, ["n9"], cluster_lib.load_cluster(plan.cluster))
  with pytest.raises(ValueError, match="no node of cluster"):
    cluster_lib.without_nodes(cluster, ["n0", "n1", "n3"])


def test_a_new_plans_hostfile_keeps_each_nodes_host_and_slots():
  node_host = {"n0": "a", "n1": "b", "n2": "c", "n3": "d"}
  slots = {"a": 2, "b": 1, "c": 1, "d": 3}
  assert recovery.recovery_hostfile(["n0", "n1", "n3"], node_host, slots) == "a:2\nb:1\nd:3\n"
  assert recovery.recovery_hostfile(["n0", "n3"], dict.fromkeys(node_host, "h"), {"h": 4}) == "h:4\n"


# --- The supervisor --------------------------------------------------------------------------------------------------

def _supervisor(tmp_path, script: str, max_restarts: int, plan_path=ED4):
  """A supervisor whose attempts run ``script`` (python -c) as rank 1 under a guard, with work directory ``tmp_path``;
  a node is down when ``tmp_path/../down_<node>`` exists."""
  env = dict(os.environ, PMI_RANK="1", PYTHONPATH=str(REPO_ROOT))
  seen = []

  def build(plan, hostfile, resume):
    seen.append((plan, hostfile, resume))
    slots = rank_layout.map_ranks(plan_format.load_plan(str(REPO_ROOT / plan) if not os.path.isabs(plan) else plan),
                                  ["n0", "n1", "n2", "n3"] if plan == ED4 else ["n0", "n1", "n3"], 1, [])
    return slots, "", [sys.executable, "-m", "hetpipe_jax.mpi.rank_guard", f"--workdir={tmp_path}", "--",
                       sys.executable, "-c", script]

  plan = plan_format.load_plan(str(REPO_ROOT / plan_path))
  sup = recovery.Supervisor(build, plan_path, "", str(tmp_path), max_restarts, cluster_lib.load_cluster(plan.cluster),
                            node_probe=f"test ! -e {tmp_path.parent}/down_{{node}}", env=env, log=lambda line: None)
  return sup, seen


def test_supervisor_restarts_a_killed_rank_from_its_checkpoint_then_stops_when_restarts_are_spent(tmp_path):
  (tmp_path / "checkpoints" / "20").mkdir(parents=True)
  (tmp_path / "metrics.jsonl").write_text("{}\n")
  kill = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
  sup, seen = _supervisor(tmp_path, kill, max_restarts=2)
  assert sup.run() == 137
  assert [s[2] for s in seen] == [False, True, True]  # resumed from the checkpoint
  lines = [json.loads(x) for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
  assert [(x["attempt"], x["cause"], x["rank"], x["role"], x["resume_from"]) for x in lines] == [
      (0, "killed", 1, "VW 0", 20), (1, "killed", 1, "VW 0", 20), (2, "killed", 1, "VW 0", None)]
  # Rank 1 (VW 0, nodes n2, n0, n1, n3 on localhost) failed twice on the same nodes: after the second failure they
  # count as gone, which leaves no node to plan on.
  assert lines[0]["gone_nodes"] == [] and lines[0]["decision"] == "restart from checkpoint 20"
  assert lines[1]["gone_nodes"] == ["n2", "n0", "n1", "n3"] and lines[1]["new_plan"] is None
  assert lines[1]["decision"].startswith("no plan without n2, n0, n1, n3 (") and lines[1]["decision"].endswith(
      "the same plan again; restart from checkpoint 20")
  assert lines[2]["decision"] == "stop: the 2 restart(s) of --max_restarts are spent"
  assert (tmp_path / "metrics.jsonl").exists()  # resumed in place: nothing moved


def test_supervisor_replans_without_a_node_that_does_not_answer(tmp_path):
  (tmp_path / "down_n2").write_text("")  # the probe's answer for node n2: down
  marker = tmp_path / "ran_once"
  tmp_path = tmp_path / "workdir"
  tmp_path.mkdir()
  script = (f"import os, pathlib, signal\np = pathlib.Path({str(marker)!r})\n"
            "if not p.exists():\n  p.write_text('')\n  os.kill(os.getpid(), signal.SIGKILL)\n")
  (tmp_path / "metrics.jsonl").write_text("{}\n")  # no checkpoint: the outputs are set aside, the job starts over
  sup, seen = _supervisor(tmp_path, script, max_restarts=1)
  assert sup.run() == 0
  (line,) = [json.loads(x) for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
  assert line["gone_nodes"] == ["n2"] and line["new_plan"] == seen[1][0] and line["resume_from"] is None
  assert line["decision"] == "restart from the start"
  new = plan_format.load_plan(seen[1][0])
  assert {g.split("/")[0] for vw in new.virtual_workers for g in vw.gpus} == {"n0", "n1", "n3"}
  assert seen[1][1] == ""  # no hostfile at the start: every node stays on localhost
  assert (tmp_path / "recovery" / "attempt0" / "metrics.jsonl").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_supervisor_stops_at_once_on_an_error_a_restart_would_repeat(tmp_path):
  script = (f"from hetpipe_jax.mpi import rank_records\nimport sys\nrank_records.write_failure({str(tmp_path)!r}, 1, "
            "ValueError('x'))\nsys.exit(2)")
  sup, seen = _supervisor(tmp_path, script, max_restarts=3)
  # ValueError is restartable; a ConfigError is not.
  assert sup.run() == 2 and len(seen) == 4
  tmp2 = tmp_path / "b"
  tmp2.mkdir()
  script = script.replace(str(tmp_path), str(tmp2)).replace("ValueError('x')", "type('ConfigError', (Exception,), "
                                                                                "{})('bad')")
  sup, seen = _supervisor(tmp2, script, max_restarts=3)
  assert sup.run() == 2 and len(seen) == 1
  (line,) = [json.loads(x) for x in (tmp2 / "restarts.jsonl").read_text().splitlines()]
  assert line["error"] == "ConfigError" and line["decision"] == "stop: ConfigError would repeat on a restart"


# --- The drills, end to end ------------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_recovery_drills_smoke(tmp_path):
  """On a 2-node ED plan with stage ranks and one shard per node (6 ranks; the full drills run 4 nodes, 12 ranks),
  one launch survives in turn a stage rank killed, a VW's driver killed, a PS shard killed and a driver stopped
  (hang): it finishes after four restarts,
  each naming the rank hit, with every wave applied once on every shard, WSP's bound on every record and no jump in
  the loss after any resume (experiments/recovery_drill.py)."""
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
  proc = subprocess.run([sys.executable, "experiments/recovery_drill.py", "--smoke", f"--output_dir={tmp_path}"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  (row,) = report["drills"]
  assert report["all_ok"] and row["restarts"] == 4 and row["num_ps_shards_after"] == 2
  faults = row["faults"]
  assert [f["drill"] for f in faults] == ["stage", "vw", "shard", "hang"]
  assert [f["rank_named"] for f in faults] == [4, 2, 1, 3]  # stage rank, driver, shard, driver (6 ranks)
  assert all(f["gone_nodes"] == [] for f in faults)  # transient faults: the same plan each time
  assert [f["cause"] for f in faults][:3] == ["killed"] * 3 and faults[3]["cause"] == "hang"
  assert faults[3]["detection_s"] >= report["watchdog_s"]  # detected by the watchdog, not sooner
  resumed = [f["resume_from"] for f in faults]
  assert resumed[0] >= 5 and all(a < b for a, b in zip(resumed, resumed[1:])), resumed  # a newer cut each time
  assert row["applied"] == {"missing": [], "twice": [], "unexpected": []} and row["wsp_violations"] == 0
  assert (tmp_path / "recovery_drill.md").read_text().startswith("| drill | fault |")


@pytest.mark.mpi
def test_ps_load_smoke(tmp_path):
  """4 VWs under 2 PS shards at D = 4 (experiments/ps_load.py): every wave applied once on each shard, WSP's bound
  held and reached, and the PS's per-wave service time reported."""
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
  proc = subprocess.run([sys.executable, "experiments/ps_load.py", "--smoke", f"--output_dir={tmp_path}"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  (row,) = json.loads(proc.stdout.strip().splitlines()[-1])["cases"]
  assert (row["num_vws"], row["num_ps_shards"], row["staleness_bound"]) == (4, 2, 4)
  assert row["applied"] == {"missing": [], "twice": [], "unexpected": []} and row["wsp_violations"] == 0
  assert row["max_staleness"] == 4 and row["num_records"] == 4 * 12
  service = row["ps_service"]  # the lead shard applied its slice of every VW's 6 waves (Nm = 2)
  assert service["waves"] == 4 * 6 and 0 < service["p50_ms"] <= service["p95_ms"] <= service["max_ms"]
