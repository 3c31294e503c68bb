"""Delay-compensated gradients (DC-ASGD, arXiv 1609.08326; ``delay_compensation``, ``dc_lambda``; issue 25 item 3).

The oracles are sequential replays written here in numpy/optax, apart from the runtime: minibatch p's gradient g is
taken at the recorded version W_p, corrected to g + λ·g⊙g⊙(W_now − W_p) with W_now the weights the step applies to,
then the optimizer steps. None of it calls :mod:`hetpipe_jax.runtime.delay_compensation`.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.jobs import job_config, virtual_job
from hetpipe_jax.jobs.job_config import ConfigError
from hetpipe_jax.runtime import delay_compensation
from hetpipe_jax.runtime import stages as stages_lib
from tests.pipeline_util import assert_params_close, build_vw, loss_and_grad, tiny_config

LAM = 2.0  # large enough that the correction moves the weights measurably on mlp_tiny over 18 minibatches
TWO_STAGES = [(0, 2), (2, 4)]
THREE_STAGES = [(0, 1), (1, 3), (3, 4)]


def _tx():
  return optax.sgd(0.05, momentum=0.9)


def _np_dc(g, w_now, w_used, lam):
  """The correction, by hand in numpy (float64 then float32)."""
  g, w_now, w_used = (np.asarray(a, np.float64) for a in (g, w_now, w_used))
  return (g + lam * g * g * (w_now - w_used)).astype(np.float32)


def _tree_dc(g, w_now, w_used, lam):
  return jax.tree.map(lambda a, b, c: _np_dc(a, b, c, lam), g, w_now, w_used)


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a),
                                                                                  jax.tree.leaves(b)))


def test_formula_against_a_hand_computed_case():
  """One stage's tree: g + λ·g⊙g⊙(W_now − W_p), against numbers worked out by hand."""
  g = {"w": np.array([[1.0, -2.0], [0.5, 0.0]], np.float32), "b": np.array([3.0], np.float32)}
  w_now = {"w": np.array([[1.0, 1.0], [2.0, 5.0]], np.float32), "b": np.array([-1.0], np.float32)}
  w_used = {"w": np.array([[0.0, 2.0], [2.0, 1.0]], np.float32), "b": np.array([0.0], np.float32)}
  lam = jax.device_put(np.float32(0.5))
  got = jax.device_get(delay_compensation.compensate(g, w_now, w_used, lam))
  # w: 1 + .5*1*1*1 = 1.5; -2 + .5*4*(-1) = -4; .5 + .5*.25*0 = .5; 0 + 0 = 0.  b: 3 + .5*9*(-1) = -1.5
  np.testing.assert_array_equal(got["w"], np.array([[1.5, -4.0], [0.5, 0.0]], np.float32))
  np.testing.assert_array_equal(got["b"], np.array([-1.5], np.float32))
  np.testing.assert_allclose(got["w"], _np_dc(g["w"], w_now["w"], w_used["w"], 0.5), rtol=1e-6)
  # λ = 0 and W_now = W_p leave the gradient as it is
  same = jax.device_get(delay_compensation.compensate(g, w_now, w_used, jax.device_put(np.float32(0.0))))
  np.testing.assert_array_equal(same["w"], g["w"])


def _hetpipe_replay(spec, params0, tx, batches, versions, lam):
  """Sequential training: minibatch p's gradient at the weights after ``versions[p]`` updates, DC-corrected against
  the current weights (``lam`` None: uncorrected)."""
  grad_fn = loss_and_grad(spec)
  history = [params0]
  params, state = params0, tx.init(params0)
  for (x, y), m in zip(batches, versions):
    _, g = grad_fn(history[m], x, y)
    g = jax.device_get(g)
    if lam is not None:
      g = _tree_dc(g, jax.device_get(params), history[m], lam)
    updates, state = tx.update(g, state, params)
    params = jax.device_get(optax.apply_updates(params, updates))
    history.append(params)
  return params


@pytest.mark.parametrize("num_inflight,partition", [(2, TWO_STAGES), (3, THREE_STAGES)])
def test_hetpipe_with_dc_equals_the_sequential_replay(synthetic_data_dir, num_inflight, partition):
  """A pipelined VW (D = 0) with dc equals the replay that corrects each gradient against its recorded version, and
  differs from the uncorrected replay (the correction acted)."""
  n = 18
  spec = models.get_model("mlp_tiny")
  vw, source, params0, tx, _ = build_vw(synthetic_data_dir, partition=partition, num_inflight=num_inflight,
                                        optimizer=_tx(), delay_compensation="dc", dc_lambda=LAM)
  vw.run(n)
  recs = sorted(vw.records, key=lambda r: r.minibatch_id)
  versions = [r.version_local_updates for r in recs]
  assert any(v < p for p, v in enumerate(versions))  # stale gradients: the correction has something to correct
  batches = [source.get(p) for p in range(n)]
  want = _hetpipe_replay(spec, params0, tx, batches, versions, LAM)
  assert_params_close(vw.layer_params(), want, rtol=1e-5, atol=1e-6)
  assert _max_diff(want, _hetpipe_replay(spec, params0, tx, batches, versions, None)) > 1e-4


def _pipedream_replay(spec, partition, params0, tx, batches, stage_versions, lam):
  """Per-stage updates in minibatch order: stage s's gradient at its weights after ``stage_versions[q][s]`` own
  updates, DC-corrected against its latest weights, then its own optimizer step."""
  grad_fn = loss_and_grad(spec)
  hist = [[list(params0[i:j])] for i, j in partition]
  states = [tx.init(list(params0[i:j])) for i, j in partition]
  for (x, y), versions in zip(batches, stage_versions):
    used = [layer for s, v in enumerate(versions) for layer in hist[s][v]]
    _, g = grad_fn(used, x, y)
    g = jax.device_get(g)
    for s, (i, j) in enumerate(partition):
      gs = list(g[i:j])
      if lam is not None:
        gs = _tree_dc(gs, hist[s][-1], hist[s][versions[s]], lam)
      u, states[s] = tx.update(gs, states[s], hist[s][-1])
      hist[s].append(jax.device_get(optax.apply_updates(hist[s][-1], u)))
  return [layer for h in hist for layer in h[-1]]


@pytest.mark.parametrize("vertical_sync", [False, True])
def test_pipedream_with_dc_equals_its_replay(synthetic_data_dir, vertical_sync):
  """PipeDream (3 stages, 3 in flight) with dc: each stage's step corrected against the weights its forward stashed
  equals the per-stage replay at the recorded stage versions, and differs from the uncorrected one."""
  n = 18
  spec = models.get_model("mlp_tiny")
  vw, source, params0, tx, _ = build_vw(synthetic_data_dir, partition=THREE_STAGES, num_inflight=3, optimizer=_tx(),
                                        method="pipedream", vertical_sync=vertical_sync, delay_compensation="dc",
                                        dc_lambda=LAM)
  vw.run(n)
  recs = sorted(vw.records, key=lambda r: r.minibatch_id)
  versions = [list(r.stage_versions) for r in recs]
  assert any(v[0] < q for q, v in enumerate(versions))
  batches = [source.get(p) for p in range(n)]
  want = _pipedream_replay(spec, THREE_STAGES, params0, tx, batches, versions, LAM)
  assert_params_close(vw.layer_params(), want, rtol=1e-5, atol=1e-6)
  assert _max_diff(want, _pipedream_replay(spec, THREE_STAGES, params0, tx, batches, versions, None)) > 1e-4


@pytest.mark.parametrize("method", ["hetpipe", "pipedream"])
def test_none_is_bit_identical_to_a_run_without_the_setting(synthetic_data_dir, method):
  """``delay_compensation="none"`` (with any λ) gives exactly the weights of a run that never names the setting.

  Nm = 1 and no pulls (D large, no pull per wave): the run is deterministic (with Nm > 1 the versions minibatches
  meet, and a rebase's rounding, depend on thread timing, so two runs of the same code differ); the path that
  "none" takes is the same at any Nm (the rule holds no compensator)."""
  finals = []
  for kwargs in ({}, {"delay_compensation": "none", "dc_lambda": 5.0}):
    vw, *_ = build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=1, optimizer=_tx(), method=method,
                      staleness_bound=100, pull_every_wave=False, **kwargs)
    vw.run(10)
    assert vw.update.compensator is None
    finals.append(vw.layer_params())
  for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _base(**overrides):
  return tiny_config(checkpoint_every_waves=0, eval_every_epochs=0.0, **overrides)


@pytest.mark.parametrize("overrides,pattern", [
    ({"dc_lambda": -0.1}, r"^config\.dc_lambda=-0\.1 must be >= 0"),
    ({"delay_compensation": "sgd"}, r"^config\.delay_compensation='sgd' must be one of 'none', 'dc'"),
    ({"delay_compensation": "dc", "method": "gpipe"}, r"^config\.delay_compensation='dc' .*config\.method='gpipe'"),
    ({"delay_compensation": "dc", "method": "1f1b_flush"},
     r"^config\.delay_compensation='dc' .*config\.method='1f1b_flush'"),
    ({"delay_compensation": "dc", "method": "horovod", "num_stages": 1},
     r"^config\.delay_compensation='dc' .*config\.method='horovod'"),
    ({"delay_compensation": "dc", "stage_ranks": True}, r"^config\.delay_compensation='dc' .*config\.stage_ranks"),
])
def test_bad_settings_are_one_error_naming_the_setting(overrides, pattern):
  with pytest.raises(ConfigError, match=pattern) as e:
    job_config.resolve_settings(_base(**overrides))
  assert "\n" not in str(e.value)


def test_the_rules_refuse_dc_where_they_do_not_take_it(synthetic_data_dir):
  """Below the job's check: the flush rule refuses the option, and a negative λ is refused by the rule."""
  with pytest.raises(ValueError, match="delay_compensation is not a setting of method 'gpipe'"):
    build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=2, method="gpipe", delay_compensation="dc")
  with pytest.raises(ValueError, match=r"dc_lambda=-1.0 must be >= 0"):
    build_vw(synthetic_data_dir, partition=TWO_STAGES, num_inflight=2, delay_compensation="dc", dc_lambda=-1.0)


def test_virtual_time_run_records_the_setting(tmp_path, synthetic_data_dir):
  """A virtual-time run with dc records it in config.json and summary.json (with λ), and its VWs ran with it."""
  c = _base(data_dir=str(synthetic_data_dir), num_minibatches=8, num_inflight=2, delay_compensation="dc",
            dc_lambda=0.5, progress=False, emulate_stage_ms="10,20",
            check_counts=False)
  summary = virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path))
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["delay_compensation"] == "dc" and config["dc_lambda"] == 0.5
  written = json.loads((tmp_path / "summary.json").read_text())
  for s in (summary, written):
    assert s["method_settings"]["delay_compensation"] == "dc" and s["method_settings"]["dc_lambda"] == 0.5
  c = _base(data_dir=str(synthetic_data_dir), num_minibatches=8, num_inflight=2, progress=False,
            emulate_stage_ms="10,20", check_counts=False)
  plain = virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path / "none"))
  assert plain["method_settings"]["delay_compensation"] == "none" and "dc_lambda" not in plain["method_settings"]
  # the VWs ran with it (virtual time's numerics do not depend on timing: the only difference is the correction)
  assert summary["test_loss"] != plain["test_loss"]


CLIP = 1.5  # mlp_tiny on the synthetic data: gradient norms 2.6 down to 0.5 (tests/test_global_clip.py)


def _clip(g):
  """optax's whole-model clip by the global norm (the oracle's, not the runtime's)."""
  clipped, _ = optax.clip_by_global_norm(CLIP).update(g, optax.EmptyState())
  return jax.device_get(clipped)


@pytest.mark.parametrize("method", ["hetpipe", "pipedream"])
def test_dc_then_clip_equals_the_replay(synthetic_data_dir, method):
  """With ``grad_clip_norm``: each stage's gradient is DC-corrected first, then the whole corrected gradient is
  clipped by its global norm (the clip sees the corrected gradient), then each stage steps; equals the replay in that
  order, not the replay that clips first."""
  n, partition = 12, TWO_STAGES
  spec = models.get_model("mlp_tiny")
  tx = _tx()
  stages = stages_lib.build_stages(spec, partition, jax.devices()[:2], tx, grad_clip_norm=CLIP)
  vw, source, params0, _, _ = build_vw(synthetic_data_dir, partition=partition, num_inflight=2, optimizer=tx,
                                       method=method, stages=stages, delay_compensation="dc", dc_lambda=LAM)
  vw.run(n)
  recs = sorted(vw.records, key=lambda r: r.minibatch_id)
  batches = [source.get(p) for p in range(n)]
  grad_fn = loss_and_grad(spec)

  def replay(dc_first):
    if method == "hetpipe":
      versions = [[r.version_local_updates] * 2 for r in recs]
    else:
      versions = [list(r.stage_versions) for r in recs]
    hist = [[list(params0[i:j])] for i, j in partition]
    states = [tx.init(list(params0[i:j])) for i, j in partition]
    for (x, y), v in zip(batches, versions):
      _, g = grad_fn([layer for s, k in enumerate(v) for layer in hist[s][k]], x, y)
      g = list(jax.device_get(g))
      dc = lambda g: [layer for s, (i, j) in enumerate(partition)  # noqa: E731
                      for layer in _tree_dc(g[i:j], hist[s][-1], hist[s][v[s]], LAM)]
      g = _clip(dc(g)) if dc_first else dc(_clip(g))
      for s, (i, j) in enumerate(partition):
        u, states[s] = tx.update(list(g[i:j]), states[s], hist[s][-1])
        hist[s].append(jax.device_get(optax.apply_updates(hist[s][-1], u)))
    return [layer for h in hist for layer in h[-1]]

  want = replay(dc_first=True)
  assert_params_close(vw.layer_params(), want, rtol=1e-5, atol=1e-6)
  assert _max_diff(want, replay(dc_first=False)) > 1e-5


def test_mpi_run_records_and_runs_dc(tmp_path, synthetic_data_dir):
  """``hetpipe_jax.train`` under MPI (a PS rank and one VW) with dc: it runs and config.json and summary.json record
  the setting and λ."""
  from tests.mpi_util import run_job  # pylint: disable=g-import-not-at-top
  proc = run_job(tmp_path, 2, {"data_dir": synthetic_data_dir, "num_virtual_workers": 1, "num_minibatches": 8,
                               "num_inflight": 2, "checkpoint_every_waves": 0, "eval_every_epochs": 0.0,
                               "delay_compensation": "dc", "dc_lambda": 0.5})
  assert proc.returncode == 0, proc.stderr[-3000:]
  config = json.loads((tmp_path / "config.json").read_text())
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert config["delay_compensation"] == "dc" and config["dc_lambda"] == 0.5
  assert summary["method_settings"]["delay_compensation"] == "dc" and summary["method_settings"]["dc_lambda"] == 0.5
