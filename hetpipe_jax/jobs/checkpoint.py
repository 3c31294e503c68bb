"""Checkpoints with orbax: the final global weights, and consistent training checkpoints for resume (docs/design.md §6)."""

from __future__ import annotations

import pathlib
import time
from typing import Any

from absl import logging
import numpy as np


def save_weights(directory: str | pathlib.Path, layer_params: list[Any]) -> pathlib.Path:
  """Writes per-layer params (numpy pytrees) to ``directory`` (must not exist yet); returns its absolute path.

  Raises:
    FileExistsError: the directory exists (a checkpoint is never overwritten).
  """
  import orbax.checkpoint as ocp

  path = pathlib.Path(directory).absolute()
  if path.exists():
    raise FileExistsError(f"checkpoint {path} already exists; choose a new --workdir")
  tree = {f"layer_{i:03d}": p for i, p in enumerate(layer_params)}
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.WARNING)  # orbax logs every step of a save at INFO
  try:
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(path, tree)
      ckptr.wait_until_finished()
  finally:
    logging.set_verbosity(verbosity)
  return path


def restore_weights(directory: str | pathlib.Path) -> list[Any]:
  """Reads what :func:`save_weights` wrote; returns per-layer params with numpy leaves."""
  import jax
  import orbax.checkpoint as ocp

  path = pathlib.Path(directory).absolute()
  with ocp.StandardCheckpointer() as ckptr:
    tree = ckptr.restore(path)
  return [jax.tree.map(np.asarray, tree[k]) for k in sorted(tree)]


class TrainingCheckpoints:
  """Consistent training checkpoints under ``<workdir>/checkpoints/<global clock>/`` (orbax ``CheckpointManager``).

  Each step holds ``state`` (orbax: the global weights per layer and every VW's optimizer state split by layer, see
  :mod:`hetpipe_jax.runtime.opt_state`) and ``meta`` (JSON: clocks, data positions, the PS's log, records, metrics,
  config, plan and code version). Saves are atomic (orbax writes a temporary directory and renames it when
  complete), and only the newest ``max_to_keep`` are kept.

  Args:
    workdir: the run's directory.
    max_to_keep: checkpoints kept (>= 1).
  """

  def __init__(self, workdir: str | pathlib.Path, max_to_keep: int = 3):
    import orbax.checkpoint as ocp
    self._ocp = ocp
    self.directory = (pathlib.Path(workdir) / "checkpoints").absolute()
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                             enable_async_checkpointing=False),
        item_names=("state", "meta"))

  def close(self) -> None:
    self._manager.close()

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, global_clock: int, weights: list[Any], opt_states: dict[int, tuple[list, list]],
           meta: dict[str, Any]) -> dict[str, float]:
    """Writes the checkpoint of ``global_clock``; returns ``{"seconds", "bytes"}``.

    Args:
      global_clock: the step (every VW's waves ``0..global_clock-1`` are in ``weights``).
      weights: global per-layer params (numpy pytrees).
      opt_states: VW id -> ``(scalars, per_layer)`` for all of the model's layers, in layer order.
      meta: JSON-serialisable metadata.

    Raises:
      OSError: the disk is full or the directory cannot be written (the previous checkpoints are untouched).
    """
    ocp = self._ocp
    tree = {"weights": {f"layer_{i:03d}": p for i, p in enumerate(weights)},
            "opt": {f"vw_{v}": {"scalars": {f"s_{k}": s for k, s in enumerate(scalars)},
                                "layers": {f"layer_{i:03d}": {f"p_{k}": part for k, part in enumerate(parts)}
                                           for i, parts in enumerate(per_layer)}}
                    for v, (scalars, per_layer) in opt_states.items()}}
    t0 = time.perf_counter()
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.WARNING)
    try:
      self._manager.save(global_clock, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                               meta=ocp.args.JsonSave(meta)), force=True)
      self._manager.wait_until_finished()
    finally:
      logging.set_verbosity(verbosity)
    seconds = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in (self.directory / str(global_clock)).rglob("*") if f.is_file())
    return {"seconds": seconds, "bytes": float(size)}

  def restore(self, step: int) -> tuple[list[Any], dict[int, tuple[list, list]], dict[str, Any]]:
    """Reads checkpoint ``step``: ``(weights, opt_states, meta)`` as :meth:`save` took them (numpy leaves)."""
    import jax
    ocp = self._ocp
    got = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                              meta=ocp.args.JsonRestore()))
    state, meta = got["state"], got["meta"]
    as_np = lambda t: jax.tree.map(np.asarray, t)  # noqa: E731
    num_layers = int(meta["num_layers"])
    weights = [as_np(state["weights"].get(f"layer_{i:03d}", {})) for i in range(num_layers)]
    opt_states = {}
    for key, entry in state["opt"].items():
      scalars = [np.asarray(entry.get("scalars", {})[f"s_{k}"]) for k in range(len(entry.get("scalars", {})))]
      layers = entry.get("layers", {})
      per_layer = []
      for i in range(num_layers):
        parts = layers.get(f"layer_{i:03d}", {})
        per_layer.append([as_np(parts.get(f"p_{k}", {})) for k in range(int(meta["opt_parts_per_layer"]))])
      opt_states[int(key.split("_")[1])] = (scalars, per_layer)
    return weights, opt_states, meta

  def restore_latest(self) -> tuple[int, list[Any], dict, dict] | None:
    """The newest checkpoint that reads back, ``(step, weights, opt_states, meta)``; None when there is none.

    A partial or corrupt checkpoint is skipped with a warning naming it, falling back to the previous one.
    """
    for step in reversed(self.steps()):
      try:
        return (step, *self.restore(step))
      except Exception as e:  # pylint: disable=broad-except  # any unreadable step falls back to the previous
        logging.warning("checkpoint %s is unreadable (%s: %s); falling back to the previous one",
                        self.directory / str(step), type(e).__name__, str(e)[:300])
    return None
