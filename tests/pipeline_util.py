"""Helpers for pipeline tests: build one in-process VW and a sequential reference."""

from __future__ import annotations

import jax
import numpy as np
import optax

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.ps import param_server
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime import virtual_worker
from hetpipe_jax.runtime.param_layout import ParamLayout


def build_vw(data_dir, *, model="mlp_tiny", partition, num_inflight, staleness_bound=0, optimizer=None,
             batch_size=16, seed=0, pull_every_wave=True, num_vws=1, vw_id=0, server=None):
  """Returns ``(vw, source, initial per-layer params, optimizer, server)`` for an in-process VW."""
  spec = models.get_model(model)
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(seed)))
  layout = ParamLayout.from_layer_params(params0)
  tx = optimizer or optax.adam(1e-2)
  devices = jax.devices()[:len(partition)]
  stages = stages_lib.build_stages(spec, partition, devices, tx)
  dataset = fashion_mnist.load_fashion_mnist(data_dir, expected_counts=None)
  source = sharding.ShardedMinibatches(dataset, num_vws, vw_id, batch_size, seed)
  server = server or param_server.ParameterServer(layout.flatten(params0), num_vws)
  vw = virtual_worker.VirtualWorker(vw_id, stages, layout, params0, tx, num_inflight, staleness_bound,
                              param_server.LocalPSClient(server, vw_id), source.get, pull_every_wave=pull_every_wave)
  return vw, source, params0, tx, server


def loss_and_grad(spec):
  def loss(params, x, y):
    return stages_lib.cross_entropy_loss(models.apply_layers(spec.layers, params, x), y)
  return jax.jit(jax.value_and_grad(loss))


def sequential_replay(spec, params0, tx, batches, versions):
  """Plain single-device training where minibatch p's gradient is taken at the weights after ``versions[p]`` updates.

  Args:
    batches: list of (images, labels) in minibatch order.
    versions: per minibatch, how many local updates its weights include (``len(batches)`` entries).

  Returns:
    Final per-layer params (host).
  """
  grad_fn = loss_and_grad(spec)
  history = [params0]
  params, state = params0, tx.init(params0)
  for (x, y), m in zip(batches, versions):
    _, g = grad_fn(history[m], x, y)
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
    history.append(params)
  return jax.device_get(params)


def assert_params_close(actual, expected, rtol=1e-5, atol=1e-6):
  a, b = jax.tree.leaves(actual), jax.tree.leaves(expected)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
