"""Profiler: per-layer bytes, cost analysis and measured times on CPU; ImageNet models planned unexecuted (§7)."""

import jax
import pytest

from hetpipe_jax.costs import profile_format
from hetpipe_jax.models import get_model
from hetpipe_jax.runtime import profiler


@pytest.fixture(scope="module")
def mlp_profile():
  return profiler.profile_model(get_model("mlp_tiny"), 8, measure=True, repeats=2, optimizer="adam")


def test_bytes_of_mlp_tiny(mlp_profile):
  flatten, d1, d2, d3 = mlp_profile.layers
  assert mlp_profile.input_activation_bytes == 8 * 28 * 28 * 4
  assert flatten.param_bytes == 0 and flatten.output_activation_bytes == 8 * 784 * 4
  assert d1.param_bytes == (784 * 32 + 32) * 4
  assert 0 <= d1.optimizer_state_bytes - 2 * d1.param_bytes <= 16  # adam: two moments + a step count
  assert d3.output_activation_bytes == 8 * 10 * 4
  assert d1.stash_bytes >= 8 * 784 * 4  # the backward needs the layer's input


def test_cost_analysis_and_times(mlp_profile):
  d1 = mlp_profile.layers[1]
  assert d1.fwd_flops >= 2 * 8 * 784 * 32
  assert d1.bwd_flops >= d1.fwd_flops
  assert all(l.fwd_time_ms > 0 and l.bwd_time_ms > 0 for l in mlp_profile.layers)
  assert mlp_profile.measured and mlp_profile.device_kind == "cpu"


def test_json_roundtrip_and_reuse(tmp_path, mlp_profile):
  path = str(tmp_path / "p.json")
  profile_format.save_profile(mlp_profile, path)
  assert profile_format.load_profile(path) == mlp_profile
  again = profiler.load_or_profile("mlp_tiny", 8, measure=True, path=path)  # reused, not re-measured
  assert again == mlp_profile


def test_unknown_optimizer():
  with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
    profiler.profile_model(get_model("mlp_tiny"), 8, measure=False, optimizer="lion")


def test_imagenet_models_are_registered_with_enough_blocks():
  resnet = get_model("resnet152_imagenet")
  vgg = get_model("vgg19_imagenet")
  assert resnet.num_layers >= 50 + 2 and resnet.input_shape == (224, 224, 3) and resnet.num_classes == 1000
  assert sum(type(l).__name__ == "Bottleneck" for l in resnet.layers) == 50
  assert vgg.num_layers == 25 and sum(type(l).__name__ == "ConvReLU" for l in vgg.layers) == 16


@pytest.mark.parametrize("model, mib", [("resnet152_imagenet", 230), ("vgg19_imagenet", 548)])
def test_saved_imagenet_profiles_match_the_papers_parameter_sizes(model, mib):
  prof = profile_format.load_profile(profile_format.default_profile_path(model, 32, "cpu", False))
  assert abs(sum(l.param_bytes for l in prof.layers) / 2**20 - mib) / mib < 0.02  # HetPipe §8.3: 230MB, 548MB
  assert prof.num_layers == get_model(model).num_layers
  x = jax.ShapeDtypeStruct((32, 224, 224, 3), jax.numpy.float32)
  assert prof.input_activation_bytes == x.size * 4
