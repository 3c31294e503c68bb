"""Saving and restoring the final global weights with orbax (one per-layer params pytree)."""

from __future__ import annotations

import pathlib
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
