"""Validated job settings derived from an ml_collections config (checked on every rank before any work).

Planning layer: no jax or mpi4py, so a bad config fails in milliseconds with one clear message.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any


class ConfigError(ValueError):
  """A setting is invalid; the message names it and says how to fix it."""


@dataclasses.dataclass(frozen=True)
class VWLayout:
  """One VW's pipeline: a layer range and a local device index per stage."""

  partition: tuple[tuple[int, int], ...] | None  # None -> even split once the model's layer count is known
  devices: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class JobSettings:
  model: str
  num_virtual_workers: int
  num_inflight: int
  staleness_bound: int
  vws: tuple[VWLayout, ...]
  platform: str

  @property
  def world_size(self) -> int:
    return 1 + self.num_virtual_workers

  @property
  def num_stages(self) -> int:
    return len(self.vws[0].devices)

  @property
  def devices_needed(self) -> int:
    """Local devices one VW process needs (max device index + 1)."""
    return 1 + max(max(v.devices) for v in self.vws)


def parse_partition(text: str) -> tuple[tuple[int, int], ...] | None:
  """``"0:3,3:7"`` → ``((0, 3), (3, 7))``; ``""`` → None (even split).

  Raises:
    ConfigError: malformed text.
  """
  if not text.strip():
    return None
  ranges = []
  for part in text.split(","):
    try:
      start, end = (int(v) for v in part.split(":"))
    except ValueError:
      raise ConfigError(f"config.partition={text!r} is malformed: write one 'start:end' layer range per stage, "
                        "comma-separated, e.g. '0:3,3:7'") from None
    ranges.append((start, end))
  return tuple(ranges)


def _parse_devices(text: str, num_stages: int) -> tuple[int, ...]:
  if not text.strip():
    return tuple(range(num_stages))
  try:
    devices = tuple(int(v) for v in text.split(","))
  except ValueError:
    raise ConfigError(f"config.stage_devices={text!r} is malformed: give one device index per stage, e.g. '0,1'") \
        from None
  if len(devices) != num_stages:
    raise ConfigError(f"config.stage_devices lists {len(devices)} devices for {num_stages} stages")
  if min(devices) < 0 or len(set(devices)) != len(devices):
    raise ConfigError(f"config.stage_devices={text!r} must be distinct non-negative device indices")
  return devices


def settings_from_config(config: Any, plan: dict | None = None) -> JobSettings:
  """Checks the scalar settings and builds the per-VW layout (from the config or a plan dict).

  Args:
    config: the job's ConfigDict (see ``experiments/configs/default.py``).
    plan: a loaded plan JSON (``hetpipe_jax.plan``) or None.

  Raises:
    ConfigError: ``num_inflight < 1``, ``staleness_bound < 0``, a non-positive VW/stage/batch count, a malformed
      partition or device list, an unknown platform or optimizer.
  """
  if config.num_inflight < 1:
    raise ConfigError(f"config.num_inflight={config.num_inflight}: Nm must be >= 1 (1 = no pipelining)")
  if config.staleness_bound < 0:
    raise ConfigError(f"config.staleness_bound={config.staleness_bound}: D must be >= 0 (0 = BSP with pipelining)")
  if config.batch_size < 1:
    raise ConfigError(f"config.batch_size={config.batch_size} must be >= 1")
  if config.platform not in ("cpu", "gpu"):
    raise ConfigError(f"config.platform={config.platform!r} must be 'cpu' or 'gpu'")
  if config.optimizer not in ("adam", "sgd", "momentum"):
    raise ConfigError(f"config.optimizer={config.optimizer!r} must be 'adam', 'sgd' or 'momentum'")
  if config.lr_schedule not in ("constant", "cosine"):
    raise ConfigError(f"config.lr_schedule={config.lr_schedule!r} must be 'constant' or 'cosine'")
  if not config.learning_rate > 0:
    raise ConfigError(f"config.learning_rate={config.learning_rate} must be > 0")
  if plan is not None:
    if int(plan["batch_size"]) != config.batch_size:
      raise ConfigError(f"the plan was made for batch size {plan['batch_size']} but config.batch_size="
                        f"{config.batch_size}: re-plan or set --config.batch_size={plan['batch_size']}")
    # On "cpu" every VW process forces its own host devices, so stage s runs on local device s; on "gpu" the
    # plan's node-local device indices are used as they are.
    vws = tuple(VWLayout(tuple(tuple(r) for r in vw["partition"]),
                         tuple(range(len(vw["partition"]))) if config.platform == "cpu" else tuple(vw["devices"]))
                for vw in plan["virtual_workers"])
    return JobSettings(plan["model"], len(vws), int(plan["num_inflight"]), config.staleness_bound, vws,
                       config.platform)
  if config.num_virtual_workers < 1:
    raise ConfigError(f"config.num_virtual_workers={config.num_virtual_workers} must be >= 1")
  if config.num_stages < 1:
    raise ConfigError(f"config.num_stages={config.num_stages} must be >= 1")
  partition = parse_partition(config.partition)
  if partition is not None and len(partition) != config.num_stages:
    raise ConfigError(f"config.partition={config.partition!r} has {len(partition)} ranges but config.num_stages="
                      f"{config.num_stages}")
  layout = VWLayout(partition, _parse_devices(config.stage_devices, config.num_stages))
  return JobSettings(config.model, config.num_virtual_workers, config.num_inflight, config.staleness_bound,
                     (layout,) * config.num_virtual_workers, config.platform)


def check_world_size(settings: JobSettings, world_size: int) -> None:
  """Raises ConfigError unless the MPI world is 1 PS + one rank per VW."""
  if world_size != settings.world_size:
    raise ConfigError(f"MPI world size is {world_size} but the job has {settings.num_virtual_workers} virtual "
                      f"workers: run `mpiexec -n {settings.world_size} ...` (rank 0 = PS, ranks 1..N = VWs) or set "
                      f"config.num_virtual_workers={world_size - 1}")


def check_devices(settings: JobSettings, num_devices: int) -> None:
  """Raises ConfigError when a VW needs more local devices than its process has."""
  if settings.devices_needed > num_devices:
    raise ConfigError(f"{settings.num_stages} stages need {settings.devices_needed} local devices per VW but only "
                      f"{num_devices} {settings.platform} device(s) exist: lower config.num_stages or fix "
                      "config.stage_devices")


def config_to_json(config: Any) -> str:
  return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)


def load_plan_dict(config: Any) -> dict | None:
  """Reads ``config.plan`` (a plan JSON written by ``python -m hetpipe_jax.plan``); None when unset.

  Raises:
    ConfigError: the file is missing or unreadable, or it was made for another model than ``config.model``.
  """
  if not config.plan:
    return None
  from hetpipe_jax import plan_format
  path = pathlib.Path(config.plan)
  if not path.is_absolute() and not path.exists():
    path = pathlib.Path(__file__).resolve().parents[1] / path  # relative to the repository root
  try:
    return plan_format.plan_to_dict(plan_format.load_plan(str(path), expected_model=config.model))
  except (OSError, ValueError) as e:
    raise ConfigError(f"config.plan={config.plan!r}: {e}") from None


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


def emulated_task_times(config: Any, settings: "JobSettings") -> list | None:
  """Per-VW :class:`hetpipe_jax.task_times.VWTaskTimes` for emulated devices, or None when not emulating.

  ``config.emulate_stage_ms`` gives synthetic per-stage times (a third forward, two thirds backward);
  ``config.emulate_plan`` uses the cost model's times for the GPU types the plan's devices stand in for.

  Raises:
    ConfigError: both set, ``emulate_plan`` without a plan, or malformed times.
  """
  from hetpipe_jax import task_times
  rows = parse_stage_ms(config.emulate_stage_ms, settings.num_virtual_workers, settings.num_stages)
  if rows is not None and config.emulate_plan:
    raise ConfigError("set config.emulate_stage_ms or config.emulate_plan, not both")
  if rows is not None:
    return [task_times.uniform_task_times(r) for r in rows]
  if not config.emulate_plan:
    return None
  if not config.plan:
    raise ConfigError("config.emulate_plan needs config.plan (the plan's GPU types give the task times)")
  from hetpipe_jax import cluster as cluster_lib, plan_format
  plan = plan_format.plan_from_dict(load_plan_dict(config))
  try:
    profile = task_times.profile_for_plan(plan)
    return task_times.task_times_from_plan(plan, profile, cluster_lib.load_cluster(plan.cluster))
  except (OSError, ValueError) as e:
    raise ConfigError(f"config.emulate_plan: {e}") from None
