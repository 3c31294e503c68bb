"""The memory model against facts: the paper's Horovod runs (HetPipe §8.3), a liveness replay of a stage, and
what the layers keep for their backward (issue 28)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # what profiler.stash_bytes reads

from experiments.paper import calibration
from experiments.paper import common
from hetpipe_jax.models import imagenet
from hetpipe_jax.models import load_model
from hetpipe_jax.models import layers as layers_lib
from hetpipe_jax.costs import cost_model
from hetpipe_jax.runtime import profiler

# HetPipe §8.3, Table 4 and Figure 4 (TensorFlow 1.12, fp32, batch 32 per GPU, §8.1): Horovod (the whole model on
# every GPU) ran VGG-19 on all 16 GPUs (V4R4Q4G4 column: 339 images/s), ResNet-152 on the TITAN V, TITAN RTX and
# Quadro P4000 (V4R4Q4: 415 images/s), and "for ResNet-152, the whole model is too large to be loaded into a
# single GPU with G type, and thus, Horovod uses only 12 GPUs" (Table 4: X).
PAPER_HOROVOD_FITS = [
    ("vgg19_imagenet", "TITAN V", True),
    ("vgg19_imagenet", "TITAN RTX", True),
    ("vgg19_imagenet", "Quadro P4000", True),
    ("vgg19_imagenet", "GeForce RTX 2060", True),
    ("resnet152_imagenet", "TITAN V", True),
    ("resnet152_imagenet", "TITAN RTX", True),
    ("resnet152_imagenet", "Quadro P4000", True),
    ("resnet152_imagenet", "GeForce RTX 2060", False),
]


@pytest.mark.parametrize("model,gpu_type,fits", PAPER_HOROVOD_FITS)
def test_horovod_whole_model_fits_where_the_paper_ran_it(model, gpu_type, fits):
  cluster = common.load_cluster()
  gpu = next(g for g in cluster.gpus() if g.gpu_type == gpu_type)
  assert calibration.horovod_fits(cluster, common.load_profile(model), [gpu]) is fits


def _replay_peak_beyond_stash(transient, stash, i, j):
  """Oracle: one minibatch through layers ``[i, j)``, forward then backward, one layer at a time. While layer k
  runs forward, the residuals of layers i..k-1 exist (k's are being made); while it runs backward, those of
  i..k (the later layers' are freed); it needs ``transient[k]`` more. Returns the peak minus the whole stash."""
  live, peak = 0.0, 0.0
  for k in range(i, j):
    peak = max(peak, live + transient[k])
    live += stash[k]
  for k in reversed(range(i, j)):
    peak = max(peak, live + transient[k])
    live -= stash[k]
  return peak - sum(stash[i:j])


@pytest.mark.parametrize("seed", range(10))
def test_workspace_beyond_stash_matches_a_liveness_replay(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 9))
  stash = rng.integers(0, 100, size=n).astype(float)
  transient = rng.integers(0, 300, size=n).astype(float)
  w = cost_model.workspace_beyond_stash(list(transient), np.concatenate([[0.0], np.cumsum(stash)]))
  for i in range(n):
    for j in range(i + 1, n + 1):
      assert w[i, j] == pytest.approx(_replay_peak_beyond_stash(transient, stash, i, j)), (i, j)
      assert w[i, j] >= transient[j - 1]  # the stage's last layer frees nothing before it runs
  assert np.all(np.tril(w) == 0)


def test_relu_keeps_only_a_mask_and_matches_flax_relu():
  x = jnp.array([[-2.0, -0.0, 0.0, 1e-30, 3.0, -1e-30]], jnp.float32)
  g = jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], jnp.float32)
  ours, vjp = jax.vjp(layers_lib.relu, x)
  ref, vjp_ref = jax.vjp(nn.relu, x)
  np.testing.assert_array_equal(ours, ref)
  np.testing.assert_array_equal(vjp(g)[0], vjp_ref(g)[0])  # gradient 0 at x = 0, as flax's
  res = [a for a, _ in saved_residuals(layers_lib.relu, x)]
  assert [(a.shape, a.dtype) for a in res] == [(x.shape, jnp.bool_)]
  # flax's relu keeps a full-size float32 array of zeros besides the mask: what the fix removes.
  ref_res = [a for a, _ in saved_residuals(nn.relu, x)]
  assert sorted(str(a.dtype) for a in ref_res) == ["bool", "float32"]


class _PlainNormReLU(nn.Module):
  """The reference: flax's GroupNorm and ReLU, differentiated by plain autodiff."""

  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.GroupNorm(num_groups=32)(x))


def test_rematerialised_norm_keeps_only_its_input_with_the_same_gradients():
  x = jax.random.normal(jax.random.key(0), (2, 4, 4, 64), jnp.float32)
  ours_mod, ref_mod = nn.remat(imagenet.NormReLU)(), _PlainNormReLU()
  params = ref_mod.init(jax.random.key(1), x)["params"]
  params = jax.tree.map(lambda p: p + jax.random.uniform(jax.random.key(2), p.shape), params)  # not 1 and 0
  assert jax.tree.structure(ours_mod.init(jax.random.key(1), x)["params"]) == jax.tree.structure(params)
  fn = lambda m: (lambda params, a: m.apply({"params": params}, a))  # profiler.stash_bytes drops "params"
  g = jax.random.normal(jax.random.key(3), x.shape)
  out, vjp = jax.vjp(fn(ours_mod), params, x)
  out_ref, vjp_ref = jax.vjp(fn(ref_mod), params, x)
  np.testing.assert_allclose(out, out_ref, rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(vjp(g)), jax.tree.leaves(vjp_ref(g))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  x_bytes = x.size * 4
  # Our stash counts the non-parameter residuals: the input alone; plain autodiff keeps 2 x, x - mean, the
  # ReLU's mask and its zeros (3.5 inputs here).
  assert profiler.stash_bytes(fn(ours_mod), params, x) == x_bytes
  assert profiler.stash_bytes(fn(ref_mod), params, x) > 3 * x_bytes


@pytest.mark.parametrize("strides,in_channels", [(1, 128), (1, 64)])
def test_bottleneck_keeps_what_fused_batch_norm_keeps(strides, in_channels):
  # A TensorFlow bottleneck with fused batch norm keeps, for its backward: its input (read by the first 1x1 conv
  # and the shortcut), each batch norm's input (FusedBatchNormGrad reads x and the saved mean / inverse deviation)
  # and each inner ReLU's output (ReluGrad reads it; it is the next conv's input): with f = features, h x w
  # positions, 4f + (f + f + 4f) + (f + f) = 12f values per position when the shortcut is the identity, and the
  # projection conv's output (4f) besides when it is not (its own input is the block's).
  f, h, w, b = 32, 8, 8, 2
  block = imagenet.Bottleneck(f, strides=strides)
  x = jax.ShapeDtypeStruct((b, h, w, in_channels), jnp.float32)
  params = jax.eval_shape(block.init, jax.random.key(0), x)["params"]
  fn = lambda params, a: block.apply({"params": params}, a)
  per_position = in_channels + (f + f + 4 * f) + (f + f) + (0 if in_channels == 4 * f else 4 * f)
  assert profiler.stash_bytes(fn, params, x) == b * h * w * per_position * 4


@pytest.mark.parametrize("model", ["vgg19_imagenet", "resnet152_imagenet"])
def test_saved_paper_profiles_hold_what_the_models_keep(model):
  # The facts above read the saved profiles: their stash, parameter and activation bytes must be the models' own
  # (traced afresh, no compilation), so a change to a model's layers cannot leave them stale.
  saved = common.load_profile(model)
  spec = load_model(model)
  x = jax.ShapeDtypeStruct((saved.batch_size,) + tuple(spec.input_shape), spec.input_dtype)
  for layer, prof in zip(spec.layers, saved.layers, strict=True):
    params = jax.eval_shape(layer.init, jax.random.key(0), x).get("params", {})
    fn = lambda params, a, layer=layer: layer.apply({"params": params}, a)
    y = jax.eval_shape(fn, params, x)
    assert (profiler.stash_bytes(fn, params, x), profiler.tree_bytes(params), profiler.tree_bytes(y)) == (
        prof.stash_bytes, prof.param_bytes, prof.output_activation_bytes), prof.name
    x = y
