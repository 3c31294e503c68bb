"""Test environment: CPU only, 8 forced host devices, set before anything imports jax."""

import os
import pathlib

# HETPIPE_TEST_PLATFORM=gpu (scripts/gpu_check.py's pytest_gpu step, with -m gpu) leaves the platform to JAX.
if os.environ.get("HETPIPE_TEST_PLATFORM", "cpu") != "gpu":
  os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# JAX's persistent compilation cache, shared by this process and every process it starts (MPI ranks, scripts, the
# mutation check's copies): the suite compiles the same small stage functions hundreds of times. Keyed by the HLO,
# the compile options and the jax version, so a changed (or mutated) function compiles anew.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402



def pytest_configure(config):
  config.addinivalue_line("markers", "slow: takes more than ~20 s")
  config.addinivalue_line("markers", "mpi: launches mpiexec")
  config.addinivalue_line("markers", "gpu: needs a GPU")
  config.addinivalue_line("markers", "mutation: the full mutation check (CI's own step; pytest.ini leaves it out, "
                          "-m mutation runs it)")


@pytest.fixture(scope="session")
def synthetic_data_dir(tmp_path_factory) -> pathlib.Path:
  """A small learnable dataset in the real Fashion-MNIST IDX format (512 train / 256 test images)."""
  from hetpipe_jax.data import synthetic
  return synthetic.write_synthetic_fashion_mnist(tmp_path_factory.mktemp("fmnist"), num_train=512, num_test=256)
