"""Checkpoint segments and resume, shared by the MPI job and the virtual-time job (docs/design.md §6).

Runtime layer. A run with ``config.checkpoint_every_waves = K > 0`` is cut into *segments* at the global clocks
``K, 2K, ...``. The end of a segment is a WSP barrier: every VW finishes the segment's last wave (its pipeline
drains), the PS then holds exactly every VW's waves ``0..C-1`` (under both ``ps_apply`` modes, since no VW has
started wave C), the checkpoint of clock C is written (global weights, every VW's optimizer state split by layer,
data positions, the PS's log, records, metrics), and every VW continues from the global weights with nothing of its
own outstanding (:meth:`hetpipe_jax.runtime.virtual_worker.VirtualWorker.begin_segment`). The uninterrupted run
passes through exactly this cut, so a resumed run continues it: bit-identically in virtual time.

Within a segment clocks and minibatch ids start at 0; the job adds the segment's offsets (:class:`Offsets`) to
records, the PS's log and metrics, so the outputs read as one run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import subprocess
from typing import Any, Sequence

from absl import logging
import numpy as np

from hetpipe_jax.jobs.checkpoint import TrainingCheckpoints
from hetpipe_jax.jobs.job import CheckpointSettings, Job
from hetpipe_jax.jobs.job_config import ConfigError
from hetpipe_jax.paths import REPO_ROOT


def segments(start_clock: int, total_waves: int, every: int) -> list[tuple[int, int]]:
  """The ``(first, end)`` global clocks of each segment from ``start_clock`` to ``total_waves``.

  Segments end at the multiples of ``every`` (0: one segment) and at ``total_waves``.

  Raises:
    ValueError: ``start_clock`` not in ``[0, total_waves)``, or ``every < 0``.
  """
  if every < 0:
    raise ValueError(f"checkpoint_every_waves must be >= 0, got {every}")
  if not 0 <= start_clock < total_waves:
    raise ValueError(f"start clock {start_clock} outside the run's {total_waves} waves")
  if every == 0:
    return [(start_clock, total_waves)]
  bounds = [start_clock] + list(range((start_clock // every + 1) * every, total_waves, every)) + [total_waves]
  return list(zip(bounds[:-1], bounds[1:]))


@dataclasses.dataclass
class Offsets:
  """How a segment's local clocks, minibatch ids and times map to the run's.

  Attributes:
    clock: global clock at the segment's start (every VW's waves below it are in its starting weights).
    minibatch: minibatches each VW completed before the segment.
    time_s: seconds (simulated, or wall since the run's first start) at the segment's start.
  """

  clock: int = 0
  minibatch: int = 0
  time_s: float = 0.0


def shift_record(record: Any, off: Offsets) -> None:
  """Moves a segment's :class:`~hetpipe_jax.rules.records.MinibatchRecord` (in place) into the run's numbering."""
  if off.clock == 0 and off.minibatch == 0 and off.time_s == 0.0:
    return
  record.minibatch_id += off.minibatch
  record.wave_id += off.clock
  record.local_clock_at_injection += off.clock
  record.version_local_updates += off.minibatch
  record.version_global_clock += off.clock
  record.version_vector_clock = tuple(off.clock + c for c in record.version_vector_clock)
  record.inject_time_s += off.time_s
  record.complete_time_s += off.time_s


def code_version() -> str:
  """``git describe --always --dirty`` of the repository, or "unknown"."""
  try:
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=10, check=False)
    return out.stdout.strip() or "unknown"
  except (OSError, subprocess.SubprocessError):
    return "unknown"


@dataclasses.dataclass
class ResumePoint:
  """A checkpoint to continue from, mapped onto this run's settings.

  Attributes:
    step: its global clock C.
    flat_weights: global weights, float32 ``[num_params]``.
    opt_states: per VW of *this* run, ``(scalars, per_layer)`` (from checkpoint VW ``v % N_old``).
    minibatch_start: minibatches each VW of this run has done (its data position).
    meta: the checkpoint's metadata.
    notes: what changed since the checkpoint (plan, Nm, VWs), logged and recorded.
  """

  step: int
  flat_weights: np.ndarray
  opt_states: dict[int, tuple[list, list]]
  minibatch_start: int
  meta: dict[str, Any]
  notes: list[str]


def check_resume_workdir(workdir: str | pathlib.Path, resume: bool) -> None:
  """Before any work: ``--resume`` needs checkpoints in ``workdir``; without it, an unfinished run's checkpoints are
  never overwritten.

  Raises:
    ConfigError: ``resume`` without checkpoints, or checkpoints without ``resume``.
  """
  ckpts = pathlib.Path(workdir) / "checkpoints"
  has = ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())
  if resume and not has:
    raise ConfigError(f"--resume: {workdir} has no checkpoints to resume from (run with "
                      "config.checkpoint_every_waves > 0 to write them)")
  if not resume and has:
    raise ConfigError(f"--workdir={workdir} holds an unfinished run's checkpoints ({ckpts}): pass --resume to "
                      "continue it, or choose a new --workdir")


# What a resume may not change: the method, the optimizer and its settings, the data order and the minibatch. (The
# layout, Nm, the VWs, the shards, the stage ranks and the run's length may; so may D and the PS's rules.)
SAME_ON_RESUME = ("method", "optimizer", "learning_rate", "lr_schedule", "warmup_minibatches", "momentum", "adam_b1",
                  "adam_b2", "weight_decay", "muon_beta", "muon_consistent_rms", "grad_clip_norm", "seed",
                  "batch_size", "dataset")


def load_resume_point(workdir: str | pathlib.Path, settings: Job, partitions: Sequence[Sequence[Sequence[int]]],
                      layout, num_layers: int, model_name: str) -> ResumePoint:
  """Reads the newest readable checkpoint of ``workdir`` and maps it onto ``settings`` (any plan of the same model).

  The global weights are layer-ordered, so they fit any partition; optimizer states follow their layers; a VW of
  this run takes checkpoint VW ``v % N_old``'s state; each VW starts at minibatch ``m_old * N_old // N_new`` of its
  (possibly re-sharded) data, so the examples seen continue (``m_old``: minibatches each old VW completed).

  The training itself continues as it was: the settings of :data:`SAME_ON_RESUME` must equal the checkpoint run's
  (its ``config.json`` in the checkpoint); the layout and the run's length may change.

  Raises:
    ConfigError: no readable checkpoint, one from another model, or a setting of :data:`SAME_ON_RESUME` changed.
  """
  store = TrainingCheckpoints(workdir)
  try:
    got = store.restore_latest()
  finally:
    store.close()
  if got is None:
    raise ConfigError(f"--resume: no readable checkpoint in {pathlib.Path(workdir) / 'checkpoints'}")
  step, weights, opt_states, meta = got
  if meta.get("model") != model_name or int(meta.get("num_layers", -1)) != num_layers:
    raise ConfigError(f"checkpoint {step} of {workdir} was written for model {meta.get('model')!r} "
                      f"({meta.get('num_layers')} layers); this run's model is {model_name!r} ({num_layers} layers): "
                      "resume with the same config.model, or choose a new --workdir")
  was = meta.get("config", {})
  changed = [f"config.{k}={settings.flat.get(k)!r} (the run used {was.get(k)!r})" for k in SAME_ON_RESUME
             if k in was and settings.flat.get(k) != was.get(k)]
  if changed:  # the resumed part would train another way than config.json and the records say
    raise ConfigError(f"--resume continues checkpoint {step} of {workdir} with the same training, but "
                      f"{'; '.join(changed)}: resume with the run's values (the layout and the run's length may "
                      "change), or choose a new --workdir")
  try:
    flat = layout.flatten(weights)
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f"checkpoint {step} of {workdir} does not fit model {model_name!r}: {e}") from None
  n_old, n_new = int(meta["num_virtual_workers"]), settings.num_virtual_workers
  m_old = int(meta["minibatches_done_per_vw"])
  notes = []
  for key, now in (("num_virtual_workers", n_new), ("num_inflight", settings.num_inflight),
                   ("partitions", [[list(r) for r in p] for p in partitions]),
                   ("num_ps_shards", settings.num_ps_shards),
                   ("stage_groups", [[list(g) for g in groups] for groups in settings.stage_groups])):
    if key in meta and meta.get(key) != now:
      notes.append(f"resume onto a new plan: {key} {meta.get(key)} -> {now}")
  if n_new != n_old:
    notes.append(f"{n_old} -> {n_new} VWs: data re-sharded over {n_new} VWs; each VW starts at minibatch "
                 f"{m_old * n_old // n_new} of its shard; VW v takes checkpoint VW v mod {n_old}'s optimizer state")
  for note in notes:
    logging.info("[resume] %s", note)
  return ResumePoint(step, flat, {v: opt_states[v % n_old] for v in range(n_new)}, m_old * n_old // n_new, meta, notes)


def resumed_shard_logs(meta: dict, num_shards: int, applied: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
  """The ``(wave, vw)`` application logs of PS shards ``1..S-1`` the run continues (empty lists for a fresh run).

  A checkpoint written with the same shard count gives each shard its own log. Under another layout (a new plan,
  fewer nodes) the old shards' slices are not this run's; every old shard applied every wave up to the cut, so each
  new shard continues the old lead's log, ``applied`` (the same waves, once each).

  Args:
    meta: the checkpoint's metadata ({} for a fresh run).
    num_shards: S of this run.
    applied: the lead's log up to the checkpoint (:meth:`hetpipe_jax.jobs.run_context.RunContext.resumed_logs`).
  """
  old = meta.get("shard_applied")
  if old is not None and int(meta.get("num_ps_shards", 1)) == num_shards:
    return [[(int(w), int(v)) for w, v in log] for log in old]
  return [[(int(w), int(v)) for w, v in applied] for _ in range(num_shards - 1)]


def read_lines(path: pathlib.Path) -> list[dict]:
  """The JSON lines of ``path`` (``metrics.jsonl``), [] when it does not exist."""
  if not path.exists():
    return []
  return [json.loads(t) for t in path.read_text().splitlines() if t.strip()]


def rewrite_lines(path: pathlib.Path, lines: Sequence[dict]) -> None:
  """Writes ``path`` back as a checkpoint saw it (later lines belong to the part of the run a resume redoes)."""
  path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def checkpoint_meta(*, step: int, settings: Job, partitions: Sequence[Sequence[Sequence[int]]],
                    model_name: str, num_layers: int, opt_parts_per_layer: int,
                    minibatches_done: int, applied: Sequence[Sequence[int]], records: Sequence[dict],
                    metrics: Sequence[dict], evals: Sequence[dict], time_s: float, config_json: dict,
                    resumes: Sequence[dict], version_ids: Sequence[int], last_loss: float,
                    pending_losses: Sequence[float], extra: dict | None = None) -> dict[str, Any]:
  """The JSON metadata of a checkpoint (what a resume needs besides tensors, and where it came from)."""
  return {"global_clock": step, "model": model_name, "num_layers": num_layers,
          "opt_parts_per_layer": opt_parts_per_layer, "num_virtual_workers": settings.num_virtual_workers,
          "num_inflight": settings.num_inflight, "staleness_bound": settings.staleness_bound,
          "partitions": [[list(r) for r in p] for p in partitions],
          "minibatches_done_per_vw": minibatches_done, "applied": [list(map(int, a)) for a in applied],
          "records": list(records), "metrics": list(metrics), "evals": list(evals), "time_s": time_s,
          "version_ids": list(version_ids), "last_loss": last_loss, "pending_losses": list(pending_losses),
          "config": config_json, "plan": _plan_record(config_json.get("plan")), "code_version": code_version(),
          "resumes": list(resumes), **(extra or {})}


def _plan_record(plan_path: str | None) -> dict[str, Any] | None:
  """The plan a checkpoint came from: its path and the SHA-256 of its file (None without a plan)."""
  if not plan_path:
    return None
  path = pathlib.Path(plan_path)
  if not path.is_absolute():
    path = REPO_ROOT / path
  try:
    return {"path": str(plan_path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
  except OSError:
    return {"path": str(plan_path), "sha256": None}


def save_training_checkpoint(store, step: int, weights: list, opt_states: dict, meta: dict) -> dict[str, float]:
  """Saves one checkpoint through ``store`` (:class:`~hetpipe_jax.jobs.checkpoint.TrainingCheckpoints`); returns its
  ``{"global_clock", "seconds", "bytes"}``.

  Raises:
    ConfigError: it could not be written (full disk, no permission); the earlier checkpoints stay intact.
  """
  try:
    got = store.save(step, weights, opt_states, meta)
  except OSError as e:
    raise ConfigError(f"the checkpoint of global clock {step} could not be written to {store.directory} ({e}); the "
                      "earlier checkpoints are intact: free space (or fix the permissions) and run again with "
                      "--resume") from None
  logging.info("[checkpoint] global clock %d: %.1f MB in %.2f s", step, got["bytes"] / 1e6, got["seconds"])
  return {"global_clock": step, **got}


def checkpoint_summary(checkpoint: CheckpointSettings, stats: Sequence[dict], resumes: Sequence[dict]
                       ) -> dict[str, Any]:
  """The summary's checkpoint fields: the interval, each checkpoint's clock, size and seconds, and the resumes."""
  return {"checkpoint_every_waves": checkpoint.every_waves,
          "checkpoints": list(stats),
          "checkpoint_seconds_total": float(sum(s["seconds"] for s in stats)),
          "resumes": list(resumes)}


def nan_injector(target: tuple[int, int] | None, vw_id: int, off: Offsets):
  """The fault drill's hook for VW ``vw_id`` (``target``: the job's ``run.debug_nan_update``, ``(vw, wave)`` or
  None): ``(local wave, flat update) -> None`` puts a NaN into the update of the named global wave; None when this
  VW has no drill."""
  if target is None or target[0] != vw_id:
    return None

  def corrupt(wave: int, flat: np.ndarray) -> None:
    if off.clock + wave == target[1]:
      flat[0] = np.nan
  return corrupt
