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
from hetpipe_jax.jobs import opt_checkpoint
from hetpipe_jax.jobs.resume import resumed_shard_logs
from tests.mpi_util import read_jsonl, run_job

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


@pytest.mark.mpi
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


# ---------------------------------------------------------------------------------------------- the pieces, by hand
def _state(scalar: float, layers: list[list[float]]):
  """An optimizer state by layer as a VW rank sends it: one scalar leaf, each layer's one part ``{"m": array}``."""
  return [np.array(scalar, np.float32)], [[{"m": np.array(v, np.float32)}] for v in layers]


def test_the_checkpoint_merges_each_vw_from_its_driver_and_stage_ranks_by_layer():
  # VW 0: driver rank 2 runs layers 0-1, stage rank 4 runs layers 2-3; VW 1: driver rank 3 runs all four.
  zeros = lambda n: _state(0.0, [[0.0, 0.0]] * n)  # noqa: E731  (templates: the shapes only)
  templates = {2: (0, [0, 1], zeros(2)), 4: (0, [2, 3], zeros(2)), 3: (1, [0, 1, 2, 3], zeros(4))}
  sent = {2: _state(7.0, [[1, 1], [2, 2]]), 4: _state(9.0, [[3, 3], [4, 4]]),
          3: _state(5.0, [[5, 5], [6, 6], [7, 7], [8, 8]])}
  merged = opt_checkpoint.merge_states(templates, {r: opt_checkpoint.state_bytes(*st) for r, st in sent.items()}, 2)
  (s0,), layers0 = merged[0]
  assert float(s0) == 7.0  # the driver's scalars (stage 0's), not the stage rank's 9
  assert [p[0]["m"].tolist() for p in layers0] == [[1, 1], [2, 2], [3, 3], [4, 4]]
  assert [p[0]["m"].tolist() for p in merged[1][1]] == [[5, 5], [6, 6], [7, 7], [8, 8]]
  # A stage rank without parameters sends nothing: its layers keep the template's parts.
  del sent[4]
  kept = opt_checkpoint.merge_states(templates, {r: opt_checkpoint.state_bytes(*st) for r, st in sent.items()}, 2)
  assert [p[0]["m"].tolist() for p in kept[0][1]] == [[1, 1], [2, 2], [0, 0], [0, 0]]
  with pytest.raises(ValueError, match=r"VW 1's driver \(rank 3\) sent no optimizer state"):
    opt_checkpoint.merge_states(templates, {2: opt_checkpoint.state_bytes(*sent[2])}, 2)
  with pytest.raises(ValueError, match="optimizer state of 8 bytes, expected 20"):
    opt_checkpoint.merge_states(templates, {2: np.zeros(8, np.uint8), 3: opt_checkpoint.state_bytes(*sent[3])}, 2)


def test_a_resume_continues_each_shards_log_or_the_leads_under_another_layout():
  lead = [(0, 0), (0, 1), (1, 1), (1, 0)]
  own = [[(0, 1), (0, 0), (1, 0), (1, 1)]]  # shard 1 applied in its own order
  meta = {"num_ps_shards": 2, "shard_applied": own}
  assert resumed_shard_logs(meta, 2, lead) == own  # the same layout: each shard its own log
  assert resumed_shard_logs(meta, 3, lead) == [lead, lead]  # another: every new shard continues the lead's
  assert resumed_shard_logs(meta, 1, lead) == []
  assert resumed_shard_logs({}, 2, []) == [[]]  # a fresh run
