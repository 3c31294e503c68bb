"""Virtual-time training: real numerics in the engine's event order, checked against the sequential replay."""

import json

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
from hetpipe_jax.rules import wsp
from hetpipe_jax.runtime.param_layout import ParamLayout
from tests.mpi_util import max_clock_distance, read_jsonl
from tests.replay import read_applied_order, replay_final_weights


def _config(data_dir, **overrides):
  c = tiny.get_config()
  c.update({"data_dir": str(data_dir), "check_counts": False, "progress": False, **overrides})
  return c


def _check_bound_reached(summary, records, num_inflight, bound):
  """WSP bound D respected and reached: max global staleness is exactly D, max clock distance exactly D + 1."""
  staleness = [r["local_clock_at_injection"] - r["version_global_clock"] for r in records]
  assert max(staleness) == bound, sorted(set(staleness))
  assert summary["max_clock_distance"] == bound + 1
  assert max_clock_distance(records, num_inflight) == bound + 1  # the same, from the records' wave ends


@pytest.mark.parametrize("ps_apply", ["on_receipt", "clock_aligned"])
def test_virtual_time_run_equals_replay_of_its_versions(tmp_path, synthetic_data_dir, ps_apply):
  num_vws, nm, mb, batch = 3, 3, 18, 16
  config = _config(synthetic_data_dir, num_virtual_workers=num_vws, num_inflight=nm, staleness_bound=1,
                   num_minibatches=mb, optimizer="momentum", learning_rate=0.05, batch_size=batch,
                   emulate_stage_ms="10,10;20,20;40,40", save_task_trace=True, ps_apply=ps_apply)
  summary = virtual_job.run(job_config.resolve_job(config, "virtual"), str(tmp_path))
  assert summary["time_unit"] == "simulated seconds"
  assert summary["ps_apply"] == ps_apply
  records = read_jsonl(tmp_path / "minibatches.jsonl")
  assert len(records) == num_vws * mb
  _check_bound_reached(summary, records, nm, 1)
  extra = [wsp.extra_updates(r["version_vector_clock"], r["vw_id"]) for r in records]
  assert summary["extra_updates"]["minibatches_with_extra_updates"] == sum(e > 0 for e in extra)
  if ps_apply == "on_receipt":
    assert sum(e > 0 for e in extra) >= 3, extra  # faster VWs' newer waves really reached slower VWs' weights
  else:
    assert max(extra) == 0
  # The slowest VW (4x slower) sets the pace: at best one minibatch per 40 ms bottleneck-stage time.
  assert summary["simulated_time_s"] >= mb * 0.040
  spec = models.get_model("mlp_tiny")
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, num_vws, v, batch, 0) for v in range(num_vws)]
  expected = replay_final_weights(records, spec, params0, optax.sgd(0.05, momentum=0.9), sources, nm,
                                  read_applied_order(tmp_path))
  actual = ParamLayout.from_layer_params(params0).flatten(checkpoint.restore_weights(tmp_path / "checkpoint"))
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
  trace = json.loads((tmp_path / "trace.json").read_text())
  assert any(e.get("name") == "FB0" for e in trace["traceEvents"])
  assert (tmp_path / "gantt.png").stat().st_size > 10_000


def test_virtual_time_reaches_staleness_bound_two_without_wave_end_pulls(tmp_path, synthetic_data_dir):
  """D = 2, pulls only when the bound forces them, VW 2 eight times slower: the fast VWs run 2 waves ahead."""
  nm, mb = 2, 12
  config = _config(synthetic_data_dir, num_virtual_workers=3, num_inflight=nm, staleness_bound=2, num_minibatches=mb,
                   batch_size=16, pull_every_wave=False, emulate_stage_ms="5,5;5,5;40,40")
  summary = virtual_job.run(job_config.resolve_job(config, "virtual"), str(tmp_path))
  records = read_jsonl(tmp_path / "minibatches.jsonl")
  assert len(records) == 3 * mb
  _check_bound_reached(summary, records, nm, 2)


@pytest.mark.parametrize("num_vws,stage_ms", [(1, "10,20"), (2, "10,20")])
def test_both_ps_apply_modes_give_the_same_weights_with_one_vw_or_identical_vws_at_d0(tmp_path, synthetic_data_dir,
                                                                                     num_vws, stage_ms):
  """With one VW, or identical VWs at D = 0, no pull can see a wave beyond the global clock, so on_receipt and
  clock_aligned hold the same updates and give the same final weights."""
  weights, vector_clocks = {}, {}
  for mode in ("on_receipt", "clock_aligned"):
    config = _config(synthetic_data_dir, num_virtual_workers=num_vws, num_inflight=2, staleness_bound=0,
                     num_minibatches=12, optimizer="momentum", learning_rate=0.05, batch_size=16,
                     emulate_stage_ms=stage_ms, ps_apply=mode)
    summary = virtual_job.run(job_config.resolve_job(config, "virtual"), str(tmp_path / mode))
    assert summary["extra_updates"]["max_extra_updates"] == 0
    vector_clocks[mode] = [r["version_vector_clock"] for r in read_jsonl(tmp_path / mode / "minibatches.jsonl")]
    weights[mode] = checkpoint.restore_weights(tmp_path / mode / "checkpoint")
  assert vector_clocks["on_receipt"] == vector_clocks["clock_aligned"]
  for a, b in zip(jax.tree.leaves(weights["on_receipt"]), jax.tree.leaves(weights["clock_aligned"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
