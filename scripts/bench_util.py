"""Shared helpers for the benchmark scripts: timing, percentiles, and how busy the machine was."""

import os
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


def percentiles_us(seconds, points=(50, 90, 99)) -> dict | None:
  """``{"p50": µs, ..., "mean": µs, "n": count}`` of a list of durations in seconds (nearest rank); None if empty."""
  xs = sorted(seconds)
  n = len(xs)
  if not n:
    return None
  out = {f"p{p}": round(1e6 * xs[min(n - 1, p * n // 100)], 1) for p in points}
  out["mean"] = round(1e6 * sum(xs) / n, 1)
  out["n"] = n
  return out


def _cpu_jiffies() -> tuple[int, int] | None:
  """(busy, total) jiffies of the whole machine from /proc/stat; None where there is none (not Linux)."""
  try:
    with open("/proc/stat") as f:
      fields = [int(x) for x in f.readline().split()[1:]]
  except (OSError, ValueError):
    return None
  idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
  return sum(fields) - idle, sum(fields)


class MachineLoad:
  """How busy the machine was while a benchmark ran, including other processes (shared machines add noise).

  ``stop()`` returns the CPU count, the 1-minute load average at start and stop, and the cores busy on average over
  the interval in all processes and in the others (the machine's busy time minus this process's CPU time).
  """

  def __init__(self):
    self._wall = time.perf_counter()
    self._cpu = time.process_time()
    self._jiffies = _cpu_jiffies()
    self._load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

  def stop(self) -> dict:
    wall = time.perf_counter() - self._wall
    own = (time.process_time() - self._cpu) / wall
    out = {"cpus": os.cpu_count(), "load_avg_1min_start": self._load,
           "load_avg_1min_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
           "wall_s": round(wall, 2), "busy_cores_this_process": round(own, 2)}
    end = _cpu_jiffies()
    if self._jiffies is not None and end is not None and end[1] > self._jiffies[1]:
      busy = (end[0] - self._jiffies[0]) / (end[1] - self._jiffies[1]) * (os.cpu_count() or 1)
      out["busy_cores_all_processes"] = round(busy, 2)
      out["busy_cores_other_processes"] = round(max(0.0, busy - own), 2)
    return out
