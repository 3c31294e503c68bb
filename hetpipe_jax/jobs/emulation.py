"""Emulated device times of a job: per VW, the task durations that pad each task (MPI) or drive simulated time
(virtual time), from ``emulate_stage_ms``, the plan's cost model (``emulate_plan``) or another plan (``timing_plan``).

Planning layer (no jax): bad emulation settings fail on every rank before any work.
"""

from __future__ import annotations

from hetpipe_jax.costs import cluster as cluster_lib
from hetpipe_jax.costs import task_times
from hetpipe_jax.jobs.job import Job
from hetpipe_jax.jobs.job_checks import ConfigError
from hetpipe_jax.paths import repo_path
from hetpipe_jax.planning import plan_format
from hetpipe_jax.planning import plan_times as plan_times_lib
from hetpipe_jax.rules import methods


def parse_stage_ms(text: str, num_vws: int, num_stages: int) -> list[list[float]] | None:
  """``"20,40"`` (every VW) or ``"20,40;30,30"`` (per VW) → per-VW per-stage milliseconds; ``""`` → None.

  Raises:
    ConfigError: malformed, wrong counts, or a non-positive time.
  """
  if not text.strip():
    return None
  try:
    rows = [[float(v) for v in part.split(",")] for part in text.split(";")]
  except ValueError:
    raise ConfigError(f"config.emulate_stage_ms={text!r} is malformed: write per-stage milliseconds, e.g. "
                      "'20,40' for every VW or '20,40;30,30' per VW") from None
  if len(rows) == 1:
    rows = rows * num_vws
  if len(rows) != num_vws or any(len(r) != num_stages for r in rows):
    raise ConfigError(f"config.emulate_stage_ms={text!r} needs {num_stages} times per VW for {num_vws} VWs")
  if any(v <= 0 for r in rows for v in r):
    raise ConfigError(f"config.emulate_stage_ms={text!r}: every time must be > 0")
  return rows


def timing_plan_task_times(job: Job) -> list:
  """Per-VW task times from ``config.timing_plan``: another plan's cost-model times drive simulated time while
  ``config.model``'s numerics run on the config's layout (virtual time only; e.g. the paper-scale ResNet-152's plan
  on ``hetpipe_paper`` timing a Fashion-MNIST model, HetPipe §8.4 reproduced as staleness pattern and speed).

  The timing plan must describe the run's schedule: the same method, number of VWs, stages per VW, ``num_inflight``
  (Nm, or M for the flush methods) and batch size; its model may differ from ``config.model``.

  Returns:
    Per VW a :class:`hetpipe_jax.costs.task_times.VWTaskTimes` (seconds),
    :func:`hetpipe_jax.planning.plan_times.task_times_from_plan`.

  Raises:
    ConfigError: ``config.plan`` is also set, the file is missing or invalid, or the timing plan's schedule differs
      from the run's (the message names both values and the fix).
  """
  emu = job.emulation
  name = f"config.timing_plan={emu.timing_plan!r}"
  if job.plan is not None:
    raise ConfigError(f"{name} and config.plan={job.plan_path!r}: a timing plan times a run laid out by the config "
                      "(num_virtual_workers, num_stages, num_inflight); unset one of them (--config.plan=)")
  try:
    plan = plan_format.load_plan(str(repo_path(emu.timing_plan)))
  except (OSError, ValueError) as e:
    raise ConfigError(f"{name}: {e}") from None
  stages = [len(vw.partition) for vw in plan.virtual_workers]
  checks = (("method", plan.method, job.method),
            ("num_virtual_workers", len(stages), job.num_virtual_workers),
            ("num_stages", stages, [len(vw.devices) for vw in job.vws]),
            ("num_inflight", plan.num_inflight, job.num_inflight),
            ("batch_size", plan.batch_size, job.batch_size))
  for field, want, got in checks:
    if want != got:
      raise ConfigError(f"{name} has {field}={want} but the run has config.{field}={got}: the timing plan must "
                        f"describe the run's schedule; set --config.{field}={want} or plan the timing again")
  try:
    return plan_times_lib.task_times_from_plan(plan, plan_times_lib.profile_for_plan(plan),
                                               cluster_lib.load_cluster(plan.cluster))
  except (OSError, ValueError) as e:
    raise ConfigError(f"{name}: {e}") from None


def emulated_task_times(job: Job, *, plan_times: bool | None = None,
                        virtual: bool = False) -> list | None:
  """Per-VW :class:`hetpipe_jax.costs.task_times.VWTaskTimes` for emulated devices, or None when not emulating.

  ``config.emulate_stage_ms`` gives synthetic per-stage times of one minibatch (a third forward, two thirds
  backward; the flush methods' tasks are micro-batches, each ``1 / M`` of it);
  ``config.emulate_plan`` (or ``plan_times=True``) uses the cost model's times for the GPU types of the plan's devices;
  ``config.timing_plan`` (``virtual`` runs only) another plan's (:func:`timing_plan_task_times`).

  Raises:
    ConfigError: two sources set, plan times without a plan, a timing plan outside virtual time, or malformed times.
  """
  emu = job.emulation
  use_plan = emu.emulate_plan if plan_times is None else plan_times
  if emu.timing_plan:
    if not virtual:
      raise ConfigError(f"config.timing_plan={emu.timing_plan!r} times simulated seconds: it needs --mode=virtual "
                        "(under MPI use config.emulate_plan with a plan of config.model)")
    if emu.emulate_stage_ms.strip() or emu.emulate_plan:
      raise ConfigError("set one of config.timing_plan, config.emulate_stage_ms and config.emulate_plan")
    return timing_plan_task_times(job)
  stages = job.num_stages
  rows = None
  if emu.emulate_stage_ms.strip():
    if stages is None:
      raise ConfigError("config.emulate_stage_ms needs every VW to have the same number of stages")
    rows = parse_stage_ms(emu.emulate_stage_ms, job.num_virtual_workers, stages)
  if rows is not None and use_plan:
    raise ConfigError("set config.emulate_stage_ms or config.emulate_plan, not both")
  if rows is not None:
    # the given times are per minibatch; a task is a micro-batch (flush methods)
    per_task = methods.micro_batches_per_minibatch(methods.get_method(job.method), job.num_inflight)
    rows = [[v / per_task for v in r] for r in rows]
    return [task_times.uniform_task_times(r) for r in rows]
  if not use_plan:
    return None
  if job.plan is None:
    raise ConfigError("config.emulate_plan needs config.plan (the plan's GPU types give the task times)")
  plan = job.plan
  try:
    profile = plan_times_lib.profile_for_plan(plan)
    return plan_times_lib.task_times_from_plan(plan, profile, cluster_lib.load_cluster(plan.cluster))
  except (OSError, ValueError) as e:
    raise ConfigError(f"config.emulate_plan: {e}") from None


def virtual_task_times(job: Job) -> tuple[list, bool]:
  """``(task times, emulate_plan)``: the durations virtual time runs on — synthetic ones (``emulate_stage_ms``), a
  ``timing_plan``'s, or else the plan's GPU types through the cost model — and whether they are the plan's (what
  config.json records as ``emulate_plan``).

  Raises:
    ConfigError: none of the three is given, or ``emulate_plan=False`` leaves none.
  """
  emu = job.emulation
  use_plan = not emu.emulate_stage_ms.strip() and not emu.timing_plan
  if use_plan and emu.emulate_plan is False:
    raise ConfigError("config.emulate_plan=False leaves --mode=virtual without task durations (no emulate_stage_ms "
                      "or timing_plan): set one of them, or leave config.emulate_plan unset to use the plan's")
  if use_plan and job.plan is None:
    raise ConfigError("--mode=virtual needs task durations: set config.emulate_stage_ms, config.plan or "
                      "config.timing_plan")
  emulate_plan = bool(use_plan or emu.emulate_plan)
  return emulated_task_times(job, plan_times=emulate_plan, virtual=True), emulate_plan
