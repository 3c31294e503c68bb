"""Helpers for pipeline tests: build one in-process VW and a sequential reference."""

from __future__ import annotations

import jax
import numpy as np
import optax

from hetpipe_jax import models
from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.ps import param_server
from hetpipe_jax.runtime import objectives
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime import virtual_worker
from hetpipe_jax.runtime.param_layout import ParamLayout


def tiny_config(**overrides):
  """``experiments/configs/tiny.py``'s config with ``overrides`` set (each must name an existing field)."""
  from experiments.configs import tiny  # pylint: disable=g-import-not-at-top
  c = tiny.get_config()
  c.update(overrides)
  return c


def build_vw(data_dir, *, model="mlp_tiny", partition, num_inflight, staleness_bound=0, optimizer=None,
             batch_size=16, seed=0, pull_every_wave=True, num_vws=1, vw_id=0, server=None, client_factory=None,
             ps_apply="on_receipt", dataset=None, method="hetpipe", vertical_sync=False, max_held=None, stages=None,
             ps_channel="inline", delay_compensation="none", dc_lambda=0.04, **update_options):
  """Returns ``(vw, source, initial per-layer params, optimizer, server)`` for an in-process VW.

  ``dataset``: an already loaded dataset (e.g. text windows for a GPT) instead of Fashion-MNIST from ``data_dir``.

  ``client_factory(server, vw_id)`` builds the VW's PS client (default :class:`param_server.LocalPSClient`).

  ``stages``: an earlier VW's stages (same model, partition and optimizer) to reuse their compiled functions.

  ``ps_channel``: the VW's ``ps_channel`` (``"inline"``: these tests' scenarios were written for PS calls on the
  scheduler thread, e.g. a slow poll delaying it; tests/test_ps_channel.py reruns the oracles with ``"thread"``).

  ``update_options``: further :class:`~hetpipe_jax.runtime.update_rules.UpdateSettings` fields (e.g.
  ``weight_prediction`` with ``optimizer_step``, ``delay_scaled_lr``).
  """
  spec = models.get_model(model)
  params0 = jax.device_get(models.init_layer_params(spec, jax.random.key(seed)))
  layout = ParamLayout.from_layer_params(params0)
  tx = optimizer or optax.adam(1e-2)
  devices = jax.devices()[:len(partition)]
  if stages is None:
    stages = stages_lib.build_stages(spec, partition, devices, tx)
  if dataset is None:
    dataset = fashion_mnist.load_fashion_mnist(data_dir, expected_counts=None)
  source = sharding.ShardedMinibatches(dataset, num_vws, vw_id, batch_size, seed)
  server = server or param_server.ParameterServer(layout.flatten(params0), num_vws, ps_apply)
  client = (client_factory or param_server.LocalPSClient)(server, vw_id)
  vw = virtual_worker.VirtualWorker(
      stages, layout, params0,
      virtual_worker.WSPSettings(vw_id, num_vws, num_inflight, staleness_bound, pull_every_wave),
      virtual_worker.UpdateSettings(tx, method, vertical_sync=vertical_sync, max_held=max_held,
                                    delay_compensation=delay_compensation, dc_lambda=dc_lambda, **update_options),
      virtual_worker.VWHooks(source.get, client), host=virtual_worker.HostSettings(ps_channel=ps_channel))
  return vw, source, params0, tx, server


class LaggingPeerClient(param_server.LocalPSClient):
  """VW 0's in-process client on a two-VW server whose VW 1 is scripted: it pushes its given wave ``c - lag`` right
  after VW 0 pushes wave ``c``, so the global clock trails VW 0 by ``lag`` waves and VW 0 pulls global weights that
  lack its own pushed waves (HetPipe §5: those must be re-added locally).

  Args:
    server: a :class:`param_server.ParameterServer` for 2 VWs.
    vw_id: must be 0.
    peer_waves: VW 1's wave updates, float32 ``[num_params]`` each, pushed in order.
    lag: waves VW 1 trails VW 0 by (>= 1).
    hold_reply: optional ``() -> bool``; while it returns True an answered pull is held back (its weights as
      answered), for at most ``max_held_polls`` consecutive polls (so a VW blocked on the pull still gets it).
    max_held_polls: see ``hold_reply``.

  Attributes:
    pulls: per pull reply handed to VW 0, ``(vector clock, waves VW 0 had pushed when the PS answered it)`` (a held
      reply can be installed after VW 0 pushed more: several completions, a whole wave under load, can land between
      two polls).
  """

  def __init__(self, server, vw_id, *, peer_waves, lag=1, hold_reply=None, max_held_polls=200):
    assert vw_id == 0 and server.state.num_virtual_workers == 2
    super().__init__(server, vw_id)
    self.peer_waves = list(peer_waves)
    self.lag = lag
    self.hold_reply = hold_reply
    self.max_held_polls = max_held_polls
    self.pulls: list[tuple[tuple[int, ...], int]] = []
    self._held_reply = None
    self._held_pushed = 0
    self._held_polls = 0

  def _peer_push(self, wave_id: int) -> None:
    self.server.push(1, wave_id, self.peer_waves[wave_id])
    self.server.state.serve_pending_pulls()

  def push(self, wave_id, flat_delta, loss_sum, num_minibatches):
    super().push(wave_id, flat_delta, loss_sum, num_minibatches)
    if wave_id >= self.lag:
      self._peer_push(wave_id - self.lag)

  def poll_pull(self):
    if self._held_reply is None:
      self._held_reply = super().poll_pull()
      self._held_pushed = self.server.state.pushed_waves[0]
    if self._held_reply is None:
      return None
    if self.hold_reply is not None and self._held_polls < self.max_held_polls and self.hold_reply():
      self._held_polls += 1
      return None
    reply, self._held_reply, self._held_polls = self._held_reply, None, 0
    self.pulls.append((reply[0], self._held_pushed))
    return reply

  def finish(self) -> None:
    """VW 1 pushes its remaining waves (after VW 0's run), so the global weights hold every wave of both."""
    while self.server.state.pushed_waves[1] < len(self.peer_waves):
      self._peer_push(self.server.state.pushed_waves[1])


_STEP_FNS: dict = {}


def model_step_fn(spec, transform=jax.value_and_grad):
  """``jax.jit(transform(loss))`` of the whole model's loss ``(params, x, y)``, one per (model, transform): equal
  specs (a frozen dataclass of the same layers) share it, so the suite traces each model's step once rather than
  once per test (an unhashable spec gets its own)."""
  def loss(params, x, y):
    return objectives.get_objective(spec.objective).loss(models.apply_layers(spec.layers, params, x), y)
  try:
    fn = _STEP_FNS.get((spec, transform))
  except TypeError:
    return jax.jit(transform(loss))
  if fn is None:
    fn = _STEP_FNS[(spec, transform)] = jax.jit(transform(loss))
  return fn


def loss_and_grad(spec):
  """The whole model's jitted ``(params, x, y) -> (loss, per-layer grads)`` (shared: :func:`model_step_fn`)."""
  return model_step_fn(spec, jax.value_and_grad)


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


def pipedream_replay(spec, partition, params0, tx, batches, stage_versions):
  """Sequential replay of per-stage updates (PipeDream): minibatch q's gradient is taken with stage s at its weights
  after ``stage_versions[q][s]`` of its own updates; then every stage applies its own optimizer step with its part
  of that gradient, minibatches in order (each stage updates in minibatch order).

  Returns:
    Final per-layer params (host).
  """
  grad_fn = loss_and_grad(spec)
  hist = [[list(params0[i:j])] for i, j in partition]
  states = [tx.init(list(params0[i:j])) for i, j in partition]
  for (x, y), versions in zip(batches, stage_versions):
    used = [layer for s, v in enumerate(versions) for layer in hist[s][v]]
    _, g = grad_fn(used, x, y)
    for s, (i, j) in enumerate(partition):
      updates, states[s] = tx.update(list(g[i:j]), states[s], hist[s][-1])
      hist[s].append(jax.device_get(optax.apply_updates(hist[s][-1], updates)))
  return [layer for h in hist for layer in h[-1]]
