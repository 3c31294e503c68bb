"""Partition rules: a partition is contiguous half-open layer ranges covering every layer once (HetPipe §4).

Planning layer: pure Python. The one implementation used by the plan reader
(:mod:`hetpipe_jax.planning.plan_format`), the job settings (:mod:`hetpipe_jax.jobs.job_config`) and the stage
builder (:mod:`hetpipe_jax.runtime.stages`).
"""

from __future__ import annotations

from typing import Sequence

Partition = tuple[tuple[int, int], ...]


def validate_partition(partition: Sequence[Sequence[int]], num_layers: int) -> Partition:
  """Checks that ``partition`` is contiguous half-open ranges covering ``0..num_layers`` exactly once.

  Args:
    partition: one ``[start, end)`` layer range per stage, stage 0 first.
    num_layers: the model's layer count.

  Returns:
    The partition as a tuple of ``(start, end)`` int pairs.

  Raises:
    ValueError: naming the bad range, a gap or an overlap, an empty range, or the wrong end.
  """
  try:
    ranges = tuple(tuple(int(v) for v in r) for r in partition)
  except (TypeError, ValueError):
    raise ValueError(f"partition {partition!r} must be a list of [start, end) integer pairs") from None
  if not ranges:
    raise ValueError("partition is empty: give one [start, end) layer range per stage")
  expected = 0
  for i, r in enumerate(ranges):
    if len(r) != 2:
      raise ValueError(f"partition range {i} is {list(r)}: each range must be [start, end)")
    start, end = r
    if start != expected:
      what = "overlaps the previous range" if start < expected else f"leaves layers {expected}..{start - 1} uncovered"
      raise ValueError(f"partition {format_partition(ranges)} does not cover every layer exactly once: range {i} "
                       f"[{start}, {end}) {what}")
    if end <= start:
      raise ValueError(f"partition range {i} [{start}, {end}) is empty: every stage needs at least one layer")
    expected = end
  if expected != num_layers:
    raise ValueError(f"partition {format_partition(ranges)} does not cover every layer exactly once: the model has "
                     f"{num_layers} layers but the ranges end at {expected}")
  return ranges  # type: ignore[return-value]


def even_partition(num_layers: int, num_stages: int) -> Partition:
  """Splits ``num_layers`` into ``num_stages`` contiguous ranges whose sizes differ by at most one.

  Raises:
    ValueError: fewer than one stage, or more stages than layers.
  """
  if num_stages < 1:
    raise ValueError(f"num_stages={num_stages} must be >= 1")
  if num_stages > num_layers:
    raise ValueError(f"num_stages={num_stages} exceeds the model's {num_layers} layers")
  base, extra = divmod(num_layers, num_stages)
  ranges, start = [], 0
  for s in range(num_stages):
    end = start + base + (1 if s < extra else 0)
    ranges.append((start, end))
    start = end
  return tuple(ranges)


def format_partition(partition: Sequence[Sequence[int]]) -> str:
  """``((0, 3), (3, 7))`` → ``"0:3,3:7"`` (the ``config.partition`` syntax)."""
  return ",".join(f"{r[0]}:{r[1]}" for r in partition)


def parse_partition(text: str) -> Partition:
  """``"0:3,3:7"`` → ``((0, 3), (3, 7))`` (ranges are checked by :func:`validate_partition`, not here).

  Raises:
    ValueError: the text is not comma-separated ``start:end`` integer pairs.
  """
  ranges = []
  for part in text.split(","):
    try:
      start, end = (int(v) for v in part.split(":"))
    except ValueError:
      raise ValueError(f"{text!r} is malformed: write one 'start:end' layer range per stage, comma-separated, "
                       "e.g. '0:3,3:7'") from None
    ranges.append((start, end))
  return tuple(ranges)
