"""Test environment: CPU only, 8 forced host devices, set before anything imports jax."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pathlib  # noqa: E402

import pytest  # noqa: E402



def pytest_configure(config):
  config.addinivalue_line("markers", "slow: takes more than ~20 s")
  config.addinivalue_line("markers", "mpi: launches mpiexec")
  config.addinivalue_line("markers", "gpu: needs a GPU")


@pytest.fixture(scope="session")
def synthetic_data_dir(tmp_path_factory) -> pathlib.Path:
  """A small learnable dataset in the real Fashion-MNIST IDX format (512 train / 256 test images)."""
  from hetpipe_jax.data import synthetic
  return synthetic.write_synthetic_fashion_mnist(tmp_path_factory.mktemp("fmnist"), num_train=512, num_test=256)
