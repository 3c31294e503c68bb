"""The per-minibatch record shared by the runtime, virtual time and the engine (``minibatches.jsonl`` rows).

Planning layer: plain data, so one checker (the WSP bounds, the sequential replay) serves every mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from hetpipe_jax.rules import wsp


@dataclasses.dataclass
class MinibatchRecord:
  """What happened to one minibatch of one VW (HetPipe §4–§5).

  Attributes:
    vw_id, minibatch_id, wave_id: which minibatch (0-based; ``wave_id = minibatch_id // Nm``).
    local_clock_at_injection: the VW's local clock (completed waves) when the minibatch was injected.
    version_id: the VW's weight version (increments at every minibatch completion and every installed pull).
    version_local_updates: own minibatch updates in that version (minibatches ``0..n-1``).
    version_global_clock: global clock of the last pulled weights in that version (every VW's waves ``0..g-1``).
    version_vector_clock: per VW, how many of its waves the last pulled weights in that version hold (its minimum
      is ``version_global_clock``; entries above it are extra updates, HetPipe §5–§6, under ``on_receipt``).
    inject_time_s, complete_time_s: seconds since the VW's start (wall time, or simulated time).
    loss: the minibatch's training loss (NaN in the timing-only engine).
    stage_versions: PipeDream (per-stage updates): per stage, how many of the stage's own minibatch updates the
      weights its forward used (and stashed for its backward) included; None for the other methods, where every
      stage uses ``version_local_updates``.
    example_ids: the examples the minibatch (flush methods: micro-batch) trained on, in the order fed: indices into
      the training split of ``config.dataset`` (its inputs and targets at these rows); None where no data ran (the
      timing-only engine). With ``config.json``'s initial weights' hash and rule they make a run replayable without
      this code (docs/usage.md, "The main job").
  """

  vw_id: int
  minibatch_id: int
  wave_id: int
  local_clock_at_injection: int
  version_id: int
  version_local_updates: int
  version_global_clock: int
  version_vector_clock: tuple[int, ...]
  inject_time_s: float
  complete_time_s: float = float("nan")
  loss: float = float("nan")
  stage_versions: list[int] | None = None
  example_ids: list[int] | None = None


@dataclasses.dataclass
class ShardedMinibatchRecord(MinibatchRecord):
  """A :class:`MinibatchRecord` of a run with sharded parameter servers (HetPipe §8.1).

  Attributes:
    version_shard_vector_clocks: per PS shard, the vector clock of the slice that shard sent in the version's last
      pull (shards apply waves on receipt, so each may hold different extra waves); ``version_vector_clock`` is
      their element-wise minimum (what every layer holds).
  """

  version_shard_vector_clocks: tuple[tuple[int, ...], ...] = ()


def extra_update_stats(records: Iterable[Mapping[str, Any]]) -> dict[str, float | int]:
  """How often minibatches used weights with extra updates, and how many (HetPipe §5–§6, ``ps_apply="on_receipt"``).

  A minibatch's extra updates are the waves of *other* VWs its pulled weights hold beyond their global clock g:
  ``sum_{u != v} (vc[u] - g)`` (:func:`hetpipe_jax.rules.wsp.extra_updates`).

  Args:
    records: dicts (or :class:`MinibatchRecord`) with ``vw_id`` and ``version_vector_clock``.

  Returns:
    ``minibatches_with_extra_updates`` (count), ``fraction_with_extra_updates``, ``mean_extra_updates`` (waves per
    minibatch, over all minibatches) and ``max_extra_updates``; zeros for no records.
  """
  counts = []
  for r in records:
    r = r if isinstance(r, Mapping) else dataclasses.asdict(r)
    counts.append(wsp.extra_updates(r["version_vector_clock"], r["vw_id"]))
  n = len(counts)
  with_extra = sum(1 for c in counts if c > 0)
  return {"minibatches_with_extra_updates": with_extra,
          "fraction_with_extra_updates": with_extra / n if n else 0.0,
          "mean_extra_updates": sum(counts) / n if n else 0.0,
          "max_extra_updates": max(counts, default=0)}
