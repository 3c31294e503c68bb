"""``config.timing_plan``: another model's plan times a virtual run (HetPipe §8.4 reproduced with a proxy model).

The oracle is the engine run on the timing plan's own cost-model task times: a proxy model trained under the timing
plan must have exactly the engine's schedule (simulated injection and completion times, version clocks), whatever
its numerics are.
"""

import json

import pytest

from experiments.configs import paper_virtual, tiny
from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.jobs import emulation, job_config, virtual_job
from hetpipe_jax.jobs.job_config import ConfigError
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.planning import plan_format
from hetpipe_jax.planning import plan_times
from hetpipe_jax.sim import engine
from tests.mpi_util import read_jsonl

TIMING_PLAN = "experiments/plans/hetpipe_paper_cnn_b64_ed.json"  # cnn on the paper's cluster: 4 VWs x 4 stages
SMALL_TIMING_PLAN = "experiments/plans/local_cpu_cnn_b64.json"  # cnn on local_cpu: 2 VWs x 2 stages (a quick run)


def _plan_json(path=TIMING_PLAN):
  return json.loads((REPO_ROOT / path).read_text())  # read apart from the code under test


def _config(base=paper_virtual, layout=TIMING_PLAN, **overrides):
  """The proxy run laid out as the ``layout`` plan, timed by it unless ``overrides`` name another timing plan."""
  plan = _plan_json(layout)
  c = base.get_config()
  c.update({"plan": "", "emulate_plan": False, "timing_plan": layout, "model": "mlp_tiny", "partition": "",
            "num_virtual_workers": len(plan["virtual_workers"]), "num_stages": len(plan["virtual_workers"][0][
                "partition"]), "num_inflight": plan["num_inflight"], "batch_size": plan["batch_size"],
            "check_counts": False, "progress": False, "checkpoint_every_waves": 0, **overrides})
  return c


def test_timing_plan_gives_the_plans_own_task_times():
  """The proxy run gets exactly the task times the timing plan's model would get with ``emulate_plan``."""
  c = _config()
  times = emulation.emulated_task_times(job_config.resolve_job(c, "virtual"), virtual=True)
  own = _config(model=_plan_json()["model"], plan=TIMING_PLAN, emulate_plan=True, num_virtual_workers=None,
                num_stages=None, num_inflight=None, partition=None)
  own.timing_plan = ""
  assert times == emulation.emulated_task_times(job_config.resolve_job(own, "virtual"))
  assert len(times) == 4 and all(t.num_stages == 4 and t.push_s > 0 and t.forward_backward_s > 0 for t in times)


@pytest.mark.parametrize("overrides, message", [
    ({"num_virtual_workers": 2}, r"config.timing_plan=.* has num_virtual_workers=4 but the run has "
                                 r"config.num_virtual_workers=2: .*set --config.num_virtual_workers=4"),
    ({"num_stages": 2}, r"has num_stages=\[4, 4, 4, 4\] but the run has config.num_stages=\[2, 2, 2, 2\]"),
    ({"num_inflight": 2}, r"has num_inflight=3 but the run has config.num_inflight=2"),
    ({"batch_size": 32}, r"has batch_size=64 but the run has config.batch_size=32"),
    ({"method": "pipedream"}, r"has method=hetpipe but the run has config.method=pipedream"),
    ({"emulate_stage_ms": "5,5,5,5"}, r"set one of config.timing_plan, config.emulate_stage_ms and "
                                      r"config.emulate_plan"),
    ({"timing_plan": "nope.json"}, r"config.timing_plan='nope.json': .*No such file"),
])
def test_a_timing_plan_that_does_not_describe_the_run_is_refused(overrides, message):
  c = _config(**overrides)
  with pytest.raises(ConfigError, match=message):
    emulation.emulated_task_times(job_config.resolve_job(c, "virtual"), virtual=True)


def test_timing_plan_is_refused_with_a_plan_and_under_mpi():
  c = _config(base=tiny, plan="experiments/plans/local_cpu_2node_mlp_tiny_ed_default.json", num_virtual_workers=None,
              num_stages=None, num_inflight=None, partition=None, batch_size=32)
  with pytest.raises(ConfigError, match=r"config.timing_plan=.* and config.plan=.*unset one of them"):
    emulation.emulated_task_times(job_config.resolve_job(c, "virtual"), virtual=True)
  c = _config()
  with pytest.raises(ConfigError, match=r"config.timing_plan=.* needs --mode=virtual"):
    emulation.emulated_task_times(job_config.resolve_job(c, "virtual"))


def test_a_proxy_model_under_a_timing_plan_runs_the_engines_schedule(tmp_path, synthetic_data_dir):
  """mlp_tiny under a cnn plan's timing: every minibatch's simulated times and version clocks are the engine's for
  the plan's task times (paper's WSP: on receipt, pull when the bound needs it), and config.json records it."""
  mb = 2 * _plan_json(SMALL_TIMING_PLAN)["num_inflight"]
  c = _config(layout=SMALL_TIMING_PLAN, data_dir=str(synthetic_data_dir), num_minibatches=mb,
              eval_every_epochs=0.0, staleness_bound=0)
  summary = virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path))
  plan = plan_format.load_plan(str(REPO_ROOT / SMALL_TIMING_PLAN))
  times = plan_times.task_times_from_plan(plan, plan_times.profile_for_plan(plan),
                                          cluster_lib.load_cluster(plan.cluster))
  report = engine.run(times, engine.EngineConfig(num_waves=2, num_inflight=plan.num_inflight, staleness_bound=0,
                                                 pull_every_wave=False, ps_apply="on_receipt"))
  assert summary["simulated_time_s"] == report.makespan_s
  # Lower bound apart from the engine: each VW runs 2 waves through its slowest stage one minibatch at a time.
  assert summary["simulated_time_s"] >= mb * max(max(vw.stage_time_ms) for vw in plan.virtual_workers) / 1000
  keys = ("inject_time_s", "complete_time_s", "local_clock_at_injection", "version_global_clock")
  recorded = {(r["vw_id"], r["minibatch_id"]): [r[k] for k in keys] for r in read_jsonl(tmp_path / "minibatches.jsonl")}
  assert recorded == {(r.vw_id, r.minibatch_id): [getattr(r, k) for k in keys] for r in report.minibatch_records}
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["timing_plan"] == SMALL_TIMING_PLAN and config["model"] == "mlp_tiny"
  assert config["emulate_plan"] is False and plan.model == "cnn"
