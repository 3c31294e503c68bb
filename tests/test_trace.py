"""Chrome trace, Gantt PNG and the simulate CLI; planning-layer imports of the engine modules."""

import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax.costs import task_times
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.sim import engine
from hetpipe_jax.sim import trace



def small_report(records=True):
  fast = task_times.uniform_task_times([2.0, 3.0, 2.5, 2.0], send_ms=0.1, push_ms=1.0, pull_ms=1.0)
  slow = task_times.uniform_task_times([4.0, 3.0, 5.0, 4.0], send_ms=0.1, push_ms=1.0, pull_ms=1.0)
  return engine.run([fast, slow], engine.EngineConfig(num_waves=4, num_inflight=4, staleness_bound=0,
                                                      records=records))


def test_engine_trace_has_one_complete_event_per_task_and_the_waits():
  report = small_report()
  t = json.loads(json.dumps(trace.report_trace(report)))  # JSON round trip
  xs = [e for e in t["traceEvents"] if e["ph"] == "X" and e["cat"] != "ps_wait"]
  assert len(xs) == len(report.task_events) == 2 * 4 * 4 * (2 * 4 - 1)
  for e, te in zip(xs, report.task_events):
    assert e["pid"] == te.vw_id and e["tid"] == te.stage_id
    assert e["name"] == te.task[len(str(te.stage_id)):]  # "F3", "B3", "FB3"
    assert e["args"]["wave"] == te.minibatch_id // 4
    assert e["ts"] == pytest.approx(te.start_s * 1e6) and e["dur"] == pytest.approx((te.end_s - te.start_s) * 1e6)
  waits = [e for e in t["traceEvents"] if e.get("cat") == "ps_wait"]
  assert len(waits) == len(report.ps_waits) > 0
  assert all(e["tid"] == 4 for e in waits)  # the row after the VW's stages
  names = {(e["pid"], e["tid"]): e["args"]["name"] for e in t["traceEvents"] if e["name"] == "thread_name"}
  assert names[(1, 2)] == "stage 2 (vw1/s2)" and names[(0, 4)] == "WSP wait"
  assert any(e["ph"] == "C" for e in t["traceEvents"])  # clock distance counter


def test_runtime_events_start_at_dispatch_or_previous_end_on_the_stage():
  log = [("0F0", 0.0, 1.0), ("0F1", 0.1, 2.0), ("1FB0", 1.0, 3.0), ("1FB1", 2.0, 4.5), ("0B0", 3.0, 3.5),
         ("0B1", 4.5, 5.0)]
  events = trace.runtime_events(log, vw_id=3, num_inflight=2)
  assert [(e.task, e.start_s, e.end_s) for e in events] == [
      ("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0), ("1FB0", 1.0, 3.0), ("1FB1", 3.0, 4.5), ("0B0", 3.0, 3.5),
      ("0B1", 4.5, 5.0)]
  assert all(e.vw_id == 3 and e.wave_id == 0 for e in events)
  t = trace.chrome_trace(events)
  assert {e["name"] for e in t["traceEvents"] if e["ph"] == "X"} == {"F0", "F1", "FB0", "FB1", "B0", "B1"}
  # A log that already holds start times is unchanged.
  again = trace.runtime_events([(e.task, e.start_s, e.end_s) for e in events], vw_id=3)
  assert [(e.start_s, e.end_s) for e in again] == [(e.start_s, e.end_s) for e in events]
  with pytest.raises(ValueError, match="before its dispatch"):
    trace.runtime_events([("0F0", 2.0, 1.0)], vw_id=0)
  with pytest.raises(ValueError, match="cannot parse task"):
    trace.runtime_events([("X0", 0.0, 1.0)], vw_id=0)


def test_gantt_writes_a_png(tmp_path):
  from hetpipe_jax.sim import gantt
  report = small_report()
  path = tmp_path / "g.png"
  gantt.plot_report(report, str(path), title="test")
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError, match="no task events"):
    gantt.plot_report(small_report(records=False), str(path))


def test_simulate_cli_writes_report_trace_and_gantt(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
  out = subprocess.run(
      [sys.executable, "-m", "hetpipe_jax.simulate", "--plan=experiments/plans/local_cpu_cnn_b64.json",
       "--num_waves=20", "--staleness_bound=1", f"--output={tmp_path}/r.json", f"--trace={tmp_path}/t.json",
       f"--gantt={tmp_path}/g.png"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "mb/s steady" in out.stdout and "util" in out.stdout
  report = json.loads((tmp_path / "r.json").read_text())
  assert report["final_global_clock"] == 20 and len(report["vws"]) == 2
  assert report["total_minibatches_per_s"] > 0 and "minibatch_records" not in report
  assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
  assert (tmp_path / "g.png").stat().st_size > 0


def test_simulate_cli_ps_link_contention_slows_a_plan_whose_ps_traffic_matters(tmp_path):
  # The paper cluster's ED plan with D = 0: every wave waits for all 4 VWs' pushes and its pull reply, so sharing
  # one PS link (4 pushes + 4 replies of ~0.29 ms each per wave, against ~1 ms stages) must slow it down.
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
  reports = {}
  for flag in ("--ps_link_contention", "--nops_link_contention"):
    out = subprocess.run(
        [sys.executable, "-m", "hetpipe_jax.simulate", "--plan=experiments/plans/hetpipe_paper_cnn_b64_ed.json",
         "--num_waves=20", "--staleness_bound=0", flag, f"--output={tmp_path}/{flag[2:]}.json"], cwd=REPO_ROOT,
        env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "mb/s steady" in out.stdout
    report = json.loads((tmp_path / f"{flag[2:]}.json").read_text())
    assert report["config"]["ps_link_contention"] is (flag == "--ps_link_contention")
    assert report["config"]["staleness_bound"] == 0 and report["final_global_clock"] == 20
    assert len(report["vws"]) == 4 and all(v["num_pushes"] == 20 and v["num_minibatches"] == 60
                                           for v in report["vws"])
    reports[flag == "--ps_link_contention"] = report
  shared, own = reports[True], reports[False]
  assert shared["makespan_s"] > own["makespan_s"]
  assert 0 < shared["total_minibatches_per_s"] < own["total_minibatches_per_s"]
  assert sum(v["wait_s"] for v in shared["vws"]) > sum(v["wait_s"] for v in own["vws"])


def _simulate(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
  return subprocess.run([sys.executable, "-m", "hetpipe_jax.simulate", *args], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


def test_simulate_refuses_the_ps_flags_for_an_all_reduce_plan_and_records_what_ran(tmp_path):
  """A gpipe plan has no parameter server: ``--staleness_bound=3`` (and the other PS flags) used to run unused and
  be recorded in the report as the engine's config; ``--gantt_waves`` without ``--gantt`` was dropped. Each is
  now one ``error:`` line and exit 2; without them the report records D = 0 (no PS) and the line names M."""
  plan = tmp_path / "gpipe.json"
  r = subprocess.run([sys.executable, "-m", "hetpipe_jax.plan", "--model=cnn", "--batch_size=64", "--method=gpipe",
                      "--num_vws=2", f"--output={plan}"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT)))
  assert r.returncode == 0, r.stderr[-2000:]
  for flag in ("--staleness_bound=3", "--ps_apply=clock_aligned", "--nopull_every_wave", "--ps_link_contention"):
    out = _simulate(f"--plan={plan}", "--num_waves=4", flag)
    name = flag.lstrip("-").removeprefix("no").split("=")[0]
    assert out.returncode == 2 and out.stderr.startswith(f"error: --{name}="), out.stderr[-2000:]
    assert "parameter-server method's plan, not method='gpipe'" in out.stderr
  out = _simulate("--plan=experiments/plans/local_cpu_cnn_b64.json", "--num_waves=4", "--gantt_waves=2")
  assert out.returncode == 2 and out.stderr.startswith("error: --gantt_waves=2 is used only with --gantt")
  out = _simulate(f"--plan={plan}", "--num_waves=4", f"--output={tmp_path}/r.json")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "method=gpipe M=" in out.stdout and "D=" not in out.stdout.splitlines()[0]
  config = json.loads((tmp_path / "r.json").read_text())["config"]
  assert (config["staleness_bound"], config["ps_link_contention"], config["method"]) == (0, False, "gpipe")
