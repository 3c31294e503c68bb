"""Evaluation during the run with several PS shards (HetPipe §8.1 placement): each shard keeps its slice when its own
global clock reaches an evaluation clock, and the lead evaluates the weights assembled from every shard's slice, in
clock order (:class:`hetpipe_jax.mpi.ps_server.ParameterServerService`'s ``eval_shards``)."""

import json
import time

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.mpi import wire
from hetpipe_jax.ps.shards import ShardLayout
from tests.mpi_util import read_jsonl, run_job


@pytest.mark.mpi
def test_sharded_run_evaluates_during_training_the_weights_of_synchronous_sgd(tmp_path, synthetic_data_dir):
  """Two PS shards, 2 VWs, D = 0, Nm = 1, plain SGD, clock_aligned: every shard reaches clock c holding exactly every
  VW's waves below c (no VW computes wave c before every shard reached c), added in VW order. So the evaluations
  during the run (every 3 global-clock ticks of 8: clocks 3 and 6) are those of synchronous data-parallel SGD after
  3 and 6 steps, computed here apart (no PS, no pipeline, the whole eval set at once). The metrics lines come in
  clock order, evaluated at 3, 6 and at the end (8)."""
  from hetpipe_jax.models import apply_layers
  from tests.pipeline_util import loss_and_grad
  num_vws, steps, lr, batch = 2, 8, 0.1, 16
  workdir = tmp_path / "run"
  # 512 examples / 2 VWs / batch 16 = 16 waves per epoch (Nm = 1): 3 / 16 of an epoch is 3 waves
  proc = run_job(workdir, 4, {"data_dir": synthetic_data_dir, "num_ps_shards": 2, "checkpoint_every_waves": 0,
                              "num_virtual_workers": num_vws, "num_minibatches": steps, "num_inflight": 1,
                              "staleness_bound": 0, "optimizer": "sgd", "learning_rate": lr, "batch_size": batch,
                              "ps_apply": "clock_aligned", "eval_every_epochs": 3 / 16, "log_every_waves": 1})
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["num_ps_shards"] == 2
  evals = summary["evaluations"]
  assert [e["global_clock"] for e in evals] == [3, 6]
  metrics = read_jsonl(workdir / "metrics.jsonl")
  assert [m["global_clock"] for m in metrics] == list(range(1, steps + 1)) + [steps]
  assert [m["global_clock"] for m in metrics if "test_accuracy" in m] == [3, 6, steps]
  spec = models.get_model("mlp_tiny")
  params = jax.device_get(models.init_layer_params(spec, jax.random.key(0)))
  dataset = fashion_mnist.load_fashion_mnist(synthetic_data_dir, expected_counts=None)
  sources = [sharding.ShardedMinibatches(dataset, num_vws, v, batch, 0) for v in range(num_vws)]
  grad_fn, tx = loss_and_grad(spec), optax.sgd(lr)
  expected = {}
  for step in range(1, steps + 1):
    updates = [tx.update(grad_fn(params, *src.get(step - 1))[1], tx.init(params), params)[0] for src in sources]
    for u in updates:
      params = jax.device_get(optax.apply_updates(params, u))
    logits = apply_layers(spec.layers, params, dataset.eval_inputs)
    expected[step] = (float(np.mean(np.argmax(logits, -1) == dataset.eval_targets)),
                      float(optax.softmax_cross_entropy_with_integer_labels(logits, dataset.eval_targets).mean()))
  for e in evals + [{"global_clock": steps, **{k: summary[k] for k in ("test_accuracy", "test_loss")}}]:
    accuracy, loss = expected[e["global_clock"]]
    assert e["test_accuracy"] == accuracy, (e, accuracy)
    assert e["test_loss"] == pytest.approx(loss, rel=1e-5), (e, loss)
  assert expected[3] != expected[6]  # the two evaluations tell the clocks apart


def test_sharded_lead_evaluates_the_slices_every_shard_held_when_its_clock_reached_c():
  """Two PS shards (service loops on fake MPI), 2 VWs, evaluations every 2 global-clock ticks: VW 0 pushes its 4 waves,
  then VW 1 its 4. Shard 1 starts only once the lead applied everything, so every evaluation waits for shard 1's
  slice and the lead holds back its metrics lines. Oracle: each evaluated slice is W0 plus the prefix of that
  shard's application log up to the entry that brought its global clock to c (every VW's waves below c, here also
  all of VW 0's); the lines come in clock order, evaluated exactly at clocks 2 and 4."""
  import threading
  from hetpipe_jax.mpi.ps_client import MPIPSClient
  from hetpipe_jax.mpi.ps_server import ParameterServerService
  from hetpipe_jax.ps.param_server import ParameterServer
  from tests.fake_mpi import FakeWorld
  layout = ShardLayout.build([0, 2, 5, 6], [0, 1, 0], 2)  # shard 0: elements 0, 1, 5; shard 1: 2, 3, 4
  num_waves, every = 4, 2
  w0 = np.arange(6, dtype=np.float32) * 1000
  world = FakeWorld()
  lines, evaluated = [], []

  def evaluate(flat):
    evaluated.append(flat.copy())
    return {"test_accuracy": float(len(evaluated)), "test_loss": 0.0}

  def service(shard):
    server = ParameterServer(layout.gather(w0, shard).copy(), 2)
    return server, ParameterServerService(
        world.comm(shard), server, num_minibatches_per_vw=num_waves, num_inflight=1,
        evaluate=evaluate if shard == 0 else None, eval_every_waves=every, log_every_waves=1,
        log_metrics=lines.append, progress=False, first_vw_rank=2, lead=shard == 0, shard=shard,
        eval_shards=layout)
  (lead_server, lead), (shard1_server, shard1) = service(0), service(1)
  errors = []

  def run(svc):
    try:
      svc.run()
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  lead_thread = threading.Thread(target=run, args=(lead,), daemon=True)
  lead_thread.start()
  delta = lambda v, w: np.full(6, 2.0 ** (4 * v + w), np.float32)  # each wave's own bit: sums are exact
  for v in range(2):
    client = MPIPSClient(world.comm(2 + v), v, 6, 2, shards=layout, first_vw_rank=2)
    for w in range(num_waves):
      client.push(w, delta(v, w), 0.0, 1)
    client.finish(num_waves, {})
  deadline = time.monotonic() + 30
  while len(lead.reports) < 2 and time.monotonic() < deadline and not errors:
    time.sleep(1e-3)
  assert lead_server.global_clock == num_waves and not errors
  assert [line["global_clock"] for line in lines] == [1]  # clock 2's evaluation waits for shard 1, and 3-4 behind it
  shard1_thread = threading.Thread(target=run, args=(shard1,), daemon=True)
  shard1_thread.start()
  for t in (lead_thread, shard1_thread):
    t.join(30)
  assert not errors and not lead_thread.is_alive() and not shard1_thread.is_alive()
  assert [line["global_clock"] for line in lines] == [1, 2, 3, 4]
  assert [line["global_clock"] for line in lines if "test_accuracy" in line] == [2, 4]
  assert [e["global_clock"] for e in lead.log.evals] == [2, 4] and len(evaluated) == 2
  for shard, server in ((0, lead_server), (1, shard1_server)):
    log = list(server.state.applied)  # (wave, vw) in application order
    for flat, clock in zip(evaluated, (2, 4)):
      below = {(w, v) for w in range(clock) for v in range(2)}
      reached = next(i for i in range(len(log) + 1) if below <= set(log[:i]))
      expected = layout.gather(w0, shard) + sum(delta(v, w)[0] for w, v in log[:reached])
      np.testing.assert_array_equal(layout.gather(flat, shard), expected)
      if clock == 2:  # the case under test: the slices hold later waves (all of VW 0's)
        assert {(w, 0) for w in range(num_waves)} <= set(log[:reached])


def test_sharded_lead_refuses_a_slice_for_a_clock_without_evaluation_or_sent_twice():
  from mpi4py import MPI
  from hetpipe_jax.mpi.ps_server import ParameterServerService
  from hetpipe_jax.ps.param_server import ParameterServer
  from tests.fake_mpi import FakeWorld
  layout = ShardLayout.build([0, 2, 5], [0, 1], 2)
  world = FakeWorld()
  lead = ParameterServerService(world.comm(0), ParameterServer(np.zeros(2, np.float32), 1),
                                num_minibatches_per_vw=1, num_inflight=1, evaluate=lambda flat: {},
                                eval_every_waves=2, log_every_waves=1, log_metrics=lambda line: None,
                                progress=False, first_vw_rank=2, eval_shards=layout)
  sender = world.comm(1)
  for clock, message in ((3, r"global clock 3 \(evaluations every 2\)"), (2, None), (2, "global clock 2 twice")):
    sender.Isend(wire.make_header(wire.Kind.WEIGHTS, 0, wave=clock, size=3), dest=0, tag=wire.TAG_SHARD_EVAL)
    sender.Isend(np.zeros(3, np.float32), dest=0, tag=wire.TAG_SHARD_EVAL)
    if message is None:
      lead._take_eval_slices(MPI.Status(), MPI.ANY_SOURCE)  # pylint: disable=protected-access
      continue
    with pytest.raises(wire.ProtocolError, match=f"shard 1's slice for an evaluation at {message}"):
      lead._take_eval_slices(MPI.Status(), MPI.ANY_SOURCE)  # pylint: disable=protected-access
  sender.Isend(wire.make_header(wire.Kind.WEIGHTS, 0, wave=4, size=2), dest=0, tag=wire.TAG_SHARD_EVAL)
  with pytest.raises(wire.ProtocolError, match=r"rank 0 received from rank 1 a WEIGHTS header .*size 2 \(expected 3\)"):
    lead._take_eval_slices(MPI.Status(), MPI.ANY_SOURCE)  # pylint: disable=protected-access
