"""The runtime's loss, gradients, training steps and test accuracy against references written apart from it.

Nothing here calls the runtime's loss (``stages.cross_entropy_loss``), ``models.apply_layers``,
``models.init_layer_params``, ``data.sharding`` or ``ParamLayout`` to build an expectation: the references are plain
numpy (float64) on ``mlp_tiny`` (flatten → dense 32 tanh → dense 32 tanh → dense 10, hetpipe_jax/models/mlp.py),
with a hand-written backward pass that is itself checked against finite differences, and hand-computed values on
tiny cases. The runtime is fed weights and minibatches built here.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import models
from hetpipe_jax.jobs import evaluation
from hetpipe_jax.ps import param_server
from hetpipe_jax.runtime import stages as stages_lib
from hetpipe_jax.runtime import virtual_worker
from hetpipe_jax.runtime.param_layout import ParamLayout

NUM_CLASSES = 10
IMAGE_SHAPE = (28, 28, 1)
HIDDEN = 32
LAYER_SIZES = ((784, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, NUM_CLASSES))  # mlp_tiny's dense layers 1..3

# ---------------------------------------------------------------------------------------------- numpy references


def reference_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
  """Mean over the batch of ``-log softmax(logits)[label]``. logits ``[b, classes]``, labels ``[b]``."""
  z = np.asarray(logits, np.float64)
  z = z - z.max(axis=1, keepdims=True)
  log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
  return float(-log_probs[np.arange(len(labels)), labels].mean())


def reference_accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
  """Fraction of rows whose largest logit is at the label."""
  return float(np.mean(np.argmax(logits, axis=1) == labels))


def mlp_tiny_params(rng: np.random.Generator) -> list:
  """mlp_tiny weights in the Flax params layout (layer 0 is the parameter-free Flatten), float32."""
  params = [{}]
  for fan_in, fan_out in LAYER_SIZES:
    params.append({"Dense_0": {"kernel": (rng.standard_normal((fan_in, fan_out)) / math.sqrt(fan_in)).astype(np.float32),
                               "bias": (0.1 * rng.standard_normal(fan_out)).astype(np.float32)}})
  return params


def _dense(params: list, i: int) -> tuple[np.ndarray, np.ndarray]:
  d = params[i]["Dense_0"]
  return np.asarray(d["kernel"], np.float64), np.asarray(d["bias"], np.float64)


def mlp_tiny_forward(params: list, images: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
  """Returns ``(logits [b, 10], [x, h1, h2])`` (the dense layers' inputs, kept for the backward)."""
  h = np.asarray(images, np.float64).reshape(len(images), -1)
  inputs = []
  for i in (1, 2, 3):
    inputs.append(h)
    w, b = _dense(params, i)
    h = h @ w + b
    if i < 3:
      h = np.tanh(h)
  return h, inputs


def mlp_tiny_loss_and_grads(params: list, images: np.ndarray, labels: np.ndarray) -> tuple[float, list]:
  """Mean cross-entropy and its gradient (hand-written backward), gradients in the params layout."""
  logits, inputs = mlp_tiny_forward(params, images)
  b = len(labels)
  z = logits - logits.max(axis=1, keepdims=True)
  probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
  delta = probs.copy()
  delta[np.arange(b), labels] -= 1.0
  delta /= b  # d(mean loss) / d logits
  grads = [{}, None, None, None]
  for i in (3, 2, 1):
    x = inputs[i - 1]
    w, _ = _dense(params, i)
    grads[i] = {"Dense_0": {"kernel": x.T @ delta, "bias": delta.sum(axis=0)}}
    if i > 1:
      delta = (delta @ w.T) * (1.0 - x ** 2)  # x = tanh(previous pre-activation)
  return reference_cross_entropy(logits, labels), grads


def reference_flatten(params: list) -> np.ndarray:
  """The PS layout written out: layers in order, in each the leaves bias then kernel (row-major)."""
  parts = [np.asarray(params[i]["Dense_0"][k], np.float64).ravel() for i in (1, 2, 3) for k in ("bias", "kernel")]
  return np.concatenate(parts)


def reference_sgd(params0: list, batches: list, versions: list[int], learning_rate: float) -> tuple[list, list]:
  """Plain SGD where minibatch p's gradient is taken at the weights after ``versions[p]`` updates.

  Returns:
    ``(final params, losses)``: float64 params; ``losses[p]`` is minibatch p's loss at the weights it used.
  """
  history = [jax.tree.map(lambda a: np.asarray(a, np.float64), params0)]
  params, losses = history[0], []
  for (x, y), m in zip(batches, versions):
    loss, g = mlp_tiny_loss_and_grads(history[m], x, y)
    losses.append(loss)
    params = jax.tree.map(lambda w, d: w - learning_rate * d, params, g)
    history.append(params)
  return params, losses


def _random_batches(rng: np.random.Generator, num: int, batch_size: int) -> list:
  return [(rng.uniform(0.0, 1.0, (batch_size,) + IMAGE_SHAPE).astype(np.float32),
           rng.integers(0, NUM_CLASSES, batch_size).astype(np.int32)) for _ in range(num)]


def _assert_trees_close(actual, expected, rtol, atol):
  a, e = jax.tree.leaves(actual), jax.tree.leaves(expected)
  assert len(a) == len(e)
  for x, y in zip(a, e):
    assert np.shape(x) == np.shape(y)
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------- the references


def test_reference_cross_entropy_and_accuracy_on_a_hand_case():
  # Row 0: logits (0, ln 2, 0), label 2: softmax = (1, 2, 1) / 4, loss -ln(1/4) = ln 4; argmax 1, wrong.
  # Row 1: logits (ln 3, 0, 0), label 0: softmax = (3, 1, 1) / 5, loss -ln(3/5) = ln(5/3); argmax 0, right.
  # Mean loss (ln 4 + ln(5/3)) / 2 = ln(20/3) / 2 = 0.948560...; accuracy 1/2.
  logits = np.array([[0.0, math.log(2.0), 0.0], [math.log(3.0), 0.0, 0.0]])
  labels = np.array([2, 0])
  assert reference_cross_entropy(logits, labels) == pytest.approx(0.9485599924429406, abs=1e-12)
  assert reference_accuracy(logits, labels) == 0.5
  # The runtime's loss gives the same mean.
  runtime = stages_lib.cross_entropy_loss(jax.numpy.asarray(logits, np.float32), jax.numpy.asarray(labels, np.int32))
  assert float(runtime) == pytest.approx(0.9485599924429406, rel=1e-6)


def test_runtime_loss_is_the_batch_mean_on_random_logits():
  rng = np.random.default_rng(1)
  logits = (3.0 * rng.standard_normal((16, NUM_CLASSES))).astype(np.float32)
  labels = rng.integers(0, NUM_CLASSES, 16).astype(np.int32)
  runtime = float(stages_lib.cross_entropy_loss(jax.numpy.asarray(logits), jax.numpy.asarray(labels)))
  assert runtime == pytest.approx(reference_cross_entropy(logits, labels), rel=1e-6)


def test_reference_gradient_matches_finite_differences():
  rng = np.random.default_rng(2)
  params = jax.tree.map(lambda a: np.asarray(a, np.float64), mlp_tiny_params(rng))
  (x, y), = _random_batches(rng, 1, 5)
  _, grads = mlp_tiny_loss_and_grads(params, x, y)
  eps = 1e-6
  for layer, name, index in [(1, "kernel", (300, 4)), (1, "bias", (7,)), (2, "kernel", (3, 30)), (2, "bias", (0,)),
                             (3, "kernel", (31, 9)), (3, "bias", (2,))]:
    leaf = params[layer]["Dense_0"][name]
    saved = leaf[index]
    leaf[index] = saved + eps
    up = reference_cross_entropy(mlp_tiny_forward(params, x)[0], y)
    leaf[index] = saved - eps
    down = reference_cross_entropy(mlp_tiny_forward(params, x)[0], y)
    leaf[index] = saved
    assert grads[layer]["Dense_0"][name][index] == pytest.approx((up - down) / (2 * eps), rel=1e-6, abs=1e-9)


# ---------------------------------------------------------------------------------------------- the runtime


def _stages(partition, optimizer):
  spec = models.get_model("mlp_tiny")
  return stages_lib.build_stages(spec, partition, jax.devices()[:len(partition)], optimizer)


@pytest.mark.parametrize("partition", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]])
def test_stage_functions_loss_and_gradients_match_reference(partition):
  rng = np.random.default_rng(3)
  params = mlp_tiny_params(rng)
  (x, y), = _random_batches(rng, 1, 8)
  stages = _stages(partition, optax.sgd(0.1))
  stage_params = [jax.device_put(params[a:b], st.device) for (a, b), st in zip(partition, stages)]
  act = jax.device_put(x, stages[0].device)
  vjps = []
  for st, p in zip(stages[:-1], stage_params):
    act, vjp = st.forward(p, act)
    vjps.append(vjp)
    act = jax.device_put(act, stages[st.stage_id + 1].device)
  loss, grad_last, grad_in = stages[-1].forward_backward(stage_params[-1], act,
                                                          jax.device_put(y, stages[-1].device))
  grads = list(jax.device_get(grad_last))
  for st, vjp in zip(reversed(stages[:-1]), reversed(vjps)):
    gp, grad_in = st.backward(vjp, jax.device_put(grad_in, st.device))
    grads = list(jax.device_get(gp)) + grads
  expected_loss, expected_grads = mlp_tiny_loss_and_grads(params, x, y)
  assert float(loss) == pytest.approx(expected_loss, rel=1e-5)
  _assert_trees_close(grads, expected_grads, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("num_inflight", [1, 3])
def test_vw_losses_and_sgd_weights_match_reference(num_inflight):
  """A VW trained with plain SGD on our weights and minibatches: every recorded loss, the final local weights and the
  PS's flat global weights equal numpy SGD replayed at the recorded versions."""
  rng = np.random.default_rng(4)
  params0 = mlp_tiny_params(rng)
  num_minibatches, batch_size, learning_rate = 12, 8, 0.2
  batches = _random_batches(rng, num_minibatches, batch_size)
  partition = [(0, 2), (2, 4)]
  tx = optax.sgd(learning_rate)
  layout = ParamLayout.from_layer_params(params0)
  server = param_server.ParameterServer(reference_flatten(params0).astype(np.float32), 1)
  vw = virtual_worker.VirtualWorker(_stages(partition, tx), layout, params0,
                                    virtual_worker.WSPSettings(0, 1, num_inflight), virtual_worker.UpdateSettings(tx),
                                    virtual_worker.VWHooks(lambda p: batches[p], param_server.LocalPSClient(server, 0)))
  vw.run(num_minibatches)
  versions = [r.version_local_updates for r in vw.records]
  assert [r.minibatch_id for r in vw.records] == list(range(num_minibatches))
  if num_inflight > 1:
    assert any(m < p for p, m in enumerate(versions))  # some minibatch really ran on stale weights
  expected, expected_losses = reference_sgd(params0, batches, versions, learning_rate)
  np.testing.assert_allclose([r.loss for r in vw.records], expected_losses, rtol=1e-5)
  _assert_trees_close(vw.layer_params(), expected, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(server.weights, reference_flatten(expected), rtol=1e-4, atol=1e-5)


def test_evaluator_matches_reference_on_random_weights():
  rng = np.random.default_rng(5)
  params = mlp_tiny_params(rng)
  images = rng.uniform(0.0, 1.0, (37,) + IMAGE_SHAPE).astype(np.float32)
  logits, _ = mlp_tiny_forward(params, images)
  labels = np.argmax(logits, axis=1).astype(np.int32)
  labels[::3] = (labels[::3] + 1) % NUM_CLASSES  # 13 of 37 wrong
  layout = ParamLayout.from_layer_params(params)
  evaluator = evaluation.Evaluator(models.get_model("mlp_tiny"), layout, images, labels, batch_size=16)
  result = evaluator.evaluate(reference_flatten(params).astype(np.float32))
  assert reference_accuracy(logits, labels) == pytest.approx(24 / 37)
  assert result["test_accuracy"] == pytest.approx(24 / 37, abs=1e-12)
  assert result["test_loss"] == pytest.approx(reference_cross_entropy(logits, labels), rel=1e-5)


def test_evaluator_hand_computed_accuracy_and_loss_with_a_padded_last_batch():
  """Weights that make the prediction a known function of pixel 0, 7 test images in batches of 3 (last one padded).

  Every weight is zero except: dense 1 kernel[0, 0] = 1, dense 2 kernel[0, 0] = 1, dense 3 kernel[0, 1] = 10 and
  dense 3 bias[0] = ln 2. An image with pixel 0 = v gets logits ``ln 2 * e_0 + 10 tanh(tanh(v)) * e_1``:

  * v = 0: softmax(ln 2, 0, ..., 0) = (2, 1, ..., 1) / 11: predicts class 0; loss ln(11/2) for label 0, ln 11 else;
  * v = 1: t = tanh(tanh(1)), Z = 2 + e^{10t} + 8: predicts class 1; loss ln Z - 10t for label 1, ln(Z/2) for label
    0, ln Z else.

  The padding examples (zero image, label 0) would each be a correct prediction with loss ln(11/2).
  """
  params = [{}] + [{"Dense_0": {"kernel": np.zeros(s, np.float32), "bias": np.zeros(s[1], np.float32)}}
                   for s in LAYER_SIZES]
  params[1]["Dense_0"]["kernel"][0, 0] = 1.0
  params[2]["Dense_0"]["kernel"][0, 0] = 1.0
  params[3]["Dense_0"]["kernel"][0, 1] = 10.0
  params[3]["Dense_0"]["bias"][0] = math.log(2.0)
  pixel = np.array([0, 1, 0, 1, 1, 0, 0], np.float32)
  labels = np.array([0, 1, 3, 0, 1, 0, 5], np.int32)
  images = np.zeros((7,) + IMAGE_SHAPE, np.float32)
  images[:, 0, 0, 0] = pixel
  # Right: examples 0 (v=0, label 0), 1 (v=1, label 1), 4 (v=1, label 1), 5 (v=0, label 0) -> 4/7.
  t = math.tanh(math.tanh(1.0))
  z = 2.0 + math.exp(10.0 * t) + 8.0
  losses = [math.log(11 / 2), math.log(z) - 10 * t, math.log(11), math.log(z / 2), math.log(z) - 10 * t,
            math.log(11 / 2), math.log(11)]
  evaluator = evaluation.Evaluator(models.get_model("mlp_tiny"), ParamLayout.from_layer_params(params), images,
                                   labels, batch_size=3)
  result = evaluator.evaluate(reference_flatten(params).astype(np.float32))
  assert result["test_accuracy"] == pytest.approx(4 / 7, abs=1e-12)
  assert result["test_loss"] == pytest.approx(sum(losses) / 7, rel=1e-5)
