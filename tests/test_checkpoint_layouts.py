"""Checkpoints and ``--resume`` with stage ranks and several PS shards, under mpiexec: the checkpoint cut holds every
shard's slice and log and every stage rank's optimizer state, and a resume continues the uninterrupted run, onto
the same layout or another one.

The oracle is a plain run written apart from the cut: one process per VW, one PS, no checkpoints. With Nm = 1,
D = 0, momentum SGD and the clock-aligned PS every addition happens in one fixed order, so a run cut into segments
(stage ranks, two shards) and the runs resumed from its middle checkpoint must end with the plain run's weights
bit for bit. Momentum has a state per layer on the rank that runs it: a stage rank whose state was not saved, or
not restored, ends elsewhere.
"""

import json
import shutil

import jax
import numpy as np
import pytest

from hetpipe_jax.jobs import checkpoint
from tests.mpi_util import read_jsonl, run_job

pytestmark = pytest.mark.mpi

SETTINGS = {"num_virtual_workers": 2, "num_minibatches": 24, "num_inflight": 1, "staleness_bound": 0,
            "optimizer": "momentum", "learning_rate": 0.05, "batch_size": 16, "emulate_stage_ms": "20,20",
            "ps_apply": "clock_aligned", "eval_every_epochs": 0}
SPLIT = {"stage_ranks": True, "num_ps_shards": 2, "checkpoint_every_waves": 6, "checkpoint_max_to_keep": 5}
SPLIT_RANKS = 6  # 2 shards + 2 drivers + 2 stage ranks (2 stages per VW, one rank each)
EVERY_WAVE = [(w, v) for w in range(24) for v in range(2)]  # clock-aligned: wave by wave, VW by VW


def _weights(workdir):
  return jax.tree.leaves(checkpoint.restore_weights(workdir / "checkpoint"))


def _applied_per_shard(workdir) -> dict[int, list[tuple[int, int]]]:
  out: dict[int, list[tuple[int, int]]] = {}
  for a in read_jsonl(workdir / "ps_applied.jsonl"):
    out.setdefault(a.get("shard", 0), []).append((a["wave_id"], a["vw_id"]))
  return out


def _resume_from(source, workdir, step: int) -> None:
  """A workdir that holds only ``source``'s checkpoint ``step`` (a run that died after it)."""
  (workdir / "checkpoints").mkdir(parents=True)
  shutil.copytree(source / "checkpoints" / str(step), workdir / "checkpoints" / str(step))


def test_stage_ranks_and_shards_checkpoint_and_resume_onto_any_layout(tmp_path, synthetic_data_dir):
  base = {"data_dir": synthetic_data_dir, **SETTINGS}
  plain = run_job(tmp_path / "plain", 3, {**base, "checkpoint_every_waves": 0})
  assert plain.returncode == 0, plain.stderr[-3000:]
  reference = _weights(tmp_path / "plain")

  split = run_job(tmp_path / "split", SPLIT_RANKS, {**base, **SPLIT})
  assert split.returncode == 0, split.stderr[-3000:]
  steps = sorted(int(p.name) for p in (tmp_path / "split" / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [6, 12, 18, 24]
  summary = json.loads((tmp_path / "split" / "summary.json").read_text())
  assert [c["global_clock"] for c in summary["checkpoints"]] == [6, 12, 18, 24]
  assert _applied_per_shard(tmp_path / "split") == {0: EVERY_WAVE, 1: EVERY_WAVE}
  meta = json.loads((tmp_path / "split" / "checkpoints" / "12" / "meta" / "metadata").read_text())
  assert meta["num_ps_shards"] == 2 and meta["shard_applied"] == [[list(a) for a in EVERY_WAVE[:24]]]
  for x, y in zip(reference, _weights(tmp_path / "split")):
    np.testing.assert_array_equal(x, y)  # segments, stage ranks and shards change no addition

  # The run died after checkpoint 12: resume onto the same layout, and onto one process per VW with one PS.
  for name, ranks, layout in (("same", SPLIT_RANKS, SPLIT), ("one_ps", 3, {"checkpoint_every_waves": 6})):
    workdir = tmp_path / name
    _resume_from(tmp_path / "split", workdir, 12)
    resumed = run_job(workdir, ranks, {**base, **layout}, extra_args=("--resume",))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert [r["global_clock"] for r in summary["resumes"]] == [12]
    shards = _applied_per_shard(workdir)
    assert shards == ({0: EVERY_WAVE, 1: EVERY_WAVE} if name == "same" else {0: EVERY_WAVE}), name
    records = read_jsonl(workdir / "minibatches.jsonl")
    assert sorted((r["vw_id"], r["minibatch_id"]) for r in records) == [(v, p) for v in range(2) for p in range(24)]
    for r in records:  # D = 0 across the resume
      assert r["version_global_clock"] >= r["local_clock_at_injection"], r
    for x, y in zip(reference, _weights(workdir)):
      np.testing.assert_array_equal(x, y, err_msg=name)
    if name == "one_ps":  # the change of layout is said
      notes = summary["resumes"][0]["notes"]
      assert any("num_ps_shards 2 -> 1" in n for n in notes) and any("stage_groups" in n for n in notes), notes
