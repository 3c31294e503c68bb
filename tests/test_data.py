"""Tests for hetpipe_jax.data: IDX loading and validation, sharding, minibatch order, eval batches."""

from __future__ import annotations

import gzip
import pathlib
import re

import numpy as np
import pytest

from hetpipe_jax.data import fashion_mnist, sharding
from hetpipe_jax.data import synthetic

_REAL_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def _isolated_search_path(monkeypatch, tmp_path):
  """No test sees the machine's $HETPIPE_DATA_DIR or real dataset unless it asks for them."""
  monkeypatch.delenv(fashion_mnist.ENV_DATA_DIR, raising=False)
  monkeypatch.setattr(fashion_mnist, "DEFAULT_DATA_DIRS", (tmp_path / "no_default_dataset",))


@pytest.fixture
def synth_dir(tmp_path):
  return synthetic.write_synthetic_fashion_mnist(tmp_path / "synth", num_train=120, num_test=50, seed=3)


def _raw(path: pathlib.Path) -> bytes:
  return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


def _load(directory):
  return fashion_mnist.load_fashion_mnist(directory, expected_counts=None)


# ---- Round trip --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [True, False])
def test_synthetic_round_trip(tmp_path, compress):
  directory = synthetic.write_synthetic_fashion_mnist(tmp_path, num_train=64, num_test=30, compress=compress)
  ds = _load(directory)
  assert ds.source_dir == directory
  assert ds.train_images.shape == (64, 28, 28, 1) and ds.train_images.dtype == np.float32
  assert ds.test_images.shape == (30, 28, 28, 1) and ds.test_images.dtype == np.float32
  assert ds.train_labels.shape == (64,) and ds.train_labels.dtype == np.int32
  assert ds.test_labels.shape == (30,) and ds.test_labels.dtype == np.int32
  assert 0.0 <= ds.train_images.min() and ds.train_images.max() <= 1.0
  suffix = ".gz" if compress else ""
  raw_images = np.frombuffer(_raw(directory / (fashion_mnist.TRAIN_IMAGES + suffix)), np.uint8, offset=16)
  raw_labels = np.frombuffer(_raw(directory / (fashion_mnist.TRAIN_LABELS + suffix)), np.uint8, offset=8)
  np.testing.assert_array_equal(np.rint(ds.train_images * 255).astype(np.uint8).ravel(), raw_images)
  np.testing.assert_array_equal(ds.train_labels, raw_labels)
  assert set(np.unique(ds.train_labels)) == set(range(10))


def test_synthetic_is_deterministic_and_class_separable(tmp_path):
  a = synthetic.write_synthetic_fashion_mnist(tmp_path / "a", seed=7)
  b = synthetic.write_synthetic_fashion_mnist(tmp_path / "b", seed=7)
  for stem in fashion_mnist.FILE_STEMS:
    assert (a / (stem + ".gz")).read_bytes() == (b / (stem + ".gz")).read_bytes()
  ds = _load(a)
  # Nearest class mean on the training set classifies the test set perfectly: the signal is strong.
  means = np.stack([ds.train_images[ds.train_labels == c].mean(0) for c in range(10)])
  dists = ((ds.test_images[:, None] - means[None]) ** 2).sum(axis=(2, 3, 4))
  assert (dists.argmin(1) == ds.test_labels).mean() == 1.0


def test_default_expected_counts_reject_small_dataset(synth_dir):
  with pytest.raises(fashion_mnist.DataError, match=r"120 examples, expected 60000"):
    fashion_mnist.load_fashion_mnist(synth_dir)


# ---- Validation errors -------------------------------------------------------------------------------------------


def test_bad_magic(synth_dir):
  labels = np.zeros(120, np.uint8)
  path = synthetic.write_file(synth_dir / (fashion_mnist.TRAIN_LABELS + ".gz"), synthetic.idx_bytes(labels, 2051))
  with pytest.raises(fashion_mnist.DataError,
                     match=rf"{re.escape(str(path))}: bad IDX magic number 2051, expected 2049"):
    _load(synth_dir)


def test_truncated_file(synth_dir):
  path = synth_dir / (fashion_mnist.TRAIN_IMAGES + ".gz")
  contents = _raw(path)
  synthetic.write_file(path, contents[:-100])
  expected = 16 + 120 * 28 * 28
  with pytest.raises(fashion_mnist.DataError,
                     match=rf"{re.escape(str(path))}: truncated file: expected {expected} bytes.*"
                     rf"got {expected - 100} bytes"):
    _load(synth_dir)


def test_truncated_header(synth_dir):
  path = synthetic.write_file(synth_dir / (fashion_mnist.TEST_LABELS + ".gz"), b"\x00\x00")
  with pytest.raises(fashion_mnist.DataError, match=rf"{re.escape(str(path))}: truncated file: 2 bytes"):
    _load(synth_dir)


def test_file_longer_than_header(synth_dir):
  path = synth_dir / (fashion_mnist.TEST_LABELS + ".gz")
  synthetic.write_file(path, _raw(path) + b"\x01\x02")
  with pytest.raises(fashion_mnist.DataError, match=r"file longer than its header says: expected 58 bytes .* got 60"):
    _load(synth_dir)


def test_label_out_of_range(synth_dir):
  labels = np.full(50, 3, np.uint8)
  labels[17] = 10
  path = synthetic.write_file(synth_dir / (fashion_mnist.TEST_LABELS + ".gz"), synthetic.idx_bytes(labels))
  with pytest.raises(fashion_mnist.DataError,
                     match=rf"{re.escape(str(path))}: label 10 at index 17 is out of range 0..9"):
    _load(synth_dir)


def test_wrong_image_size(synth_dir):
  path = synthetic.write_file(synth_dir / (fashion_mnist.TRAIN_IMAGES + ".gz"),
                                 synthetic.idx_bytes(np.zeros((120, 27, 28), np.uint8)))
  with pytest.raises(fashion_mnist.DataError, match=rf"{re.escape(str(path))}: image size 27x28, expected 28x28"):
    _load(synth_dir)


def test_image_label_count_mismatch(synth_dir):
  synthetic.write_file(synth_dir / (fashion_mnist.TRAIN_LABELS + ".gz"), synthetic.idx_bytes(np.zeros(119, np.uint8)))
  with pytest.raises(fashion_mnist.DataError,
                     match=r"holds 120 images but .*train-labels-idx1-ubyte.gz holds 119 labels"):
    _load(synth_dir)


def test_corrupt_gzip(synth_dir):
  path = synth_dir / (fashion_mnist.TRAIN_IMAGES + ".gz")
  path.write_bytes(b"this is not gzip data at all")
  with pytest.raises(fashion_mnist.DataError, match=rf"{re.escape(str(path))}: corrupt gzip file.*reinstall"):
    _load(synth_dir)


def test_truncated_gzip_stream(synth_dir):
  path = synth_dir / (fashion_mnist.TRAIN_IMAGES + ".gz")
  path.write_bytes(path.read_bytes()[:200])
  with pytest.raises(fashion_mnist.DataError, match=rf"{re.escape(str(path))}: corrupt gzip file"):
    _load(synth_dir)


# ---- Finding the directory ---------------------------------------------------------------------------------------


def test_missing_everywhere_lists_search_locations(tmp_path, monkeypatch):
  given = tmp_path / "given"
  given.mkdir()
  synthetic.write_file(given / (fashion_mnist.TRAIN_IMAGES + ".gz"), synthetic.idx_bytes(np.zeros(1, np.uint8)))
  env_dir = tmp_path / "from_env"
  monkeypatch.setenv(fashion_mnist.ENV_DATA_DIR, str(env_dir))
  with pytest.raises(fashion_mnist.DataError) as info:
    fashion_mnist.find_data_dir(given)
  message = str(info.value)
  assert isinstance(info.value, ValueError)
  assert f"{given} (data_dir): missing train-labels-idx1-ubyte[.gz], t10k-images" in message
  assert "train-images-idx3-ubyte[.gz]," not in message.split("(data_dir)")[1].split("\n")[0]
  assert f"{env_dir} ($HETPIPE_DATA_DIR): no such directory" in message
  assert f"{fashion_mnist.DEFAULT_DATA_DIRS[0]} (default): no such directory" in message
  assert "apt-get install dataset-fashion-mnist" in message
  assert "Fashion-MNIST repository" in message and "--data_dir" in message


def test_env_dir_used_when_no_data_dir(synth_dir, monkeypatch):
  monkeypatch.setenv(fashion_mnist.ENV_DATA_DIR, str(synth_dir))
  assert fashion_mnist.find_data_dir(None) == synth_dir
  assert fashion_mnist.find_data_dir("") == synth_dir
  assert _load(None).source_dir == synth_dir


def test_data_dir_beats_env_and_env_beats_default(tmp_path, monkeypatch):
  given = synthetic.write_synthetic_fashion_mnist(tmp_path / "given", num_train=20, num_test=10)
  env_dir = synthetic.write_synthetic_fashion_mnist(tmp_path / "env", num_train=20, num_test=10)
  default = synthetic.write_synthetic_fashion_mnist(tmp_path / "default", num_train=20, num_test=10)
  monkeypatch.setattr(fashion_mnist, "DEFAULT_DATA_DIRS", (default,))
  assert fashion_mnist.find_data_dir(None) == default
  monkeypatch.setenv(fashion_mnist.ENV_DATA_DIR, str(env_dir))
  assert fashion_mnist.find_data_dir(None) == env_dir
  assert fashion_mnist.find_data_dir(given) == given
  # A directory with only some of the files is skipped.
  (given / (fashion_mnist.TEST_LABELS + ".gz")).unlink()
  assert fashion_mnist.find_data_dir(given) == env_dir


def test_gz_and_plain_files_may_be_mixed(synth_dir):
  path = synth_dir / (fashion_mnist.TEST_LABELS + ".gz")
  (synth_dir / fashion_mnist.TEST_LABELS).write_bytes(_raw(path))
  path.unlink()
  assert _load(synth_dir).test_labels.shape == (50,)


# ---- Sharding and minibatch order --------------------------------------------------------------------------------


@pytest.mark.parametrize("num_examples,num_shards,seed", [(100, 1, 0), (100, 3, 0), (101, 4, 5), (60000, 7, 123)])
def test_shards_disjoint_equal_size(num_examples, num_shards, seed):
  shards = [sharding.shard_indices(num_examples, num_shards, i, seed) for i in range(num_shards)]
  size = num_examples // num_shards
  assert all(s.shape == (size,) for s in shards)
  union = np.concatenate(shards)
  assert np.unique(union).size == union.size == size * num_shards
  assert union.min() >= 0 and union.max() < num_examples
  np.testing.assert_array_equal(shards[-1], sharding.shard_indices(num_examples, num_shards, num_shards - 1, seed))


def test_shards_depend_on_seed():
  assert not np.array_equal(sharding.shard_indices(1000, 2, 0, 0), sharding.shard_indices(1000, 2, 0, 1))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_examples=10, num_shards=0, shard_id=0, seed=0), "num_shards must be >= 1"),
    (dict(num_examples=10, num_shards=2, shard_id=2, seed=0), r"shard_id must be in \[0, 2\)"),
    (dict(num_examples=10, num_shards=2, shard_id=0, seed=-1), "seed must be >= 0"),
    (dict(num_examples=3, num_shards=4, shard_id=0, seed=0), r"num_examples \(3\) must be >= num_shards \(4\)"),
])
def test_shard_indices_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sharding.shard_indices(**kwargs)


def test_batches_per_epoch():
  assert sharding.batches_per_epoch(100, 32) == 3
  assert sharding.batches_per_epoch(96, 32) == 3
  with pytest.raises(ValueError, match="batch_size must be >= 1"):
    sharding.batches_per_epoch(10, 0)
  with pytest.raises(ValueError, match=r"batch_size \(11\) is larger than the shard \(10 examples\)"):
    sharding.batches_per_epoch(10, 11)


def test_minibatch_indices_deterministic_and_epoch_coverage():
  shard = sharding.shard_indices(1000, 3, 1, seed=9)
  per_epoch = sharding.batches_per_epoch(shard.size, 32)
  assert per_epoch == 10
  for epoch in range(3):
    batches = [sharding.minibatch_indices(shard, 32, epoch * per_epoch + i, 9) for i in range(per_epoch)]
    again = [sharding.minibatch_indices(shard.copy(), 32, epoch * per_epoch + i, 9) for i in range(per_epoch)]
    for b, a in zip(batches, again):
      np.testing.assert_array_equal(b, a)
    seen = np.concatenate(batches)
    assert seen.shape == (320,) and np.unique(seen).size == 320
    assert np.isin(seen, shard).all()
  # Epochs are reshuffled, different shards and seeds give different orders.
  assert not np.array_equal(sharding.minibatch_indices(shard, 32, 0, 9),
                            sharding.minibatch_indices(shard, 32, per_epoch, 9))
  assert not np.array_equal(sharding.minibatch_indices(shard, 32, 0, 9), sharding.minibatch_indices(shard, 32, 0, 10))
  # The epoch permutation is shard-specific: two equal-size shards are not visited in the same positional order.
  other = sharding.shard_indices(1000, 3, 2, seed=9)

  def positions_in_shard(s):
    where = {int(v): i for i, v in enumerate(s)}
    return [where[int(v)] for v in sharding.minibatch_indices(s, 32, 0, 9)]

  assert positions_in_shard(shard) != positions_in_shard(other)


def test_minibatch_indices_errors():
  shard = np.arange(10)
  with pytest.raises(ValueError, match="minibatch_id must be >= 0"):
    sharding.minibatch_indices(shard, 2, -1, 0)
  with pytest.raises(ValueError, match="shard must be a 1-D index array"):
    sharding.minibatch_indices(shard.reshape(2, 5), 2, 0, 0)
  with pytest.raises(ValueError, match=r"batch_size \(11\) is larger than the shard"):
    sharding.minibatch_indices(shard, 11, 0, 0)


def test_sharded_minibatches_match_pure_function(synth_dir):
  ds = _load(synth_dir)
  batches = sharding.ShardedMinibatches(ds, num_shards=2, shard_id=1, batch_size=16, seed=4)
  assert batches.shard_size == 60 and batches.num_batches_per_epoch == 3
  for minibatch_id in [0, 1, 2, 3, 7, 2, 0]:
    images, labels = batches.get(minibatch_id)
    idx = sharding.minibatch_indices(sharding.shard_indices(120, 2, 1, 4), 16, minibatch_id, 4)
    assert images.shape == (16, 28, 28, 1) and images.dtype == np.float32
    assert labels.shape == (16,) and labels.dtype == np.int32
    np.testing.assert_array_equal(images, ds.train_images[idx])
    np.testing.assert_array_equal(labels, ds.train_labels[idx])


# ---- Evaluation batches ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,batch_size", [(50, 16), (48, 16), (5, 16)])
def test_eval_batches_cover_all_once(n, batch_size):
  images = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1) * np.ones((1, 28, 28, 1), np.float32)
  labels = np.arange(n, dtype=np.int32)
  batches = list(fashion_mnist.iterate_eval_batches(images, labels, batch_size))
  assert len(batches) == -(-n // batch_size)
  assert all(b[0].shape[0] == b[1].shape[0] for b in batches)
  assert all(b[1].shape[0] == batch_size for b in batches[:-1])
  np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), labels)
  np.testing.assert_array_equal(np.concatenate([b[0] for b in batches]), images)


def test_eval_batches_errors():
  with pytest.raises(ValueError, match="batch_size must be >= 1"):
    next(fashion_mnist.iterate_eval_batches(np.zeros((3, 28, 28, 1)), np.zeros(3), 0))
  with pytest.raises(ValueError, match=r"images \(3\) and labels \(2\) differ in length"):
    next(fashion_mnist.iterate_eval_batches(np.zeros((3, 28, 28, 1)), np.zeros(2), 1))


# ---- Imports and the real dataset --------------------------------------------------------------------------------


def test_data_module_does_not_import_jax():
  source = pathlib.Path(fashion_mnist.__file__).read_text()
  assert not re.search(r"^\s*(import|from)\s+(jax|flax)\b", source, flags=re.MULTILINE)


@pytest.mark.skipif(not _REAL_DIR.is_dir(), reason="dataset-fashion-mnist is not installed")
def test_real_fashion_mnist(monkeypatch):
  monkeypatch.setattr(fashion_mnist, "DEFAULT_DATA_DIRS", (_REAL_DIR,))
  ds = fashion_mnist.load_fashion_mnist()
  assert ds.source_dir == _REAL_DIR
  assert ds.train_images.shape == (60000, 28, 28, 1) and ds.train_images.dtype == np.float32
  assert ds.test_images.shape == (10000, 28, 28, 1)
  assert 0.0 <= ds.train_images.min() and ds.train_images.max() == 1.0
  np.testing.assert_array_equal(np.bincount(ds.train_labels, minlength=10), np.full(10, 6000))
  np.testing.assert_array_equal(np.bincount(ds.test_labels, minlength=10), np.full(10, 1000))
