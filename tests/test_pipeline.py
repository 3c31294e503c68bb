"""The VW pipeline against oracles: plain sequential training (Nm = 1) and a replay of recorded versions (Nm > 1)."""

import gc

import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.runtime import virtual_worker
from tests.pipeline_util import assert_params_close, build_vw, sequential_replay

TWO_STAGES = [(0, 2), (2, 4)]
THREE_STAGES = [(0, 1), (1, 3), (3, 4)]


@pytest.mark.parametrize("partition", [TWO_STAGES, THREE_STAGES])
@pytest.mark.parametrize("pull_every_wave", [True, False])
def test_oracle1_nm1_equals_single_device_training(synthetic_data_dir, partition, pull_every_wave):
  vw, source, params0, tx, _ = build_vw(synthetic_data_dir, partition=partition, num_inflight=1,
                                        pull_every_wave=pull_every_wave)
  vw.run(20)
  batches = [source.get(p) for p in range(20)]
  expected = sequential_replay(models.get_model("mlp_tiny"), params0, tx, batches, versions=list(range(20)))
  assert_params_close(vw.layer_params(), expected)


@pytest.mark.parametrize("num_inflight,partition", [(2, TWO_STAGES), (3, THREE_STAGES), (4, THREE_STAGES)])
def test_oracle2_replay_of_recorded_versions(synthetic_data_dir, num_inflight, partition):
  n = 24
  vw, source, params0, tx, _ = build_vw(synthetic_data_dir, partition=partition, num_inflight=num_inflight,
                                        optimizer=optax.sgd(0.05, momentum=0.9))
  vw.run(n)
  versions = [r.version_local_updates for r in vw.records]
  assert [r.minibatch_id for r in vw.records] == list(range(n))
  for r in vw.records:  # local staleness bound: minibatch p sees at least updates 0..p-Nm
    assert r.version_local_updates >= r.minibatch_id - num_inflight + 1
    assert r.version_local_updates <= r.minibatch_id
  # Pipelining really happened: some minibatch ran on weights missing recent updates.
  assert any(v < p for p, v in enumerate(versions))
  batches = [source.get(p) for p in range(n)]
  expected = sequential_replay(models.get_model("mlp_tiny"), params0, tx, batches, versions)
  assert_params_close(vw.layer_params(), expected)


def test_each_stage_function_compiles_once(synthetic_data_dir):
  vw, *_ = build_vw(synthetic_data_dir, model="cnn_small", partition=[(0, 2), (2, 5), (5, 7)], num_inflight=3)
  vw.run(12)
  for st in vw.stages:
    kinds = {"forward_backward", "update", "add"} if st.is_last else {"forward", "backward", "update", "add"}
    assert set(st.trace_counts) == kinds, st.trace_counts
    assert all(c == 1 for c in st.trace_counts.values()), (st.stage_id, st.trace_counts)


def test_stages_overlap_and_versions_are_freed(synthetic_data_dir):
  vw, *_ = build_vw(synthetic_data_dir, model="cnn_small", partition=[(0, 3), (3, 7)], num_inflight=4)
  stats = vw.run(16)
  assert stats.max_concurrent_tasks >= 2  # tasks of different stages were outstanding together
  # Some task of stage 1 was dispatched before some task of stage 0 was observed done.
  spans = {}
  for task, start, end in vw.task_log:
    spans.setdefault(task[0], []).append((start, end))
  assert any(s1 < e0 and s0 < e1 for s0, e0 in spans["0"] for s1, e1 in spans["1"])
  assert stats.peak_inflight_per_stage[0] == 4 and stats.peak_inflight_per_stage[-1] == 1
  gc.collect()
  alive = [o for o in gc.get_objects() if isinstance(o, virtual_worker.WeightVersion)]
  assert alive == [vw.version]  # only the current version survives once no minibatch is in flight


def test_bad_arguments_raise(synthetic_data_dir):
  with pytest.raises(ValueError, match="num_inflight"):
    build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=0)
  with pytest.raises(ValueError, match="staleness_bound"):
    build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=1, staleness_bound=-1)
  vw, *_ = build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=2)
  with pytest.raises(ValueError, match="multiple of num_inflight"):
    vw.run(3)


def test_emulated_devices_never_finish_early(synthetic_data_dir):
  target = {0: 0.004, 1: 0.012}  # seconds per task on stage 0 / stage 1 (a 3x slower GPU)
  vw, *_ = build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=2)
  vw.task_time_s = lambda task: target[task.stage_id]
  stats = vw.run(8)
  assert stats.num_tasks == 8 * 3
  emulated_end = {0: 0.0, 1: 0.0}  # each stage is an in-order emulated device
  for task, dispatched, done in sorted(vw.task_log, key=lambda t: t[1]):
    stage = int(task[0])
    emulated_end[stage] = max(dispatched, emulated_end[stage]) + target[stage]
    assert done >= emulated_end[stage] - 1e-9, (task, emulated_end[stage], done)


def test_measured_peak_inflight_obeys_cost_model_bound(synthetic_data_dir):
  from hetpipe_jax.planning import cost_model
  target = {0: 0.002, 1: 0.002, 2: 0.012}  # a slow last stage makes the earlier stages hold the most
  vw, *_ = build_vw(synthetic_data_dir, partition=THREE_STAGES, num_inflight=4)
  vw.task_time_s = lambda task: target[task.stage_id]
  stats = vw.run(16)
  bound = cost_model.max_inflight_per_stage(3, 4)
  assert all(peak <= b for peak, b in zip(stats.peak_inflight_per_stage, bound)), (stats.peak_inflight_per_stage, bound)
  assert stats.peak_inflight_per_stage[0] == bound[0] == 4
  assert stats.peak_inflight_per_stage[-1] == bound[-1] == 1
