"""The VW pipeline against oracles: plain sequential training (Nm = 1) and a replay of recorded versions (Nm > 1)."""

import dataclasses
import gc

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.costs import task_times
from hetpipe_jax.runtime import virtual_worker
from tests import replay
from tests.pipeline_util import LaggingPeerClient, assert_params_close, build_vw, sequential_replay

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


def _assert_replay_of_recorded_versions(data_dir, *, model="mlp_tiny", partition, num_inflight, num_minibatches,
                                        batch_size=16, rtol=1e-5, atol=1e-6):
  """Runs one VW (D = 0, SGD with momentum) and checks its final weights against the sequential replay."""
  n = num_minibatches
  vw, source, params0, tx, _ = build_vw(data_dir, model=model, partition=partition, num_inflight=num_inflight,
                                        optimizer=optax.sgd(0.05, momentum=0.9), batch_size=batch_size)
  vw.run(n)
  versions = [r.version_local_updates for r in vw.records]
  assert [r.minibatch_id for r in vw.records] == list(range(n))
  for r in vw.records:  # local staleness bound: minibatch p sees at least updates 0..p-Nm
    assert r.version_local_updates >= r.minibatch_id - num_inflight + 1
    assert r.version_local_updates <= r.minibatch_id
  # Pipelining really happened: some minibatch ran on weights missing recent updates.
  assert any(v < p for p, v in enumerate(versions))
  batches = [source.get(p) for p in range(n)]
  expected = sequential_replay(models.get_model(model), params0, tx, batches, versions)
  # The run moved the weights (so the comparison below is not W0 against W0).
  assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(params0))) > 1e-3
  assert_params_close(vw.layer_params(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("num_inflight,partition", [(2, TWO_STAGES), (3, THREE_STAGES), (4, THREE_STAGES)])
def test_oracle2_replay_of_recorded_versions(synthetic_data_dir, num_inflight, partition):
  _assert_replay_of_recorded_versions(synthetic_data_dir, partition=partition, num_inflight=num_inflight,
                                      num_minibatches=24)


def test_oracle2_replay_cnn_small_cut_between_convs(synthetic_data_dir):
  # cnn_small: 0 conv16, 1 pool, 2 conv32, 3 pool, 4 flatten, 5 dense128, 6 dense10. Stage 0 = conv16 alone (its
  # input gradient is not needed), stage 1 = pool + conv32 (gradients cross both cuts), stage 2 = the rest.
  _assert_replay_of_recorded_versions(synthetic_data_dir, model="cnn_small", partition=[(0, 1), (1, 3), (3, 7)],
                                      num_inflight=3, num_minibatches=9, batch_size=8)


def test_oracle2_replay_resnet_cut_after_groupnorm(synthetic_data_dir):
  # resnet: 0 stem (conv + GroupNorm + relu), 1..6 residual blocks (conv + GroupNorm), 7 global pool, 8 dense. The
  # cuts pass GroupNorm outputs (stem, then block 1) between stages.
  _assert_replay_of_recorded_versions(synthetic_data_dir, model="resnet", partition=[(0, 1), (1, 2), (2, 9)],
                                      num_inflight=2, num_minibatches=6, batch_size=4)


@pytest.mark.parametrize("ps_apply", ["clock_aligned", "on_receipt"])
@pytest.mark.parametrize("staleness_bound,pull_every_wave", [(1, True), (1, False), (2, True)])
def test_pull_while_own_waves_are_unapplied_keeps_them(synthetic_data_dir, staleness_bound, pull_every_wave,
                                                       ps_apply):
  """VW 0 (D >= 1) beside a scripted VW 1 that pushes wave c - D when VW 0 pushes wave c. clock_aligned: every pull
  VW 0 installs lacks its own last pushed waves, which it must re-add (HetPipe §5). on_receipt: the PS applied them
  on receipt, so the pulled weights hold VW 0's waves beyond the global clock, and VW 0 must not add them twice.
  Its final local weights and the final global weights must equal the sequential replay of its records (with their
  vector clocks and the PS's log) on top of VW 1's given waves."""
  nm, num_waves = 2, 5
  n = nm * num_waves
  lag = staleness_bound

  def client_factory(server, vw_id):
    rng = np.random.default_rng(7)
    peer = [(0.01 * rng.standard_normal(server.weights.size)).astype(np.float32) for _ in range(num_waves)]
    return LaggingPeerClient(server, vw_id, peer_waves=peer, lag=lag)

  vw, source, params0, tx, server = build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=nm,
                                             staleness_bound=staleness_bound, optimizer=optax.sgd(0.05, momentum=0.9),
                                             pull_every_wave=pull_every_wave, num_vws=2, client_factory=client_factory,
                                             ps_apply=ps_apply)
  vw.run(n)
  client = vw.ps
  if ps_apply == "clock_aligned":
    # The case under test happened: pulls installed while VW 0 had pushed waves the PS had not applied.
    assert any(pushed > vc[0] for vc, pushed in client.pulls), client.pulls
  else:
    # Every pulled copy holds all of VW 0's pushed waves, some beyond the global clock.
    assert all(pushed == vc[0] for vc, pushed in client.pulls), client.pulls
    assert any(vc[0] > min(vc) for vc, _ in client.pulls), client.pulls
  assert any(r.version_global_clock >= 1 for r in vw.records)
  records = [dataclasses.asdict(r) for r in vw.records]
  result = replay.replay(records, models.get_model("mlp_tiny"), params0, tx, [source], nm,
                         fixed_waves=[client.peer_waves], applied_order=server.state.applied)
  layout = vw.layout
  final_local = result.local_weights(0, vw.version.vector_clock, vw.version.local_updates)
  np.testing.assert_allclose(layout.flatten(vw.layer_params()), final_local, rtol=1e-5, atol=1e-6)
  client.finish()
  assert server.global_clock == num_waves
  np.testing.assert_allclose(server.weights, result.final_global_weights(server.state.applied), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("ps_apply", ["clock_aligned", "on_receipt"])
def test_pull_installed_mid_wave_keeps_own_and_partial_waves(synthetic_data_dir, ps_apply):
  """As above (D = 2, VW 1 one wave behind), with every pull reply held back until VW 0 is inside a wave: the
  installed weights must also keep the current partial wave's updates (minibatches completed, not yet pushed)."""
  nm, num_waves = 3, 5
  n = nm * num_waves
  vw_box = []

  def client_factory(server, vw_id):
    rng = np.random.default_rng(8)
    peer = [(0.01 * rng.standard_normal(server.weights.size)).astype(np.float32) for _ in range(num_waves)]
    return LaggingPeerClient(server, vw_id, peer_waves=peer, lag=1,
                             hold_reply=lambda: vw_box[0].version.local_updates % nm == 0)

  vw, source, params0, tx, server = build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=nm,
                                             staleness_bound=2, optimizer=optax.sgd(0.05, momentum=0.9),
                                             num_vws=2, client_factory=client_factory, ps_apply=ps_apply)
  vw_box.append(vw)
  # Emulated 20 ms forwards/backwards and 40 ms last-stage tasks: a wave's completions arrive one by one, tens of ms
  # apart, so a poll falls inside a wave (without it a loaded machine can hand the scheduler a whole wave's
  # completions in one batch, and every poll then sees a wave boundary).
  vw.task_time_s = task_times.uniform_task_times([40.0, 40.0], fwd_fraction=0.5).task_duration_s
  installs = []  # (pulled clock, own pushed waves, own minibatches completed in the current wave) at each install
  install = vw.install_pull

  def logged_install(vector_clock, flat):
    installs.append((vector_clock, len(vw.update.own_waves) and max(vw.update.own_waves) + 1, vw.version.local_updates % nm))
    install(vector_clock, flat)

  vw.install_pull = logged_install
  vw.run(n)
  # The case under test happened: a pull installed inside a wave, with own pushed waves beyond the global clock
  # (clock_aligned: not in the pulled weights; on_receipt: in them).
  assert any(pushed > min(vc) and partial > 0 for vc, pushed, partial in installs), installs
  # Each reply as the PS answered it: on receipt it holds every wave VW 0 had pushed; clock-aligned only the global
  # clock's (the held reply may be installed after VW 0 pushed more; the replay below checks what it keeps then).
  pulls = vw.ps.pulls
  assert pulls and all((vc[0] == pushed) == (ps_apply == "on_receipt") or pushed == min(vc) for vc, pushed in pulls), \
      pulls
  records = [dataclasses.asdict(r) for r in vw.records]
  result = replay.replay(records, models.get_model("mlp_tiny"), params0, tx, [source], nm,
                         fixed_waves=[vw.ps.peer_waves], applied_order=server.state.applied)
  final_local = result.local_weights(0, vw.version.vector_clock, vw.version.local_updates)
  np.testing.assert_allclose(vw.layout.flatten(vw.layer_params()), final_local, rtol=1e-5, atol=1e-6)
  vw.ps.finish()
  np.testing.assert_allclose(server.weights, result.final_global_weights(server.state.applied), rtol=1e-5,
                             atol=1e-6)


def test_each_stage_function_compiles_once(synthetic_data_dir):
  vw, *_ = build_vw(synthetic_data_dir, model="cnn_small", partition=[(0, 2), (2, 5), (5, 7)], num_inflight=3)
  vw.run(12)
  for st in vw.stages:
    # ravel / unravel: the wave's push and the pull's install (one buffer per stage each way).
    kinds = ({"forward_backward", "update", "add"} if st.is_last else {"forward", "backward", "update", "add"}) | {
        "ravel", "unravel"}
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
  from hetpipe_jax.costs import cost_model
  target = {0: 0.002, 1: 0.002, 2: 0.012}  # a slow last stage makes the earlier stages hold the most
  vw, *_ = build_vw(synthetic_data_dir, partition=THREE_STAGES, num_inflight=4)
  vw.task_time_s = lambda task: target[task.stage_id]
  stats = vw.run(16)
  bound = cost_model.max_inflight_per_stage(3, 4)
  assert all(peak <= b for peak, b in zip(stats.peak_inflight_per_stage, bound)), (stats.peak_inflight_per_stage, bound)
  assert stats.peak_inflight_per_stage[0] == bound[0] == 4
  assert stats.peak_inflight_per_stage[-1] == bound[-1] == 1
