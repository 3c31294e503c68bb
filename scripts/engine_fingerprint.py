"""Fingerprints the event engine's results over random configurations and prints JSON.

  .venv/bin/python scripts/engine_fingerprint.py [--quick] [--per_case]

An optimisation of the engine (``hetpipe_jax/sim/engine.py``) or of the rules it calls (``hetpipe_jax/rules/``)
must leave every result bit-identical: run this before and after and compare the ``fingerprint``. Each case is a
seeded random cluster (1 to 8 VWs of 1 to 5 stages; task times on a coarse grid, so many events tie, or uniform
floats; zero or positive sends, pushes and pulls), Nm, D, wave count, ``ps_apply``, ``pull_every_wave`` and
``ps_link_contention``, plus a few fixed larger ones. Each case runs four ways: records mode with hooks that log
every call (and the VWs' own ``VWSyncState`` objects, as virtual time passes them), records mode without hooks,
timing-only mode with and without hooks. The hash covers each run's results (makespan, steady and plain
rates and window, per-VW and per-GPU reports, final global clock, clock-distance samples, PS waits and application
order, minibatch records, task events, event count; not the config echo nor the host wall time), the hook log and
the final sync states. The script also checks that hooks change no result and that the timing-only report equals
the records-mode report outside the records-only fields.

``--quick`` (CI, seconds): 16 random cases, no fixed large ones. ``--per_case`` adds each case's hash (to find
which case changed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position
from hetpipe_jax import flag_checks  # pylint: disable=wrong-import-position

from hetpipe_jax.rules.records import MinibatchRecord  # pylint: disable=wrong-import-position
from hetpipe_jax.rules import wsp  # pylint: disable=wrong-import-position
from hetpipe_jax.sim import engine  # pylint: disable=wrong-import-position
from hetpipe_jax.costs import task_times  # pylint: disable=wrong-import-position

_QUICK = flags.DEFINE_bool("quick", False, "16 random cases, no large ones (a seconds-long run).")
_PER_CASE = flags.DEFINE_bool("per_case", False, "Also print each case's hash.")
_NUM_CASES = flags.DEFINE_integer("num_cases", 64, "Random cases in the full run.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random cases.")

_RECORDS_ONLY = ("ps_applied", "ps_waits", "minibatch_records", "task_events")


class _LogHooks:
  """Logs every hook call with its arguments (tasks printed, vector clocks as given)."""

  def __init__(self):
    self.log = []

  def on_inject(self, vw_id, minibatch_id, t):
    self.log.append(("inject", vw_id, minibatch_id, t))

  def on_task_start(self, vw_id, task, t):
    self.log.append(("task_start", vw_id, str(task), t))

  def on_minibatch_complete(self, vw_id, minibatch_id, t):
    self.log.append(("complete", vw_id, minibatch_id, t))

  def on_wave_end(self, vw_id, wave_id, t):
    self.log.append(("wave_end", vw_id, wave_id, t))

  def on_push(self, vw_id, wave_id, t):
    self.log.append(("push", vw_id, wave_id, t))

  def on_pull_sent(self, vw_id, vector_clock, t):
    self.log.append(("pull_sent", vw_id, type(vector_clock).__name__, list(vector_clock), t))

  def on_pull_reply(self, vw_id, vector_clock, t):
    self.log.append(("pull_reply", vw_id, type(vector_clock).__name__, list(vector_clock), t))


def _random_case(rng: random.Random, index: int) -> dict:
  """One random case: task times and the engine config's fields."""
  num_vws = rng.choice([1, 1, 2, 2, 3, 3, 4, 5, 6, 8])
  grid = rng.random() < 0.5  # coarse integer grid: many simultaneous events (tie order matters)
  same_stages = rng.random() < 0.7
  num_stages = rng.randint(1, 5)
  times = []
  for _ in range(num_vws):
    s = num_stages if same_stages else rng.randint(1, 5)
    if grid:
      stage_ms = [float(rng.choice([2, 4, 6, 8, 12])) for _ in range(s)]
      send, push, pull = (float(rng.choice([0, 1, 2])) for _ in range(3))
    else:
      stage_ms = [rng.uniform(1.0, 20.0) for _ in range(s)]
      send, push, pull = rng.choice([0.0, rng.uniform(0, 2)]), rng.uniform(0, 10), rng.uniform(0, 10)
    times.append(task_times.uniform_task_times(stage_ms, fwd_fraction=rng.choice([1 / 3, 0.5, 0.25]), send_ms=send,
                                               push_ms=push, pull_ms=pull))
  return {"name": f"random {index}", "times": times, "num_waves": rng.randint(1, 9),
          "num_inflight": rng.randint(1, 5), "staleness_bound": rng.choice([0, 0, 1, 1, 2, 3]),
          "pull_every_wave": rng.random() < 0.5, "ps_apply": rng.choice(wsp.PS_APPLY_MODES),
          "ps_link_contention": rng.random() < 0.3}


def _large_cases() -> list[dict]:
  """A few fixed larger cases (many VWs, long runs)."""
  rng = random.Random(1234)
  out = []
  for i, (num_vws, waves, d) in enumerate([(32, 12, 1), (16, 30, 0), (64, 6, 2), (12, 40, 1)]):
    times = [task_times.uniform_task_times([rng.uniform(50.0, 200.0) for _ in range(4)], send_ms=2.0, push_ms=40.0,
                                           pull_ms=40.0) for _ in range(num_vws)]
    out.append({"name": f"large {i}", "times": times, "num_waves": waves, "num_inflight": 4, "staleness_bound": d,
                "pull_every_wave": i % 2 == 0, "ps_apply": wsp.PS_APPLY_MODES[i % 2],
                "ps_link_contention": i == 3})
  return out


# The report's results (not its config echo nor the host's wall time); a new field is added here on purpose.
_RESULT_FIELDS = ("makespan_s", "total_minibatches_per_s", "total_minibatches_per_s_plain", "steady_window_s", "vws",
                  "gpus", "final_global_clock", "max_clock_distance", "clock_distance_samples", "ps_applied",
                  "ps_waits", "minibatch_records", "task_events", "num_events")


def _report_dict(report: engine.EngineReport) -> dict:
  return {k: _plain(getattr(report, k)) for k in _RESULT_FIELDS}


def _plain(x):
  """Dataclasses (and lists of them) as tuples of their fields, recursively, for a stable ``repr``. A record's
  ``stage_versions`` (PipeDream's per-stage versions, added with the methods) and ``example_ids`` (the data a
  minibatch used, issue 23; the engine runs none) are left out when unset, so the hash of the results did not change
  with these fields."""
  if isinstance(x, MinibatchRecord):
    names = [f.name for f in dataclasses.fields(x)]
    return tuple(v for n, v in zip(names, dataclasses.astuple(x))
                 if not (n in ("stage_versions", "example_ids") and v is None))
  if dataclasses.is_dataclass(x):
    return dataclasses.astuple(x)
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  return x


def _digest(obj) -> str:
  return hashlib.sha256(repr(obj).encode()).hexdigest()


def run_case(case: dict) -> str:
  """Runs one case four ways (module docstring); returns its hash.

  Raises:
    AssertionError: the timing-only report differs from the records-mode one outside the records-only fields.
  """
  kw = {k: case[k] for k in ("num_waves", "num_inflight", "staleness_bound", "pull_every_wave", "ps_apply",
                             "ps_link_contention")}
  parts = []
  for records in (True, False):
    config = engine.EngineConfig(records=records, **kw)
    hooks = _LogHooks()
    syncs = [wsp.VWSyncState(config.num_inflight, config.staleness_bound, config.pull_every_wave)
             for _ in case["times"]]
    with_hooks = _report_dict(engine.run(case["times"], config, hooks=hooks, sync_states=syncs))
    plain = _report_dict(engine.run(case["times"], config))
    assert repr(plain) == repr(with_hooks), f"{case['name']}: hooks change the report (records={records})"
    parts.append((records, with_hooks, hooks.log, [dataclasses.astuple(s) for s in syncs]))
  full, timing = dict(parts[0][1]), dict(parts[1][1])
  for key in _RECORDS_ONLY:
    assert not timing[key], f"{case['name']}: timing-only mode kept {key}"
    full.pop(key)
    timing.pop(key)
  assert repr(full) == repr(timing), f"{case['name']}: timing-only report differs from records mode"
  assert repr(parts[0][2]) == repr(parts[1][2]), f"{case['name']}: the hook log depends on records"
  return _digest(parts)


def main(argv):
  del argv
  if _QUICK.value:
    flag_checks.refuse_replaced("--quick", ["num_cases"])
  rng = random.Random(_SEED.value)
  cases = [_random_case(rng, i) for i in range(16 if _QUICK.value else _NUM_CASES.value)]
  if not _QUICK.value:
    cases += _large_cases()
  hashes = {c["name"]: run_case(c) for c in cases}
  out = {"quick": _QUICK.value, "seed": _SEED.value, "num_cases": len(cases),
         "fingerprint": _digest(sorted(hashes.items()))}
  if _PER_CASE.value:
    out["cases"] = hashes
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  app.run(main)
