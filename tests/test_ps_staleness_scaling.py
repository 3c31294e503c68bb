"""Staleness-aware wave updates at the parameter server (``ps_staleness_scaling``; issue 25 item 4, PS half).

VW v's wave update is added times s(tau), tau = waves of other VWs in the global weights (just before it is added)
that were not in the last pull reply the PS sent v; s = 1/(1 + tau) ("inverse", arXiv 1511.05950) or
exp(-alpha tau) ("exp"). The rule: :class:`hetpipe_jax.rules.wsp.ParameterServerState`.
"""

import json
import math
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from experiments.configs import tiny
from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.jobs import checkpoint
from hetpipe_jax.jobs import job_config
from hetpipe_jax.jobs import virtual_job
from hetpipe_jax.jobs.job_config import ConfigError
from hetpipe_jax.paths import REPO_ROOT
from hetpipe_jax.ps.param_server import ParameterServer
from hetpipe_jax.rules import wsp
from hetpipe_jax.runtime.param_layout import ParamLayout
from tests.mpi_util import read_jsonl, run_job
from tests.replay import read_applied_order, read_applied_scales, replay_final_weights

# A hand-built sequence of 3 VWs, on receipt: ("push", vw, wave) or ("pull", vw) (the PS sends vw its weights now).
# tau of each push, by hand: sum over the other VWs u of (u's waves applied now - u's waves in vw's last reply).
SEQUENCE = [("push", 0, 0),  # applied (0,0,0), VW 0 never pulled: 0
            ("push", 1, 0),  # applied (1,0,0): VW 0's wave 0 -> 1
            ("pull", 2),  # VW 2 gets (1,1,0)
            ("push", 0, 1),  # applied (1,1,0), VW 0's reply W0: VW 1's wave 0 -> 1
            ("push", 2, 0),  # applied (2,1,0) vs its reply (1,1,0): VW 0's wave 1 -> 1
            ("pull", 0),  # VW 0 gets (2,1,1)
            ("push", 1, 1),  # applied (2,1,1), VW 1 never pulled: 2 + 1 -> 3
            ("push", 0, 2),  # applied (2,2,1) vs (2,1,1): VW 1's wave 1 -> 1
            ("pull", 1),  # VW 1 gets (3,2,1)
            ("push", 1, 2)]  # applied (3,2,1) vs (3,2,1) -> 0
EXPECTED_TAU = [0, 1, 1, 1, 3, 1, 0]


def _expected_scale(scaling, alpha, tau):
  return {"none": 1.0, "inverse": 1.0 / (1.0 + tau), "exp": math.exp(-alpha * tau)}[scaling]


@pytest.mark.parametrize("scaling,alpha", [("none", 1.0), ("inverse", 1.0), ("exp", 0.5)])
def test_tau_and_scale_of_a_hand_built_sequence(scaling, alpha):
  rng = np.random.default_rng(0)
  w0 = rng.standard_normal(5).astype(np.float32)
  ps = ParameterServer(w0, 3, staleness_scaling=scaling, staleness_alpha=alpha)
  expected = w0.copy()
  k = 0
  for step in SEQUENCE:
    if step[0] == "pull":
      vc, w = ps.pull_reply(step[1])
      np.testing.assert_array_equal(w, ps.weights)
      continue
    _, vw, wave = step
    delta = rng.standard_normal(5).astype(np.float32)
    ps.push(vw, wave, delta)
    expected += np.float32(_expected_scale(scaling, alpha, EXPECTED_TAU[k])) * delta
    k += 1
  taus = [t for t, _ in ps.state.staleness]
  assert taus == EXPECTED_TAU
  assert [s for _, s in ps.state.staleness] == pytest.approx(
      [_expected_scale(scaling, alpha, t) for t in EXPECTED_TAU], rel=1e-12)
  np.testing.assert_allclose(ps.weights, expected, rtol=1e-6)


def test_clock_aligned_counts_the_vws_before_it_in_the_same_wave():
  """clock_aligned: wave c of VW 0 and VW 1 are added together, VW 0 first; VW 1's update counts VW 0's (tau 1)."""
  state = wsp.ParameterServerState(2, "clock_aligned", staleness_scaling="inverse")
  assert state.push(0, 0) == []
  assert state.push(1, 0) == [(0, 0), (0, 1)]
  state.note_pull(0, state.vector_clock())  # VW 0 gets (1, 1)
  state.push(0, 1)
  state.push(1, 1)
  assert [t for t, _ in state.staleness] == [0, 1, 0, 2]  # VW 1 never pulled: waves 0, 1 of VW 0
  assert [s for _, s in state.staleness] == [1.0, 0.5, 1.0, 1 / 3]


def test_one_vw_has_tau_zero_always():
  state = wsp.ParameterServerState(1, staleness_scaling="exp", staleness_alpha=2.0)
  for c in range(4):
    state.push(0, c)
  assert state.staleness == [(0, 1.0)] * 4


def test_none_is_bit_identical_to_adding_the_updates():
  """"none" adds each wave update as pushed (HetPipe §5), bit for bit, under both application modes."""
  rng = np.random.default_rng(1)
  w0 = rng.standard_normal(7).astype(np.float32)
  for ps_apply in wsp.PS_APPLY_MODES:
    ps = ParameterServer(w0, 2, ps_apply, staleness_scaling="none")
    pending, expected = {}, w0.copy()
    for vw, wave in [(0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (1, 2)]:
      delta = rng.standard_normal(7).astype(np.float32)
      pending[(wave, vw)] = delta
      count = ps.push(vw, wave, delta)
      for key in ps.state.applied[len(ps.state.applied) - count:]:
        expected += pending.pop(key)
    assert ps.weights.tobytes() == expected.tobytes()
    assert [t for t, _ in ps.state.staleness] != [0] * 6  # tau is measured, but not applied


def _config(data_dir, **overrides):
  c = tiny.get_config()
  c.update({"data_dir": str(data_dir), "check_counts": False, "progress": False, **overrides})
  return c


def test_virtual_time_inverse_equals_the_replay_with_the_recorded_scales(tmp_path, synthetic_data_dir):
  """Two VWs at different speeds, D = 1: the final global weights equal the sequential replay of the records whose
  global weights add each wave update times its recorded scale; the scales are 1/(1 + tau), some tau > 0, and the
  unscaled replay differs (the scaling really acted)."""
  num_vws, nm, mb, batch = 2, 2, 12, 16
  config = _config(synthetic_data_dir, num_virtual_workers=num_vws, num_inflight=nm, staleness_bound=1,
                   num_minibatches=mb, optimizer="momentum", learning_rate=0.05, batch_size=batch,
                   emulate_stage_ms="10,10;30,30", ps_staleness_scaling="inverse")
  summary = virtual_job.run(job_config.resolve_job(config, "virtual"), str(tmp_path))
  cfg = json.loads((tmp_path / "config.json").read_text())
  assert cfg["ps_staleness_scaling"] == summary["method_settings"]["ps_staleness_scaling"] == "inverse"
  applied = read_jsonl(tmp_path / "ps_applied.jsonl")
  taus = [a["tau"] for a in applied]
  assert [a["scale"] for a in applied] == pytest.approx([1 / (1 + t) for t in taus], rel=1e-12)
  assert max(taus) > 0, taus
  assert summary["ps_staleness"]["max_tau"] == max(taus)
  records = read_jsonl(tmp_path / "minibatches.jsonl")
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, num_vws, v, batch, 0) for v in range(num_vws)]
  tx = optax.sgd(0.05, momentum=0.9)
  order = read_applied_order(tmp_path)
  expected = replay_final_weights(records, spec, params0, tx, sources, nm, order,
                                  applied_scales=read_applied_scales(tmp_path))
  actual = ParamLayout.from_layer_params(params0).flatten(checkpoint.restore_weights(tmp_path / "checkpoint"))
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
  unscaled = replay_final_weights(records, spec, params0, tx, sources, nm, order)
  assert not np.allclose(actual, unscaled, rtol=1e-5, atol=1e-6)


def test_mpi_run_records_tau_and_scale(tmp_path, synthetic_data_dir):
  """PS + 2 VWs under MPI with "exp": every applied wave carries tau and exp(-alpha tau); config.json and
  summary.json agree on the setting."""
  workdir = tmp_path / "run"
  proc = run_job(workdir, 3, {"data_dir": synthetic_data_dir, "num_minibatches": 8, "num_inflight": 2,
                              "staleness_bound": 1, "ps_staleness_scaling": "exp", "ps_staleness_alpha": 0.5})
  assert proc.returncode == 0, proc.stderr[-3000:]
  applied = read_jsonl(workdir / "ps_applied.jsonl")
  assert len(applied) == 8
  for a in applied:
    assert a["tau"] >= 0 and a["scale"] == pytest.approx(math.exp(-0.5 * a["tau"]), rel=1e-12), a
  config = json.loads((workdir / "config.json").read_text())
  summary = json.loads((workdir / "summary.json").read_text())
  assert config["ps_staleness_scaling"] == summary["method_settings"]["ps_staleness_scaling"] == "exp"
  assert config["ps_staleness_alpha"] == summary["method_settings"]["ps_staleness_alpha"] == 0.5
  assert summary["ps_staleness"]["max_tau"] == max(a["tau"] for a in applied)


def _validated(c):
  s = job_config.resolve_settings(c)
  if s.num_ps_ranks:
    s = job_config.with_stage_ranks(c, job_config.with_ps_shards(c, s))
  return s


@pytest.mark.parametrize("overrides,match", [
    ({"ps_staleness_scaling": "exp", "ps_staleness_alpha": 0.0}, r"^config\.ps_staleness_alpha=0\.0 with "),
    ({"ps_staleness_scaling": "exp", "ps_staleness_alpha": -1.0}, r"^config\.ps_staleness_alpha=-1\.0 with "),
    ({"ps_staleness_scaling": "linear"}, r"^config\.ps_staleness_scaling='linear' is not a staleness scaling"),
    ({"ps_staleness_scaling": "inverse", "method": "gpipe"},
     r"^config\.ps_staleness_scaling='inverse' scales .* config\.method='gpipe' does not use"),
    ({"ps_staleness_scaling": "inverse", "method": "horovod", "num_stages": 1},
     r"^config\.ps_staleness_scaling='inverse' scales .* config\.method='horovod' does not use"),
    ({"ps_staleness_scaling": "inverse", "num_ps_shards": 2, "checkpoint_every_waves": 0,
      "eval_every_epochs": 0.0}, r"^config\.ps_staleness_scaling='inverse' with 2 PS shards"),
])
def test_bad_settings_are_one_error_each(overrides, match):
  c = tiny.get_config()
  c.update(overrides)
  with pytest.raises(ConfigError, match=match) as e:
    _validated(c)
  assert "\n" not in str(e.value)


def test_train_refuses_a_bad_setting_with_one_error_line(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "hetpipe_jax.train", "--mode=virtual", "--config=experiments/configs/tiny.py",
       f"--workdir={tmp_path / 'never'}", "--config.ps_staleness_scaling=exp", "--config.ps_staleness_alpha=0"],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "config.ps_staleness_alpha=0" in errors[0], proc.stderr[-2000:]
  assert not (tmp_path / "never").exists()


def test_clock_aligned_applies_the_scales():
  """clock_aligned holds wave updates and adds them times their scales once the wave is complete."""
  w0 = np.zeros(3, np.float32)
  ps = ParameterServer(w0, 2, "clock_aligned", staleness_scaling="inverse")
  ps.push(0, 0, np.ones(3, np.float32))
  ps.push(1, 0, np.full(3, 2.0, np.float32))  # tau 0 and 1: 1 * 1 + 0.5 * 2
  np.testing.assert_array_equal(ps.weights, np.full(3, 2.0, np.float32))


def test_pipedream_in_virtual_time_scales_its_waves(tmp_path, synthetic_data_dir):
  """PipeDream (per-stage updates, the same PS) runs with the setting and records tau and 1/(1 + tau) per wave."""
  config = _config(synthetic_data_dir, method="pipedream", num_virtual_workers=2, num_inflight=2, staleness_bound=1,
                   num_minibatches=8, batch_size=16, emulate_stage_ms="10,10;30,30", ps_staleness_scaling="inverse")
  summary = virtual_job.run(job_config.resolve_job(config, "virtual"), str(tmp_path))
  assert summary["method"] == "pipedream" and summary["method_settings"]["ps_staleness_scaling"] == "inverse"
  applied = read_jsonl(tmp_path / "ps_applied.jsonl")
  assert len(applied) == 8 and max(a["tau"] for a in applied) > 0
  assert [a["scale"] for a in applied] == pytest.approx([1 / (1 + a["tau"]) for a in applied], rel=1e-12)
