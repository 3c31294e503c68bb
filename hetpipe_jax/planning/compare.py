"""Every method on one cluster and model, predicted by the event engine: which method, and which allocation?

Planning layer (standard library, numpy; matplotlib for the chart). For each method of
:mod:`hetpipe_jax.rules.methods` the planner makes its plan (:func:`hetpipe_jax.planning.planner.make_plan`: the
method's allocation, partitions, memory model and Nm or M) and the engine runs it (:mod:`hetpipe_jax.sim.engine`, the
same rules as the runtime): the predicted images/s is the engine's steady-state rate, not a closed form. Rows:

* ``hetpipe``: NP / ED / HD / auto allocations x default / local parameter placement (HetPipe §8.1);
* ``pipedream``, ``gpipe``, ``1f1b_flush``: each NP / ED / HD allocation is planned and run; the table shows the
  fastest (``all_rows`` keeps every candidate);
* ``horovod``: one VW per GPU that holds the model (the others are left out, with a reason);
* ``fsdp``: every GPU, parameters, gradients and optimizer state sharded (:mod:`hetpipe_jax.costs.fsdp_cost`),
  ``batch`` examples per GPU: ``even`` shards (ZeRO-3) and ``hetero`` (shards by memory, examples by speed); the
  engine runs its one-GPU VWs in lock-step with the collectives' exposed time as the step's reduction
  (:func:`fsdp_row`); the notes give the no-overlap bound. Each variant is tried without and with activation
  checkpointing per layer (``remat``, recorded in the row's label); the table shows the faster that fits.

Per row: GPUs used, Nm or M, images/s, the bottleneck (:func:`bottleneck`), memory feasibility (the fullest GPU's
share of its memory) and the bytes that cross nodes per step (every VW processing one minibatch: activations and
gradients over inter-node cuts, plus PS pushes and pulls divided over the wave's Nm minibatches, or the all-reduce).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

from hetpipe_jax.costs import fsdp_cost
from hetpipe_jax.costs import task_times as task_times_lib
from hetpipe_jax.costs.cluster import ClusterSpec
from hetpipe_jax.costs.profile_format import ModelProfile
from hetpipe_jax.planning import allocator
from hetpipe_jax.planning import plan_format
from hetpipe_jax.planning import plan_times
from hetpipe_jax.planning import planner
from hetpipe_jax.planning.plan_format import Plan
from hetpipe_jax.rules import methods
from hetpipe_jax.sim import engine
from hetpipe_jax.sim.engine_report import json_safe

HETPIPE_POLICIES = ("NP", "ED", "HD", "auto")
PIPELINE_POLICIES = ("NP", "ED", "HD")
MIB = float(2**20)


@dataclasses.dataclass
class Row:
  """One configuration's prediction (module docstring)."""

  method: str
  allocation: str
  placement: str
  num_vws: int
  gpus_used: int
  num_inflight: int | None  # Nm (WSP methods) or M (flush methods)
  images_per_s: float
  bottleneck: str
  memory_fits: bool
  memory_use: float  # the fullest GPU's memory over its capacity
  cross_node_bytes_per_step: float
  notes: list[str] = dataclasses.field(default_factory=list)
  engine_s: float = 0.0

  @property
  def label(self) -> str:
    extra = f"/{self.placement}" if self.placement else ""
    return f"{self.method} {self.allocation}{extra}"


@dataclasses.dataclass(frozen=True)
class CompareConfig:
  """What to compare.

  Attributes:
    num_vws: VWs for the pipelined methods (Horovod uses one per GPU that holds the model).
    staleness_bound: D for the WSP methods (hetpipe, pipedream).
    pull_every_wave: WSP pull policy (False: HetPipe §5's).
    num_waves: waves the engine runs per VW (the flush methods: a quarter as many steps, at least 4; a step of M
      micro-batches repeats exactly once the first one is done).
    remat: gpipe / 1f1b_flush rematerialisation (memory model).
    shared_nic: the engine's network rule (``EngineConfig.shared_nic``): VWs on one node share its NIC.
    ps_link_contention: the engine's ``ps_link_contention`` (every push and pull on one shared PS link); None: the
      engine's default (``EngineConfig``), so a change of that default reaches every comparison.
    num_inflight_by_engine: HetPipe NP / ED / HD rows take the Nm the engine runs fastest under this D
      (:func:`choose_num_inflight_by_engine`) instead of the planner's closed-form choice.
  """

  num_vws: int = 4
  staleness_bound: int = 0
  pull_every_wave: bool = False
  num_waves: int = 40
  remat: bool = False
  shared_nic: bool = True
  ps_link_contention: bool | None = None
  num_inflight_by_engine: bool = False


@dataclasses.dataclass(frozen=True)
class SyncView:
  """How ``compare`` reads a run under one ``Method.sync``.

  Attributes:
    share: ``(report, task times, per-VW wait shares, makespan s) -> (bottleneck label, share of the run)`` of the
      synchronisation (:func:`bottleneck`).
    waves: the engine waves to run for ``CompareConfig.num_waves``.
  """

  share: Callable[[engine.EngineReport, Sequence[task_times_lib.VWTaskTimes], list[float], float], tuple[str, float]]
  waves: Callable[[int], int]


def _allreduce_share(report, times, waits, span):
  return "network: all-reduce", max(x.allreduce_s for x in times) * max(report.final_global_clock - 1, 0) / span


SYNCS = {
    # WSP: waits every VW has are pushes and pulls at the staleness bound.
    "wsp": SyncView(lambda report, times, waits, span: ("PS: push/pull waits", min(waits)), lambda waves: waves),
    # All-reduce BSP: steps repeat exactly after the first (every VW waits for the reduction): a quarter of the waves.
    "allreduce": SyncView(_allreduce_share, lambda waves: max(4, waves // 4)),
}


def images_per_s(report: engine.EngineReport, plan: Plan) -> float:
  """The engine's steady-state rate in images/s: (micro-)batches/s times their size."""
  size = plan.batch_size / methods.micro_batches_per_minibatch(methods.get_method(plan.method), plan.num_inflight)
  return report.total_minibatches_per_s * size


def cross_node_bytes_per_step(plan: Plan) -> float:
  """Bytes crossing nodes while every VW processes one minibatch (module docstring)."""
  per_wave = methods.minibatches_per_wave(methods.get_method(plan.method), plan.num_inflight)
  return float(plan.ps_placement["total_bytes_crossing_nodes_per_wave"]) / per_wave


def bottleneck(report: engine.EngineReport, plan: Plan, times: Sequence[task_times_lib.VWTaskTimes]) -> str:
  """What limits the predicted rate: the largest share of the run's time among

  * the all-reduce (flush methods: its time over the run);
  * a straggler (the spread of waits across VWs: under WSP or all-reduce BSP the fast VWs wait for the slowest);
  * the PS (WSP waits every VW has: pushes and pulls at the bound);
  * the busiest GPU's compute, and its activation (gradient) sends with their waits for shared NICs (its busy time
    split in two);
  * the pipeline bubble (the busiest GPU's idle time not spent waiting: fill and drain, Nm or M too small);
  * the busiest NIC (``shared_nic``: its send or receive busy time over the run, ``EngineReport.nic_busy_s``).
  """
  span = report.makespan_s or 1.0
  waits = [v.wait_s / span for v in report.vws]
  sync = SYNCS[methods.get_method(plan.method).sync]
  g = max(report.gpus, key=lambda g: g.utilization)
  vw = plan.virtual_workers[g.vw_id]
  t = times[g.vw_id]
  s, last = g.stage_id, t.num_stages - 1
  send = (t.send_activation_s[s] if s < last else 0.0) + (t.send_gradient_s[s - 1] if s > 0 else 0.0)
  where = f"VW {g.vw_id} stage {s} on {vw.gpu_types[s]}"
  shares = {}
  # Its busy time is its compute, its sends, and (shared NICs) its sends' queueing at the NICs.
  minibatches = g.num_tasks / (1 if s == last else 2)
  sends = minibatches * send + max(0.0, g.busy_s - minibatches * t.stage_time_s(s))
  shares[f"compute: {where}"] = (g.busy_s - sends) / span
  shares[f"network: activations of {where}"] = sends / span
  slow = min(range(len(waits)), key=lambda v: waits[v])
  shares[f"straggler: VW {slow} ({'/'.join(dict.fromkeys(plan.virtual_workers[slow].gpu_types))})"] = (
      max(waits) - min(waits))
  label, share = sync.share(report, times, waits, span)
  shares[label] = share
  shares["pipeline bubble"] = max(0.0, 1.0 - g.utilization - waits[g.vw_id])
  if report.nic_busy_s:
    node, busy = max(report.nic_busy_s.items(), key=lambda kv: max(kv[1]))
    shares[f"network: NIC of node {node}"] = max(busy) / span
  label = max(shares, key=lambda k: shares[k])
  return f"{label} ({100 * shares[label]:.0f}%)"


def run_plan(plan: Plan, profile: ModelProfile, cluster: ClusterSpec, config: CompareConfig,
             allocation: str, placement: str) -> Row:
  """Runs ``plan`` in the engine; returns its row."""
  t0 = time.perf_counter()
  times = plan_times.task_times_from_plan(plan, profile, cluster)
  waves = SYNCS[methods.get_method(plan.method).sync].waves(config.num_waves)
  extra = {} if config.ps_link_contention is None else {"ps_link_contention": config.ps_link_contention}
  cfg = engine.EngineConfig(num_waves=waves, num_inflight=plan.num_inflight,
                            staleness_bound=config.staleness_bound, pull_every_wave=config.pull_every_wave,
                            records=False, method=plan.method, shared_nic=config.shared_nic,
                            max_held=plan_format.memory_caps(plan, plan.num_inflight), **extra)
  report = engine.run(times, cfg, gpu_ids=[list(vw.gpus) for vw in plan.virtual_workers])
  use = max(m / c for vw in plan.virtual_workers for m, c in zip(vw.stage_memory_bytes, vw.stage_capacity_bytes))
  return Row(plan.method, allocation, placement, len(plan.virtual_workers),
             sum(len(vw.gpus) for vw in plan.virtual_workers), plan.num_inflight, images_per_s(report, plan),
             bottleneck(report, plan, times), True, use, cross_node_bytes_per_step(plan), list(plan.notes),
             time.perf_counter() - t0)


def _infeasible(method: str, allocation: str, placement: str, error: Exception) -> Row:
  fits = "fit" not in str(error)  # memory ("fits no partition", "does not fit") vs a policy that does not apply
  return Row(method, allocation, placement, 0, 0, None, 0.0, "not applicable" if fits else "does not fit", fits,
             float("nan"), float("nan"), [str(error)])


def compare(cluster: ClusterSpec, profile: ModelProfile, config: CompareConfig = CompareConfig()
            ) -> tuple[list[Row], list[Row]]:
  """Plans and runs every method (module docstring).

  Returns:
    ``(table rows, all rows)``: the table keeps every HetPipe row, the fastest allocation of each other pipelined
    method, and Horovod.
  """
  table, every = [], []
  allocations: dict = {}  # hetpipe's allocation per config, shared by its two placements (planner.make_plan)

  def attempt(method, allocation, placement, **kw) -> Row:
    pc = planner.PlannerConfig(policy=allocation if allocation in allocator.POLICIES else "ED",
                               num_vws=config.num_vws, ps_placement=placement or "default", method=method,
                               remat=config.remat, **kw)
    try:
      if config.num_inflight_by_engine and pc.recipe.num_inflight_by_engine and allocation in PIPELINE_POLICIES:
        row = choose_num_inflight_by_engine(cluster, profile, pc, config, allocation, placement).row
      else:
        plan = planner.make_plan(cluster, profile, pc, allocations)
        row = run_plan(plan, profile, cluster, config, allocation, placement)
    except (allocator.AllocationError, ValueError) as e:
      row = _infeasible(method, allocation, placement, e)
    every.append(row)
    return row

  for policy in HETPIPE_POLICIES:
    for placement in ("default", "local"):
      table.append(attempt("hetpipe", policy, placement))
  for method in ("pipedream", "gpipe", "1f1b_flush"):
    placement = "default" if planner.recipe(method).ps_placements else ""
    rows = [attempt(method, policy, placement) for policy in PIPELINE_POLICIES]
    table.append(max(rows, key=lambda r: r.images_per_s))
  table.append(attempt("horovod", "all GPUs that fit", ""))
  for variant in fsdp_cost.VARIANTS:
    rows = []
    for remat in (False, True):
      label = fsdp_cost.VARIANT_LABELS[variant] + (" + remat" if remat else "")
      try:
        rows.append(fsdp_row(fsdp_cost.plan_fsdp(cluster, profile, variant, planner.PlannerConfig().cost, remat),
                             config))
      except fsdp_cost.FsdpInfeasibleError as e:
        rows.append(_infeasible("fsdp", label, "", e))
    every.extend(rows)
    table.append(max(rows, key=lambda r: r.images_per_s))
  return table, every


def fsdp_bottleneck(report: engine.EngineReport, plan: fsdp_cost.FsdpPlan) -> str:
  """What limits an fsdp step (shares of the run, from the engine's report): the slowest GPU's compute, the
  straggler spread (the other GPUs wait for it at every layer's collective) or the collectives the overlap does not
  hide (every GPU waits for them)."""
  span = report.makespan_s or 1.0
  waits = [v.wait_s / span for v in report.vws]
  g = max(report.gpus, key=lambda g: g.utilization)
  slow, fast = plan.gpus[g.vw_id], min(range(len(waits)), key=lambda v: waits[v])
  shares = {f"compute: {slow.gpu_id} ({slow.gpu_type})": g.utilization,
            f"straggler: {slow.gpu_type} (the others wait at every collective)": max(waits) - waits[fast],
            "network: all-gathers / reduce-scatters not hidden by compute": waits[fast]}
  label = max(shares, key=lambda k: shares[k])
  return f"{label} ({100 * shares[label]:.0f}%)"


def lockstep_steps_per_s(report: engine.EngineReport) -> float:
  """Steps/s of a lock-step run of one-micro-batch steps (fsdp): the slowest replica's step ends are one step apart,
  so ``(steps - 1) / (its last step end - its first)``. The engine's steady-state window (``steady_rates``) cuts the
  fast replicas' completions after the slow one's last and reads about one step in n low when the replicas differ
  (docs/design.md §12), which a few steps of very different GPUs (fsdp's examples by speed) would show."""
  steps = report.vws[0].num_minibatches
  span = max(v.last_completion_s for v in report.vws) - max(v.first_wave_end_s for v in report.vws)
  if steps < 2 or span <= 0:
    return report.total_minibatches_per_s / len(report.vws)
  return (steps - 1) / span


def fsdp_row(plan: fsdp_cost.FsdpPlan, config: CompareConfig) -> Row:
  """Runs an fsdp configuration in the engine (method ``fsdp``, M = 1, ``task_times.fsdp_task_times``); its row.
  Rate: the engine's steps/s times the step's examples, steps/s from :func:`lockstep_steps_per_s`."""
  t0 = time.perf_counter()
  times = task_times_lib.fsdp_task_times(plan)
  cfg = engine.EngineConfig(num_waves=max(4, config.num_waves // 4), num_inflight=1, records=False, method="fsdp",
                            shared_nic=config.shared_nic)
  report = engine.run(times, cfg, gpu_ids=[[g.gpu_id] for g in plan.gpus])
  steps_per_s = lockstep_steps_per_s(report)
  label = fsdp_cost.VARIANT_LABELS[plan.variant] + (" + remat" if plan.remat else "")
  return Row("fsdp", label, "", len(plan.gpus), len(plan.gpus), 1,
             steps_per_s * plan.global_batch, fsdp_bottleneck(report, plan), True, plan.memory_use,
             plan.cross_node_bytes, plan.notes(), time.perf_counter() - t0)


def format_table(rows: Sequence[Row], title: str = "", unit: str = "images") -> str:
  """A Markdown table of ``rows``; ``unit``: what an example is (:func:`hetpipe_jax.models.example_unit`), for the
  rate's header."""
  lines = [title] if title else []
  lines += [f"| method | allocation | GPUs | Nm / M | {unit}/s | bottleneck | memory | cross-node MiB/step |",
            "|---|---|---:|---:|---:|---|---|---:|"]
  for r in rows:
    nm = "-" if r.num_inflight is None else f"{methods.get_method(r.method).inflight_name}={r.num_inflight}"
    if r.memory_use == r.memory_use:
      mem = f"fits ({100 * r.memory_use:.0f}%)"
    else:
      mem = "-" if r.memory_fits else "does not fit"
    xb = "-" if r.cross_node_bytes_per_step != r.cross_node_bytes_per_step else \
        f"{r.cross_node_bytes_per_step / MIB:.1f}"
    alloc = r.allocation + (f" / {r.placement}" if r.placement else "")
    lines.append(f"| {r.method} | {alloc} | {r.gpus_used} | {nm} | {r.images_per_s:.0f} | {r.bottleneck} | {mem} | "
                 f"{xb} |")
  return "\n".join(lines)


def rows_to_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
  return [json_safe({**dataclasses.asdict(r), "label": r.label}) for r in rows]


def plot(rows: Sequence[Row], path: str, title: str = "", unit: str = "images") -> None:
  """A horizontal bar chart of the rate (``unit``/s) per row (grey: does not fit)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  colors = {"hetpipe": "tab:blue", "pipedream": "tab:purple", "gpipe": "tab:orange", "1f1b_flush": "tab:red",
            "horovod": "tab:green", "fsdp": "tab:olive"}
  fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
  labels = [r.label for r in rows][::-1]
  values = [r.images_per_s for r in rows][::-1]
  ax.barh(labels, values, color=[colors[r.method] if r.memory_fits else "lightgrey" for r in rows][::-1])
  for y, v in enumerate(values):
    ax.text(v, y, f" {v:.0f}", va="center", fontsize=8)
  ax.set_xlabel(f"predicted {unit}/s (event engine)")
  ax.set_title(title, fontsize=10)
  ax.grid(axis="x", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


@dataclasses.dataclass(frozen=True)
class NumInflightChoice:
  """An Nm chosen by running the engine (:func:`choose_num_inflight_by_engine`).

  Attributes:
    plan: the plan at the chosen Nm.
    row: its engine row.
    rates: Nm -> the engine's images/s at that Nm (every Nm tried, 1..the smallest Max_m).
    planner_num_inflight: the Nm the planner's closed form chooses (no synchronisation, no PS time).
  """

  plan: Plan
  row: Row
  rates: dict[int, float]
  planner_num_inflight: int


def choose_num_inflight_by_engine(cluster: ClusterSpec, profile: ModelProfile, planner_config: planner.PlannerConfig,
                                  config: CompareConfig, allocation: str = "", placement: str = "",
                                  max_num_inflight: int | None = None) -> NumInflightChoice:
  """HetPipe's Nm "set such that performance is maximized while every virtual worker uses the same value" (HetPipe
  §8.3), with the performance measured by the engine under the run's D and pull policy (``config``) rather than the
  planner's closed form (which has no synchronisation or PS time): every Nm from 1 to the smallest Max_m (or
  ``max_num_inflight``) is planned (partitions re-made for that Nm's memory) and run; the fastest wins (smallest on
  ties within 0.1%).

  Args:
    planner_config: a ``hetpipe`` NP / ED / HD config (its ``num_inflight`` is replaced by each candidate).

  Raises:
    allocator.AllocationError: the model fits no allocation even at Nm = 1.
    ValueError: ``planner_config`` is not a hetpipe NP / ED / HD config.
  """
  if not planner_config.recipe.num_inflight_by_engine or planner_config.policy not in PIPELINE_POLICIES:
    raise ValueError(f"choose_num_inflight_by_engine needs a hetpipe NP/ED/HD planner config, got method="
                     f"{planner_config.method!r} policy={planner_config.policy!r}")
  base = planner.make_plan(cluster, profile, dataclasses.replace(planner_config, num_inflight=0))
  top = min(vw.max_num_inflight for vw in base.virtual_workers)
  if max_num_inflight is not None:
    top = min(top, max_num_inflight)
  rates, best = {}, None
  for nm in range(1, top + 1):
    plan = planner.make_plan(cluster, profile, dataclasses.replace(planner_config, num_inflight=nm))
    row = run_plan(plan, profile, cluster, config, allocation or planner_config.policy,
                   placement or planner_config.ps_placement)
    rates[nm] = row.images_per_s
    if best is None or row.images_per_s > best[1].images_per_s * 1.001:
      best = (plan, row)
  return NumInflightChoice(best[0], best[1], rates, base.num_inflight)
