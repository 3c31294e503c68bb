r"""Simulates a plan with the discrete-event engine: throughput, utilisation, WSP waits (HetPipe §4, §5, §8).

  python -m hetpipe_jax.simulate --plan=experiments/plans/local_cpu_cnn_b64.json --num_waves=200 \
      --staleness_bound=1 --trace=/tmp/trace.json --gantt=/tmp/gantt.png --output=/tmp/report.json

Reads the plan's cluster (``experiments/clusters/<plan.cluster>.json``) and the saved profile it was made with (or
``--profile``), runs every virtual worker and the parameter server in virtual time, prints a table and writes the
report JSON, a Chrome trace (open in https://ui.perfetto.dev) and a Gantt PNG of the first waves.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app
from absl import flags

from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.planning import plan_format
from hetpipe_jax.planning import plan_times
from hetpipe_jax.rules import methods
from hetpipe_jax.sim import engine
from hetpipe_jax.sim import engine_report
from hetpipe_jax.sim import trace

_PLAN = flags.DEFINE_string("plan", None, "Plan JSON written by hetpipe_jax.plan.")
_NUM_WAVES = flags.DEFINE_integer("num_waves", 100, "Waves each virtual worker trains.")
_D = flags.DEFINE_integer("staleness_bound", 1, "WSP staleness bound D (0 = BSP with pipelining).")
_PULL_EVERY_WAVE = flags.DEFINE_bool("pull_every_wave", True, "Also pull, without waiting, at every wave end.")
_PS_APPLY = flags.DEFINE_enum("ps_apply", "on_receipt", ["on_receipt", "clock_aligned"],
                              "on_receipt: the PS adds each wave update when it arrives (HetPipe §5); clock_aligned: "
                              "once every VW pushed that wave.")
_CONTENTION = flags.DEFINE_bool("ps_link_contention", False, "Serialise all PS pushes and pulls on one shared link.")
_SHARED_NIC = flags.DEFINE_bool("shared_nic", True, "VWs on one node share its network interface for inter-node "
                                 "traffic (hetpipe_jax.rules.network); --noshared_nic: every transfer at full link "
                                 "speed.")
_PROFILE = flags.DEFINE_string("profile", None, "Profile JSON the plan was made with (default: the saved one).")
_CLUSTER = flags.DEFINE_string("cluster", None, "Cluster name or path (default: the plan's).")
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the report JSON.")
_TRACE = flags.DEFINE_string("trace", None, "Where to write a Chrome-trace JSON.")
_GANTT = flags.DEFINE_string("gantt", None, "Where to write a Gantt PNG.")
_GANTT_WAVES = flags.DEFINE_integer("gantt_waves", 4, "Waves drawn in the Gantt chart (from the start).")
_RECORDS = flags.DEFINE_bool("records", False, "Keep per-minibatch and per-task records in the JSON report "
                             "(always on with --trace or --gantt).")
flags.mark_flags_as_required(["plan"])


# The parameter server's flags: an all-reduce method's plan (gpipe, 1f1b_flush, horovod) has no PS to use them.
_PS_FLAGS = (_D, _PULL_EVERY_WAVE, _PS_APPLY, _CONTENTION)


def check_flags_for_plan(method: str) -> None:
  """Refuses a flag the plan's method does not use (it used to be recorded in the report as if it ran): the PS
  flags for the all-reduce methods, ``--gantt_waves`` without ``--gantt``.

  Raises:
    ValueError: naming the flag and the fix.
  """
  unused = [f for f in _PS_FLAGS if method not in methods.PS_METHODS] + ([] if _GANTT.value else [_GANTT_WAVES])
  for flag in unused:
    if flags.FLAGS[flag.name].present:
      why = "--gantt" if flag is _GANTT_WAVES else f"a parameter-server method's plan, not method={method!r}"
      raise ValueError(f"--{flag.name}={flag.value} is used only with {why}: leave it out")


def main(argv):
  del argv
  plan = plan_format.load_plan(_PLAN.value)
  try:
    check_flags_for_plan(plan.method)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  cluster = cluster_lib.load_cluster(_CLUSTER.value or plan.cluster)
  profile = plan_times.profile_for_plan(plan, _PROFILE.value)
  times = plan_times.task_times_from_plan(plan, profile, cluster)
  records = bool(_RECORDS.value or _TRACE.value or _GANTT.value)
  wsp = {}  # the PS's settings, for the PS methods (the all-reduce methods run the engine's defaults: no PS)
  if plan.method in methods.PS_METHODS:
    wsp = {"staleness_bound": _D.value, "pull_every_wave": _PULL_EVERY_WAVE.value, "ps_apply": _PS_APPLY.value,
           "ps_link_contention": _CONTENTION.value}
  config = engine.EngineConfig(num_waves=_NUM_WAVES.value, num_inflight=plan.num_inflight, records=records,
                               method=plan.method, shared_nic=_SHARED_NIC.value,
                               max_held=plan_format.memory_caps(plan, plan.num_inflight), **wsp)
  gpu_ids = [list(vw.gpus) for vw in plan.virtual_workers]
  report = engine.run(times, config, gpu_ids=gpu_ids)
  settings = (f"Nm={plan.num_inflight} D={_D.value} ps_apply={_PS_APPLY.value} "
              f"pull_every_wave={_PULL_EVERY_WAVE.value}" if wsp else f"method={plan.method} M={plan.num_inflight}")
  print(f"plan {_PLAN.value}: model={plan.model} batch_size={plan.batch_size} cluster={plan.cluster} "
        f"policy={plan.policy} {settings} shared_nic={_SHARED_NIC.value}; planner predicted "
        f"{plan.predicted_total_minibatches_per_s:.3f} minibatches/s")
  print(engine_report.format_table(report))
  if _OUTPUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
      json.dump(dict(report.to_dict(include_records=_RECORDS.value), plan=_PLAN.value,
                     planner_predicted_total_minibatches_per_s=plan.predicted_total_minibatches_per_s), f)
    print(f"wrote {_OUTPUT.value}")
  if _TRACE.value:
    trace.write_trace(trace.report_trace(report, gpu_ids), _TRACE.value)
    print(f"wrote {_TRACE.value}")
  if _GANTT.value:
    from hetpipe_jax.sim import gantt  # pylint: disable=g-import-not-at-top  # matplotlib only when drawing
    nm = plan.num_inflight
    k = min(_GANTT_WAVES.value, _NUM_WAVES.value) * nm - 1
    end = max(r.complete_time_s for r in report.minibatch_records if r.minibatch_id == k)
    gantt.plot_report(report, _GANTT.value, time_window_s=(0.0, end),
                      title=f"{plan.model} b{plan.batch_size} on {plan.cluster} ({plan.policy}), "
                            f"{f'Nm={nm}, D={_D.value}' if wsp else f'{plan.method}, M={nm}'}: first {k // nm + 1} "
                            f"{'waves' if wsp else 'steps'}")
    print(f"wrote {_GANTT.value}")


if __name__ == "__main__":
  app.run(main)
