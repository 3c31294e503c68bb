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



@pytest.fixture(scope="session")
def stage_ranks_run(tmp_path_factory, synthetic_data_dir) -> pathlib.Path:
  """The workdir of one finished run under mpiexec, read by two tests (``tests/mpi_util.STAGE_RANKS_RUN``): 2 VWs x 3
  stages on separate ranks, 2 PS shards (8 ranks), VWs of unequal speed (emulated), Nm = 2, D = 1, SGD with momentum
  and the global-norm clip."""
  from tests.mpi_util import STAGE_RANKS_RUN
  return _shared_run(tmp_path_factory, "stage_ranks_run", 8, STAGE_RANKS_RUN, synthetic_data_dir)


def _shared_run(tmp_path_factory, name: str, num_ranks: int, overrides: dict, data_dir) -> pathlib.Path:
  from tests.mpi_util import run_job
  workdir = tmp_path_factory.mktemp(name) / "run"
  proc = run_job(workdir, num_ranks, {"data_dir": data_dir, **overrides}, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return workdir


@pytest.fixture(scope="session")
def three_rank_run(tmp_path_factory, synthetic_data_dir) -> pathlib.Path:
  """The workdir of one finished 3-rank run (1 PS, 2 VWs; ``tests/mpi_util.THREE_RANK_RUN``), read by two tests."""
  from tests.mpi_util import THREE_RANK_RUN
  return _shared_run(tmp_path_factory, "three_rank_run", 3, THREE_RANK_RUN, synthetic_data_dir)


@pytest.fixture(scope="session")
def sharded_run(tmp_path_factory, synthetic_data_dir) -> pathlib.Path:
  """The workdir of one finished run of the 2-node ED plan with 2 PS shards (4 ranks; ``tests/mpi_util.SHARDED_RUN``),
  read by two tests."""
  from tests.mpi_util import SHARDED_RUN
  return _shared_run(tmp_path_factory, "sharded_run", 4, SHARDED_RUN, synthetic_data_dir)


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> pathlib.Path:
  """A small English-like corpus in the layouts the text loader reads: two .txt files (one in a subdirectory) of words
  drawn from a 10-word vocabulary (learnable structure, so a few minibatches move the weights), and a binary file it
  skips."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  def corpus(num_bytes: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    words = [b"the", b"pipeline", b"virtual", b"worker", b"wave", b"of", b"stale", b"weights", b"is", b"bounded"]
    out = bytearray()
    while len(out) < num_bytes:
      out += b" ".join(words[i] for i in rng.integers(0, len(words), 12)) + b".\n"
    return bytes(out[:num_bytes])

  d = tmp_path_factory.mktemp("text")
  (d / "a.txt").write_bytes(corpus(30_000, 0))
  (d / "sub").mkdir()
  (d / "sub" / "b.txt").write_bytes(corpus(30_000, 1))
  (d / "b.dat").write_bytes(b"\x00\x01binary index")  # skipped: not text
  return d
