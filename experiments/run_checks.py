"""Checks of a finished run's records, written apart from the job's code (oracles for the drills and the load test).

Each reads what a run wrote (``ps_applied.jsonl``, ``minibatches.jsonl``, ``metrics.jsonl``) and restates a rule
of HetPipe in a few lines of its own, so a bug in the runtime's rules cannot hide in its own check.
"""

from __future__ import annotations

import json
import pathlib

from hetpipe_jax.paths import REPO_ROOT


def output_and_data(output_dir: str, data_dir: str) -> tuple[pathlib.Path, str]:
  """A script's output directory (relative paths under the repository root), created, and its Fashion-MNIST-format
  data directory (``data_dir``, or ``""``: a small synthetic set written under the output directory)."""
  out = pathlib.Path(output_dir)
  if not out.is_absolute():
    out = REPO_ROOT / out
  out.mkdir(parents=True, exist_ok=True)
  if not data_dir:
    from hetpipe_jax.data import synthetic  # pylint: disable=g-import-not-at-top  # numpy only, when needed
    data_dir = str(synthetic.write_synthetic_fashion_mnist(out / "data", num_train=512, num_test=256))
  return out, data_dir


def read_jsonl(path: pathlib.Path) -> list[dict]:
  """The JSON lines of ``path`` ([] when it does not exist)."""
  path = pathlib.Path(path)
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def applied_once(applied: list[dict], num_vws: int, num_waves: int) -> dict:
  """Per shard (lines without ``shard``: one PS) and per (VW, wave), how often the PS applied it: the waves of
  ``0..num_waves-1`` missing on some shard, those applied more than once, and any outside that range."""
  counts: dict[tuple[int, int, int], int] = {}
  for a in applied:
    key = (int(a.get("shard", 0)), int(a["vw_id"]), int(a["wave_id"]))
    counts[key] = counts.get(key, 0) + 1
  shards = sorted({k[0] for k in counts}) or [0]
  expected = {(s, v, w) for s in shards for v in range(num_vws) for w in range(num_waves)}
  return {"missing": sorted(expected - set(counts)), "twice": sorted(k for k, c in counts.items() if c > 1),
          "unexpected": sorted(set(counts) - expected)}


def wsp_violations(records: list[dict], staleness_bound: int) -> list[dict]:
  """Minibatches that ran on weights older than WSP allows: a minibatch injected at local clock c (waves its VW had
  completed) needs weights holding every VW's waves below c - D, i.e. global clock >= c - D (HetPipe §5)."""
  return [r for r in records if r["version_global_clock"] < r["local_clock_at_injection"] - staleness_bound]


def max_staleness(records: list[dict]) -> int:
  """The largest ``local clock - global clock of the weights used`` over the records (WSP's bound D is reached when
  this equals D)."""
  return max((r["local_clock_at_injection"] - r["version_global_clock"] for r in records), default=0)


def loss_jump(metrics: list[dict], cut_clock: int) -> dict:
  """The first loss logged after the checkpoint ``cut_clock`` against the largest of the (up to) 3 logged just
  before it: a resume from a consistent cut continues the curve (``ok``: at most twice that, plus 0.05)."""
  before = [m["loss"] for m in metrics if m["global_clock"] <= cut_clock][-3:]
  after = [m["loss"] for m in metrics if m["global_clock"] > cut_clock]
  if not before or not after:
    return {"before": before, "after": after[:1], "ok": False}
  return {"before": before, "after": after[0], "ok": after[0] <= 2.0 * max(before) + 0.05}
