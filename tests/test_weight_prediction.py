"""Weight prediction at injection (``weight_prediction``) and PipeMare's delay-scaled steps (``delay_scaled_lr``,
``pipemare_warmup_minibatches``) in the hetpipe and pipedream update rules (issue 25 items 2 and 4).

The oracles are written here, apart from the code: the directions by hand in numpy (float64), the look-ahead s of
the engine's schedule traced by hand, and sequential replays that compute each minibatch's predicted weights from
their own weight and optimizer-state history (and PipeMare's factor from its own formula); none of it calls
:mod:`hetpipe_jax.rules.weight_prediction` or :mod:`hetpipe_jax.runtime.weight_prediction`.
"""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.costs.task_times import VWTaskTimes
from hetpipe_jax.jobs import job_config, virtual_job
from hetpipe_jax.jobs.job_config import ConfigError
from hetpipe_jax.rules import weight_prediction as rules_wp
from hetpipe_jax.runtime import virtual_time
from hetpipe_jax.runtime import weight_prediction
from tests.pipeline_util import assert_params_close, build_vw, loss_and_grad, tiny_config

THREE_STAGES = [(0, 2), (2, 3), (3, 4)]  # a Dense layer on every stage
LR = 1e-2
B1, B2, EPS = 0.9, 0.999, 1e-8
# The runs' Adam ε: with optax's 1e-8, m/(√v + ε) of a parameter whose gradients are tiny (a cancellation: the
# pipelined stages and the replay's one jitted model differ there in the last bits) is ill-conditioned; ε = 1e-3
# bounds that amplification.
RUN_EPS = 1e-3


def _adam_state(count, mu, nu):
  return jax.device_put((optax.ScaleByAdamState(count=np.int32(count), mu=mu, nu=nu), optax.EmptyState()))


# ---------------------------------------------------------------- the directions, by hand
def test_adam_prediction_against_a_hand_computed_case():
  """Adam, c = 2 steps taken, s = 3, η = 0.1: Ŵ = W − 3 · 0.1 · m̂/(√v̂ + ε) with the bias corrections of step 3."""
  w = [{"k": np.array([1.0, -1.0, 0.5], np.float32)}]
  m = [{"k": np.array([0.1, -0.2, 0.0], np.float32)}]
  v = [{"k": np.array([0.01, 0.04, 0.09], np.float32)}]
  # by hand: m̂ = m / (1 − 0.9³) = m / 0.271; v̂ = v / (1 − 0.999³) = v / 0.002997001
  # element 0: m̂ = 0.369004, v̂ = 3.336669, √v̂ = 1.826655, d = 0.202011, Ŵ = 1 − 0.3 · 0.202011 = 0.939397
  # element 1: m̂ = −0.738007, √v̂ = 3.653310, d = −0.202011, Ŵ = −1 + 0.060603 = −0.939397; element 2: d = 0
  predictor = weight_prediction.Predictor(rules_wp.OptimizerStep("adam", 0.1))
  got = jax.device_get(predictor(jax.device_put(w), _adam_state(2, m, v), 3))
  np.testing.assert_allclose(got[0]["k"], [0.939397, -0.939397, 0.5], rtol=2e-6)
  # s = 0: the weights themselves, nothing computed
  assert predictor(w, _adam_state(2, m, v), 0) is w


def _np_nadam_d(m, v, c, b1=B1, b2=B2, eps=EPS):
  m, v = np.float64(m), np.float64(v)
  m_hat = b1 * m / (1 - b1 ** (c + 2)) + (1 - b1) * m / (1 - b1 ** (c + 1))
  return m_hat / (np.sqrt(v / (1 - b2 ** (c + 1))) + eps)


def test_nadam_and_nadamw_prediction_against_hand_computed_cases():
  """NAdam's look-ahead form (optax's Nesterov Adam with the next gradient estimated by m), and NAdamW's weight
  decay term λ_wd · W added to it, both times the rate."""
  w = [{"k": np.array([2.0, -0.5], np.float32)}]
  m = [{"k": np.array([0.3, 0.05], np.float32)}]
  v = [{"k": np.array([0.04, 0.0025], np.float32)}]
  c, s, lr, wd, b1 = 4, 2, 0.05, 0.1, 0.99
  # by hand, element 0 (β1 = 0.99): 1 − 0.99⁶ = 0.058519850, 1 − 0.99⁵ = 0.049009950, 1 − 0.999⁵ = 0.004990010;
  # m̂ = 0.99 · 0.3 / 0.058519851 + 0.01 · 0.3 / 0.049009950 = 5.075200 + 0.061212 = 5.136413;
  # √v̂ = √(0.04 / 0.004990010) = 2.831257; d = 1.814181; Ŵ = 2 − 2 · 0.05 · 1.814181 = 1.818582
  want_d = _np_nadam_d(m[0]["k"], v[0]["k"], c, b1=b1)
  np.testing.assert_allclose(want_d[0], 1.814181, rtol=1e-6)
  nadam = weight_prediction.Predictor(rules_wp.OptimizerStep("nadam", lr, b1=b1))
  got = jax.device_get(nadam(jax.device_put(w), _adam_state(c, m, v), s))[0]["k"]
  np.testing.assert_allclose(got[0], 1.818582, rtol=1e-6)
  np.testing.assert_allclose(got, w[0]["k"] - s * lr * want_d, rtol=1e-6, atol=2e-6)
  nadamw = weight_prediction.Predictor(rules_wp.OptimizerStep("nadamw", lr, b1=b1, weight_decay=wd))
  state = (optax.ScaleByAdamState(count=np.int32(c), mu=m, nu=v), optax.EmptyState(), optax.EmptyState())
  got = jax.device_get(nadamw(*jax.device_put((w, state)), s))[0]["k"]
  np.testing.assert_allclose(got, w[0]["k"] - s * lr * (want_d + wd * np.float64(w[0]["k"])), rtol=1e-6, atol=2e-6)


def test_momentum_direction_is_the_step_optax_takes_when_its_buffer_stays():
  """Momentum: d = the buffer, which is optax's step (over η) for the gradient (1 − μ)·buf that leaves it in place."""
  mu, lr = 0.9, 0.1
  w = [{"k": np.array([1.0, 2.0], np.float32)}]
  buf = [{"k": np.array([0.5, -1.5], np.float32)}]
  tx = optax.sgd(lr, momentum=mu)
  state = (optax.TraceState(trace=buf), optax.EmptyState())
  step, new_state = tx.update([{"k": (1 - mu) * buf[0]["k"]}], state, w)
  np.testing.assert_allclose(jax.device_get(new_state[0].trace)[0]["k"], buf[0]["k"], rtol=1e-6)
  predictor = weight_prediction.Predictor(rules_wp.OptimizerStep("momentum", lr, momentum=mu))
  got = jax.device_get(predictor(*jax.device_put((w, state)), 1))[0]["k"]
  np.testing.assert_allclose(got, w[0]["k"] + np.asarray(step[0]["k"]), rtol=1e-6)
  np.testing.assert_allclose(got, [0.95, 2.15], rtol=1e-6)


def test_muon_prediction_is_optax_muons_step_when_its_momentum_stays():
  """Muon (consistent RMS 0.2, β 0.95, weight decay 0.1): on its matrix, d is exactly the step optax's ``contrib.muon``
  takes (over −η) for the gradient μ, which leaves μ in place (μ ← β·μ + (1 − β)·μ), Newton–Schulz included; on the
  other leaf (Muon's Adam part) d is NAdamW's hand formula; s = 2, η = 0.05."""
  rng = np.random.default_rng(0)
  w = [{"k": rng.normal(size=(6, 4)).astype(np.float32), "b": np.array([0.5, -1.0, 2.0, 0.0], np.float32)}]
  dims = [{"k": optax.contrib.MuonDimensionNumbers(0, 1), "b": None}]
  lr, c, s, wd, beta = 0.05, 3, 2, 0.1, 0.95
  tx = optax.contrib.muon(lr, beta=beta, weight_decay=wd, adam_weight_decay=wd, consistent_rms=0.2,
                          muon_weight_dimension_numbers=dims)
  state = tx.init(w)
  for _ in range(c):  # c real steps, so the moments and counts are not zeros
    state = tx.update([{"k": rng.normal(size=(6, 4)).astype(np.float32),
                        "b": rng.normal(size=4).astype(np.float32)}], state, w)[1]
  muon_mu = state.inner_states["muon"].inner_state[0].mu[0]["k"]
  adam = state.inner_states["adam"].inner_state[0]
  m_b, v_b = np.asarray(adam.mu[0]["b"]), np.asarray(adam.nu[0]["b"])
  step, after = tx.update([{"k": muon_mu, "b": m_b}], state, w)
  np.testing.assert_allclose(after.inner_states["muon"].inner_state[0].mu[0]["k"], muon_mu, rtol=1e-6, atol=1e-7)
  opt = rules_wp.OptimizerStep("muon", lr, weight_decay=wd, muon_consistent_rms=0.2)
  got = jax.device_get(weight_prediction.Predictor(opt)(*jax.device_put((w, state)), s))[0]
  np.testing.assert_allclose(got["k"], w[0]["k"] + s * np.asarray(step[0]["k"]), rtol=1e-5, atol=1e-6)
  want_b = w[0]["b"] - s * lr * (_np_nadam_d(m_b, v_b, c) + wd * np.float64(w[0]["b"]))
  np.testing.assert_allclose(got["b"], want_b, rtol=1e-6, atol=1e-6)
  assert np.max(np.abs(got["k"] - w[0]["k"])) > 1e-3  # it moved the matrix


def test_a_schedule_sums_the_rates_of_the_s_steps():
  """With a schedule, the rate is η_c0 + … + η_{c0+s−1}, c0 = c − back (the steps that land), on the device."""
  sched = optax.cosine_decay_schedule(0.1, 10)
  w = [{"k": np.array([1.0], np.float32)}]
  m, v = [{"k": np.array([0.2], np.float32)}], [{"k": np.array([0.04], np.float32)}]
  c, s, back = 5, 3, 2
  d = (0.2 / (1 - B1 ** 6)) / (np.sqrt(0.04 / (1 - B2 ** 6)) + EPS)
  rates = sum(0.1 * 0.5 * (1 + np.cos(np.pi * k / 10)) for k in range(c - back, c - back + s))  # counts 3, 4, 5
  predictor = weight_prediction.Predictor(rules_wp.OptimizerStep("adam", sched))
  state = (optax.ScaleByAdamState(count=np.int32(c), mu=m, nu=v), optax.ScaleByScheduleState(count=np.int32(c)))
  got = jax.device_get(predictor(*jax.device_put((w, state)), s, back))[0]["k"]
  np.testing.assert_allclose(got, 1.0 - rates * d, rtol=1e-6)


def test_pipemare_scale_by_hand():
  """τ^−(1 − min(t/T, 1)): τ = 4, T = 10: t = 0 → 1/4, t = 5 → 1/2, t ≥ 10 → 1; τ = 0 → 1; τ = 1 → 1."""
  assert rules_wp.pipemare_scale(4, 0, 10) == pytest.approx(0.25, rel=1e-12)
  assert rules_wp.pipemare_scale(4, 5, 10) == pytest.approx(0.5, rel=1e-12)
  assert rules_wp.pipemare_scale(4, 10, 10) == 1.0 and rules_wp.pipemare_scale(4, 30, 10) == 1.0
  assert rules_wp.pipemare_scale(0, 0, 10) == 1.0 and rules_wp.pipemare_scale(1, 0, 10) == 1.0
  assert rules_wp.pipemare_scale(8, 5, 15) == pytest.approx(0.25, rel=1e-12)  # 8^(−2/3)


# ---------------------------------------------------------------- virtual time: s, and the replays
def _run_virtual(data_dir, method, num_inflight, n, staleness_bound=100, pull_every_wave=False, partition=None,
                 tx=None, ps_s=0.0, **options):
  """One VW of mlp_tiny in virtual time (forward = backward = 1 s per stage, the last stage's FB 2 s, free sends, a
  push and a pull ``ps_s`` each); returns ``(vw, source, params0, tx, captured)``, captured: per minibatch id, the full-model weights its
  forwards used (every stage's ``forward_params``)."""
  partition = partition or THREE_STAGES
  outbox: dict = {}
  tx = tx or optax.adam(LR, eps=RUN_EPS)
  vw, source, params0, tx, server = build_vw(
      data_dir, partition=partition, num_inflight=num_inflight, optimizer=tx, method=method,
      staleness_bound=staleness_bound, pull_every_wave=pull_every_wave,
      client_factory=lambda _server, v: virtual_time.RecordingPSClient(v, outbox), **options)
  captured: dict[int, dict[int, list]] = {}
  forward_params = vw.update.forward_params

  def capture(stage_id, mb):
    params = forward_params(stage_id, mb)
    captured.setdefault(mb.record.minibatch_id, {})[stage_id] = jax.device_get(params)
    return params

  vw.update.forward_params = capture
  k = len(partition) - 1
  times = VWTaskTimes((1.0,) * k, (1.0,) * k, 2.0, (0.0,) * k, (0.0,) * k, ps_s, ps_s)
  virtual_time.run([vw], server, outbox, [times], n // num_inflight, staleness_bound, pull_every_wave)
  full = {p: [layer for s in sorted(c) for layer in c[s]] for p, c in captured.items()}
  return vw, source, params0, tx, full


def _opt_step(opt):
  return {"weight_prediction": "optimizer", "optimizer_step": opt}


def test_hetpipe_lookahead_against_the_hand_traced_schedule(synthetic_data_dir):
  """HetPipe, Nm = 3, 3 stages (F = B = 1 s, the last stage's FB 2 s), completions in order; traced by hand.

  With the staleness bound out of reach, p meets min(p, 2) minibatches in flight. With D = 0 and a slow PS (push and
  pull 10 s each): p0..p2 at 0 (s = 0, 1, 2), p3 at p0's completion (6 s) and p4 at p1's (8 s), both with 2 in
  flight; p5 (wave 1) at p2's completion (10 s) finds local clock 1 and needs global clock 1: the wave-0 push
  arrives at 20, its pull at 30, when p3 and p4 are long done: s = 0, then p6, p7 at once: 1, 2; p8 (wave 2) at p5's
  completion needs global clock 2, again after the last wave's push and pull: 0, 1, 2 for p8..p10; p11 the same: 0."""
  vw, *_ = _run_virtual(synthetic_data_dir, "hetpipe", 3, 12, **_opt_step(rules_wp.OptimizerStep("adam", LR, eps=RUN_EPS)))
  assert vw.update.lookaheads == [0, 1] + [2] * 10
  vw, *_ = _run_virtual(synthetic_data_dir, "hetpipe", 3, 12, staleness_bound=0, pull_every_wave=True, ps_s=10.0)
  assert vw.update.lookaheads == [0, 1, 2, 2, 2, 0, 1, 2, 0, 1, 2, 0]
  # the records agree: p's version holds the updates of every minibatch before it but those s
  assert [r.minibatch_id - r.version_local_updates for r in vw.records] == vw.update.lookaheads


def test_pipedream_lookahead_against_the_hand_traced_schedule(synthetic_data_dir):
  """PipeDream, Nm = 3, 3 stages (F = B = 1 s, the last stage's FB 2 s), traced by hand (each stage: forwards and
  backwards in order, FIFO among ready tasks, stage k holds at most Nm − k minibatches (1F1B); p + 3 injected when p
  completes):

  stage 0: F0 [0,1] F1 [1,2] F2 [2,3] B0 [5,6] F3 [6,7] B1 [7,8] F4 [8,9] ...
  stage 1: F0 [1,2] F1 [2,3] (F2 waits: 2 held) B0 [4,5] F2 [5,6] B1 [6,7] F3 [7,8] B2 [8,9] ...
  stage 2: FB0 [2,4] FB1 [4,6] FB2 [6,8] ...

  s at each forward = the stage's forwards before it − its updates (after its backwards) done by then: stage 0
  0, 1, 2, then 3 − 1 = 2 for ever; stage 1 0, 1, then F2 after B0: 1, and 1 on; stage 2: 0."""
  vw, *_ = _run_virtual(synthetic_data_dir, "pipedream", 3, 12)
  assert vw.update.lookaheads == [[0, 1] + [2] * 10, [0] + [1] * 11, [0] * 12]
  # and s = p − the stage's updates in the weights its forward used (the recorded stage versions)
  for s in range(3):
    assert [r.minibatch_id - r.stage_versions[s] for r in vw.records] == vw.update.lookaheads[s]


def _np_adam_d(m, v, c):
  m, v = np.float64(m), np.float64(v)
  return (m / (1 - B1 ** (c + 1))) / (np.sqrt(v / (1 - B2 ** (c + 1))) + RUN_EPS)


def _np_adam_step(g, m, v, c):
  """Adam (optax's defaults: eps_root 0) by hand: returns (update, m, v) after step c + 1."""
  g = np.float64(g)
  m, v = B1 * np.float64(m) + (1 - B1) * g, B2 * np.float64(v) + (1 - B2) * g * g
  return -LR * (m / (1 - B1 ** (c + 1))) / (np.sqrt(v / (1 - B2 ** (c + 1))) + RUN_EPS), m, v


def _replay(spec, partition, params0, batches, used_updates, *, predict, pipemare_t=None, ran_at=None):
  """Sequential per-stage Adam in numpy: minibatch p's gradient at, on stage k, the stage's weights after
  ``used_updates[p][k]`` own updates, predicted by s = p − used_updates[p][k] steps of that state's direction (when
  ``predict``); each stage's step times PipeMare's factor with τ = its updates since those weights, T =
  ``pipemare_t`` (when given). HetPipe is the case where every stage's count is the version's. ``ran_at``: per
  minibatch, full-model weights to take its gradient at instead (the run's captured Ŵ).

  Returns:
    (final per-layer params, per minibatch the full-model weights predicted from the replay's own history).
  """
  grad_fn = loss_and_grad(spec)
  flat = [jax.tree.map(lambda a: np.asarray(a, np.float64), list(params0[i:j])) for i, j in partition]
  hist = [[(w, jax.tree.map(np.zeros_like, w), jax.tree.map(np.zeros_like, w))] for w in flat]  # (W, m, v)
  ran = []
  for p, ((x, y), used) in enumerate(zip(batches, used_updates)):
    weights = []
    for k, u in enumerate(used):
      w, m, v = hist[k][u]
      if predict and p - u:
        w = jax.tree.map(lambda a, b, c: a - (p - u) * LR * _np_adam_d(b, c, u), w, m, v)
      weights += [jax.tree.map(lambda a: a.astype(np.float32), layer) for layer in w]
    ran.append(weights)
    _, g = grad_fn(weights if ran_at is None else ran_at[p], x, y)
    g = jax.device_get(g)
    for k, (i, j) in enumerate(partition):
      w, m, v = hist[k][-1]
      c = len(hist[k]) - 1
      triples = jax.tree.map(lambda a, b, cc: _np_adam_step(a, b, cc, c), list(g[i:j]), m, v)
      upd = jax.tree.map(lambda t: t[0], triples, is_leaf=lambda t: isinstance(t, tuple))
      m = jax.tree.map(lambda t: t[1], triples, is_leaf=lambda t: isinstance(t, tuple))
      v = jax.tree.map(lambda t: t[2], triples, is_leaf=lambda t: isinstance(t, tuple))
      if pipemare_t is not None:
        tau = c - used[k]
        upd = jax.tree.map(lambda a: a * (tau ** -(1 - min(c / pipemare_t, 1)) if tau else 1.0), upd)
      f32 = lambda t: jax.tree.map(lambda a: np.float64(np.float32(a)), t)  # noqa: E731  (the runtime's float32 state)
      hist[k].append((f32(jax.tree.map(np.add, w, upd)), f32(m), f32(v)))
  final = [jax.tree.map(lambda a: a.astype(np.float32), layer) for h in hist for layer in h[-1][0]]
  return final, ran


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a),
                                                                                  jax.tree.leaves(b)))


@pytest.mark.parametrize("method", ["hetpipe", "pipedream"])
def test_prediction_equals_the_sequential_replay_of_the_predicted_versions(synthetic_data_dir, method):
  """A pipelined virtual-time run (Nm = 3, 3 stages) with prediction: its final weights equal the sequential replay
  that takes each gradient at the captured Ŵ and steps the current weights (rtol 1e-5); every captured Ŵ is the one
  the replay predicts from its own weight and Adam-state history (to 1e-5: a tenth of a step of η = 1e-2; Adam's
  m/(√v + ε) amplifies the last-bit differences of the two computations' gradients); the replay without prediction
  differs (prediction acted)."""
  n = 15
  spec = models.get_model("mlp_tiny")
  vw, source, params0, _, captured = _run_virtual(synthetic_data_dir, method, 3, n,
                                                  **_opt_step(rules_wp.OptimizerStep("adam", LR, eps=RUN_EPS)))
  recs = sorted(vw.records, key=lambda r: r.minibatch_id)
  used = ([[r.version_local_updates] * 3 for r in recs] if method == "hetpipe" else
          [list(r.stage_versions) for r in recs])
  batches = [source.get(p) for p in range(n)]
  want, ran = _replay(spec, THREE_STAGES, params0, batches, used, predict=True, ran_at=captured)
  for p in range(n):
    assert_params_close(captured[p], ran[p], rtol=1e-5, atol=1e-5)
  assert_params_close(vw.layer_params(), want, rtol=1e-5, atol=1e-6)
  plain, _ = _replay(spec, THREE_STAGES, params0, batches, used, predict=False)
  assert _max_diff(want, plain) > 1e-4


@pytest.mark.parametrize("method", ["hetpipe", "pipedream"])
def test_pipemare_equals_the_replay_with_its_scaled_steps(synthetic_data_dir, method):
  """PipeMare (T = 8) with prediction off: each step is scaled by τ^−(1 − min(t/T, 1)) with τ the real delay; the
  recorded (τ, t, factor) are the hand formula's, and the run equals the replay that scales its steps so."""
  n, warmup = 15, 8
  spec = models.get_model("mlp_tiny")
  vw, source, params0, _, _ = _run_virtual(synthetic_data_dir, method, 3, n, delay_scaled_lr="pipemare",
                                           pipemare_warmup_minibatches=warmup)
  recs = sorted(vw.records, key=lambda r: r.minibatch_id)
  used = ([[r.version_local_updates] * 3 for r in recs] if method == "hetpipe" else
          [list(r.stage_versions) for r in recs])
  steps = vw.update.pipemare_steps if method == "hetpipe" else vw.update.pipemare_steps[0]
  stage0 = [u[0] for u in used]
  assert [(tau, t) for tau, t, _ in steps] == [(p - stage0[p], p) for p in range(n)]
  assert [f for *_, f in steps] == pytest.approx([tau ** -(1 - min(t / warmup, 1)) if tau else 1.0
                                                  for tau, t, _ in steps], rel=1e-12)
  assert any(f < 1 for *_, f in steps)
  batches = [source.get(p) for p in range(n)]
  want, _ = _replay(spec, THREE_STAGES, params0, batches, used, predict=False, pipemare_t=warmup)
  assert_params_close(vw.layer_params(), want, rtol=1e-5, atol=1e-6)
  plain, _ = _replay(spec, THREE_STAGES, params0, batches, used, predict=False)
  assert _max_diff(want, plain) > 1e-4


def _sha(params) -> str:
  return hashlib.sha256(b"".join(np.asarray(a, np.float32).tobytes() for a in jax.tree.leaves(params))).hexdigest()


@pytest.mark.parametrize("method", ["hetpipe", "pipedream"])
def test_off_is_bit_identical_to_a_run_without_the_settings(synthetic_data_dir, method):
  """``weight_prediction="none"`` and ``delay_scaled_lr="none"`` (any T) give the weights (hash) of a run that never
  names them: a pipelined virtual-time run (deterministic) at Nm = 3."""
  hashes = []
  for options in ({}, {"weight_prediction": "none", "delay_scaled_lr": "none", "pipemare_warmup_minibatches": 3}):
    vw, *_ = _run_virtual(synthetic_data_dir, method, 3, 9, **options)
    assert vw.update.predictor is None and vw.update.pipemare is None
    hashes.append(_sha(vw.layer_params()))
  assert hashes[0] == hashes[1]


# ---------------------------------------------------------------- settings
def _base(**overrides):
  return tiny_config(checkpoint_every_waves=0, eval_every_epochs=0.0, **overrides)


@pytest.mark.parametrize("overrides,pattern", [
    ({"weight_prediction": "spectrain"}, r"^config\.weight_prediction='spectrain' must be one of 'none', 'optimizer'"),
    ({"weight_prediction": "optimizer", "optimizer": "sgd"},
     r"^config\.weight_prediction='optimizer' .*optimizer='sgd'"),
    ({"weight_prediction": "optimizer", "method": "gpipe"},
     r"^config\.weight_prediction='optimizer' .*config\.method='gpipe'"),
    ({"weight_prediction": "optimizer", "stage_ranks": True},
     r"^config\.weight_prediction='optimizer' .*config\.stage_ranks"),
    ({"delay_scaled_lr": "linear"}, r"^config\.delay_scaled_lr='linear' must be one of 'none', 'pipemare'"),
    ({"delay_scaled_lr": "pipemare", "pipemare_warmup_minibatches": 0},
     r"^config\.pipemare_warmup_minibatches=0 must be an integer >= 1"),
    ({"delay_scaled_lr": "pipemare", "method": "horovod", "num_stages": 1},
     r"^config\.delay_scaled_lr='pipemare' .*config\.method='horovod'"),
    ({"delay_scaled_lr": "pipemare", "stage_ranks": True}, r"^config\.delay_scaled_lr='pipemare' .*config\.stage_ranks"),
])
def test_bad_settings_are_one_error_each(overrides, pattern):
  with pytest.raises(ConfigError, match=pattern) as e:
    job_config.resolve_job(_base(**overrides), "mpi")
  assert "\n" not in str(e.value)


def test_the_rules_refuse_what_they_do_not_take(synthetic_data_dir):
  """Below the job's check: the flush rule refuses both options, prediction refuses sgd, and needs the optimizer."""
  with pytest.raises(ValueError, match="weight_prediction is not a setting of method 'gpipe'"):
    build_vw(synthetic_data_dir, partition=THREE_STAGES, num_inflight=2, method="gpipe",
             weight_prediction="optimizer", optimizer_step=rules_wp.OptimizerStep("adam", LR))
  with pytest.raises(ValueError, match="delay_scaled_lr is not a setting of method 'gpipe'"):
    build_vw(synthetic_data_dir, partition=THREE_STAGES, num_inflight=2, method="gpipe", delay_scaled_lr="pipemare")
  with pytest.raises(ValueError, match=r"weight_prediction='optimizer' .*optimizer='sgd'"):
    build_vw(synthetic_data_dir, partition=THREE_STAGES, num_inflight=2, optimizer=optax.sgd(LR),
             weight_prediction="optimizer", optimizer_step=rules_wp.OptimizerStep("sgd", LR))
  with pytest.raises(ValueError, match="needs the optimizer's hyperparameters"):
    build_vw(synthetic_data_dir, partition=THREE_STAGES, num_inflight=2, weight_prediction="optimizer")


@pytest.mark.parametrize("options,recorded", [
    ({"weight_prediction": "optimizer"}, {"weight_prediction": "optimizer", "delay_scaled_lr": "none"}),
    ({"delay_scaled_lr": "pipemare", "pipemare_warmup_minibatches": 4},
     {"weight_prediction": "none", "delay_scaled_lr": "pipemare", "pipemare_warmup_minibatches": 4}),
])
def test_virtual_time_run_records_the_settings(tmp_path, synthetic_data_dir, options, recorded):
  """A virtual-time job with each setting records it in config.json and summary.json (T when on), and its VWs ran
  with it (virtual time's numerics do not depend on timing: the only difference from the plain run is the setting)."""
  # Nm = 3: delays of 2 (with Nm = 2 every delay is 0 or 1, and PipeMare's 1^x leaves every step as it is)
  common = dict(data_dir=str(synthetic_data_dir), num_minibatches=9, num_inflight=3, progress=False,
                emulate_stage_ms="10,20", check_counts=False, optimizer="adam")
  c = _base(**common, **options)
  summary = virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path))
  config = json.loads((tmp_path / "config.json").read_text())
  written = json.loads((tmp_path / "summary.json").read_text())
  for name, value in recorded.items():
    assert config[name] == value
    assert summary["method_settings"][name] == written["method_settings"][name] == value
  if "pipemare_warmup_minibatches" not in recorded:
    assert "pipemare_warmup_minibatches" not in summary["method_settings"]
  c = _base(**common)
  plain = virtual_job.run(job_config.resolve_job(c, "virtual"), str(tmp_path / "none"))
  ms = plain["method_settings"]
  assert ms["weight_prediction"] == "none" and ms["delay_scaled_lr"] == "none"
  assert summary["test_loss"] != plain["test_loss"]


@pytest.mark.parametrize("method", ["hetpipe", "pipedream"])
def test_mpi_run_records_and_runs_both(tmp_path, synthetic_data_dir, method):
  """``hetpipe_jax.train`` under MPI (a PS rank and one VW, the threaded runtime) with prediction and PipeMare: it
  runs, and config.json and summary.json record both settings and T."""
  from tests.mpi_util import run_job  # pylint: disable=g-import-not-at-top
  proc = run_job(tmp_path, 2, {"data_dir": synthetic_data_dir, "num_virtual_workers": 1, "num_minibatches": 9,
                               "num_inflight": 3, "checkpoint_every_waves": 0, "eval_every_epochs": 0.0,
                               "method": method, "weight_prediction": "optimizer", "delay_scaled_lr": "pipemare",
                               "pipemare_warmup_minibatches": 5})
  assert proc.returncode == 0, proc.stderr[-3000:]
  config = json.loads((tmp_path / "config.json").read_text())
  summary = json.loads((tmp_path / "summary.json").read_text())
  for record in (config, summary["method_settings"]):
    assert record["weight_prediction"] == "optimizer" and record["delay_scaled_lr"] == "pipemare"
    assert record["pipemare_warmup_minibatches"] == 5
