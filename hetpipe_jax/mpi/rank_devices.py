"""Which GPUs each MPI rank may see: the launcher's per-rank device table, applied by every rank before JAX starts.

Pure (stdlib only). ``python -m hetpipe_jax.launch`` puts the plan's table (per rank, its node-local GPU indices:
a VW rank's stages' GPUs, none for a PS shard) into the environment variable ``HETPIPE_RANK_DEVICES`` (``;`` between
ranks, ``,`` between GPUs, ``-`` for none; e.g. ``-;-;0;0;1;1``) that ``mpiexec -genv`` (or ``srun``'s exported
environment) hands every rank, and writes the same table to ``<workdir>/ranks.devices``. ``hetpipe_jax.train`` calls
:func:`apply` before it imports jax: with ``config.platform="gpu"`` a rank sets ``CUDA_VISIBLE_DEVICES`` to its GPUs
(a shard: none, and ``JAX_PLATFORMS=cpu``: the PS computes on the host), so a stage's plan GPU ``d`` is the rank's
local device ``gpus.index(d)``; on CPU nothing is changed (every rank keeps its forced host devices) and the table is
still recorded (config.json ``rank_visible_devices``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import MutableMapping, Sequence

ENV = "HETPIPE_RANK_DEVICES"


class RankDevicesError(ValueError):
  """A malformed table or one that does not fit the job (the message names ``HETPIPE_RANK_DEVICES``)."""


def format_table(devices_per_rank: Sequence[Sequence[int]]) -> str:
  """The table's text: per rank its GPU ids joined by ``,`` (``-``: none), ranks joined by ``;``."""
  return ";".join(",".join(str(int(d)) for d in ids) or "-" for ids in devices_per_rank)


def parse_table(text: str) -> list[tuple[int, ...]]:
  """Per rank, its GPU ids.

  Raises:
    RankDevicesError: an entry that is not ``-`` or non-negative integers joined by ``,``.
  """
  out = []
  for i, entry in enumerate(text.strip().split(";")):
    entry = entry.strip()
    if entry == "-":
      out.append(())
      continue
    try:
      ids = tuple(int(x) for x in entry.split(","))
    except ValueError:
      raise RankDevicesError(f"{ENV}={text!r}: rank {i}'s entry {entry!r} is not '-' or GPU ids like 0,1") from None
    if any(d < 0 for d in ids) or len(set(ids)) != len(ids):
      raise RankDevicesError(f"{ENV}={text!r}: rank {i}'s GPU ids {list(ids)} must be distinct and >= 0")
    out.append(ids)
  return out


@dataclasses.dataclass(frozen=True)
class RankDevices:
  """What :func:`apply` did on one rank.

  Attributes:
    table: per rank, its GPU ids (the whole job's table, for config.json).
    gpus: this rank's GPU ids (plan node-local indices).
    applied: ``"CUDA_VISIBLE_DEVICES"`` (GPU) or ``"none (cpu)"``.
  """

  table: tuple[tuple[int, ...], ...]
  gpus: tuple[int, ...]
  applied: str

  def local_index(self, gpu: int) -> int:
    """The rank's local device index of plan GPU ``gpu`` (GPU: its place among the visible ones; CPU: itself).

    Raises:
      RankDevicesError: ``gpu`` is not one of this rank's GPUs.
    """
    if self.applied != "CUDA_VISIBLE_DEVICES":
      return gpu
    if gpu not in self.gpus:
      raise RankDevicesError(f"{ENV}: GPU {gpu} is not among this rank's GPUs {list(self.gpus)}")
    return self.gpus.index(gpu)


def apply(rank: int, world_size: int, platform: str,
          environ: MutableMapping[str, str] = os.environ) -> RankDevices | None:
  """Restricts this process to its GPUs (before jax initialises a backend); None when ``HETPIPE_RANK_DEVICES`` is
  unset (no restriction: the process sees every device of its host).

  Args:
    rank: this process's MPI rank.
    world_size: the job's ranks (the table must have one entry each).
    platform: ``config.platform`` (``"cpu"``: nothing is changed, ``"gpu"``: ``CUDA_VISIBLE_DEVICES``).
    environ: the environment to read and set.

  Raises:
    RankDevicesError: a malformed table, or one whose length is not the world size.
  """
  text = environ.get(ENV)
  if text is None:
    return None
  table = parse_table(text)
  if len(table) != world_size:
    raise RankDevicesError(f"{ENV}={text!r} has {len(table)} ranks' entries; the job has {world_size} ranks "
                           "(launch it with python -m hetpipe_jax.launch, or unset it)")
  gpus = table[rank]
  applied = "none (cpu)"
  if platform == "gpu":
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in gpus)
    if not gpus:
      environ["JAX_PLATFORMS"] = "cpu"
    applied = "CUDA_VISIBLE_DEVICES"
  return RankDevices(tuple(table), gpus, applied)


def check_covers(table: Sequence[Sequence[int]], needed: Sequence[Sequence[int]]) -> None:
  """Checks that every rank's entry holds the GPUs its stages use (the same check on every rank: the table is the
  job's).

  Args:
    table: per rank, its GPU ids (:func:`parse_table`).
    needed: per rank, the plan GPUs of the stages it runs (none for a PS shard).

  Raises:
    RankDevicesError: a rank whose stages use a GPU its entry lacks.
  """
  for rank, (have, want) in enumerate(zip(table, needed)):
    missing = [d for d in want if d not in have]
    if missing:
      raise RankDevicesError(f"{ENV}: rank {rank} runs stages on GPUs {list(want)} but may see only "
                             f"{list(have) or 'none'} (its entry lacks {missing})")
