"""Shared timing helper for the benchmark scripts."""

import statistics
import time


def timed(fn, repeats):
  """Runs ``fn`` ``repeats`` times; returns (median seconds, last result)."""
  times, out = [], None
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out
