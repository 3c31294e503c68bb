"""Fashion-MNIST: IDX loading with validation, and evaluation batches (shards and order: ``data.sharding``).

Numpy only (no jax import) so that every layer can import it cheaply. The data order is a pure function of
``(seed, shard, minibatch_id)``: the pipelined runtime and the sequential reference both call
:func:`minibatch_indices`, so they see identical minibatches.
"""

from __future__ import annotations

import dataclasses
import gzip
import operator
import os
import pathlib
import struct
import zlib
from typing import Iterator, Sequence

from absl import logging
import numpy as np

from hetpipe_jax.data.example_dataset import ExampleCounts

ENV_DATA_DIR = "HETPIPE_DATA_DIR"
"""Environment variable naming a directory with the four Fashion-MNIST IDX files."""

DEFAULT_DATA_DIRS: tuple[pathlib.Path, ...] = (pathlib.Path("/usr/share/datasets/fashion-mnist"),)
"""Searched after ``data_dir`` and ``$HETPIPE_DATA_DIR`` (Debian package ``dataset-fashion-mnist``)."""

TRAIN_IMAGES = "train-images-idx3-ubyte"
TRAIN_LABELS = "train-labels-idx1-ubyte"
TEST_IMAGES = "t10k-images-idx3-ubyte"
TEST_LABELS = "t10k-labels-idx1-ubyte"
FILE_STEMS: tuple[str, ...] = (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)
"""IDX file names without ``.gz``; each may be stored gzipped (``<stem>.gz``, preferred) or uncompressed."""

IMAGES_MAGIC = 2051  # IDX: unsigned byte, 3 dimensions.
LABELS_MAGIC = 2049  # IDX: unsigned byte, 1 dimension.
IMAGE_HEIGHT = 28
IMAGE_WIDTH = 28
NUM_CLASSES = 10
FASHION_MNIST_COUNTS = (60000, 10000)
"""(train, test) example counts of the real dataset."""

_GET_FILES_HINT = ("apt-get install dataset-fashion-mnist, or download the four files from the Fashion-MNIST "
                   "repository (https://github.com/zalandoresearch/fashion-mnist, data/fashion/) into --data_dir")
_REPLACE_FILE_HINT = ("replace it with a good copy (apt-get install --reinstall dataset-fashion-mnist, or download it "
                      "again from the Fashion-MNIST repository)")
_PIXEL_MAX = 255.0


class DataError(ValueError):
  """A dataset file is missing, corrupt or inconsistent; the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class Dataset(ExampleCounts):
  """Fashion-MNIST as numpy arrays.

  Attributes:
    train_images: float32 ``[num_train, 28, 28, 1]``, pixel values scaled to [0, 1].
    train_labels: int32 ``[num_train]``, class ids in 0..9.
    test_images: float32 ``[num_test, 28, 28, 1]``, pixel values scaled to [0, 1].
    test_labels: int32 ``[num_test]``, class ids in 0..9.
    source_dir: directory the four IDX files were read from.
  """

  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  source_dir: pathlib.Path

  # The dataset interface (:class:`hetpipe_jax.data.dataset.ExampleDataset`): the same arrays under generic names;
  # its counts (num_train, num_eval) from ExampleCounts.
  train_inputs = property(operator.attrgetter("train_images"))
  train_targets = property(operator.attrgetter("train_labels"))
  eval_inputs = property(operator.attrgetter("test_images"))
  eval_targets = property(operator.attrgetter("test_labels"))

  @property
  def description(self) -> dict:
    return {"name": "fashion_mnist", "source": str(self.source_dir), "eval_split": "the 10,000-image test set"}


def _find_file(directory: pathlib.Path, stem: str) -> pathlib.Path | None:
  """Returns ``directory/<stem>.gz`` or ``directory/<stem>`` (first that is a file), else None."""
  for name in (stem + ".gz", stem):
    path = directory / name
    if path.is_file():
      return path
  return None


def _candidate_dirs(data_dir: str | os.PathLike[str] | None) -> list[tuple[str, pathlib.Path]]:
  """The search order as ``(how it was chosen, directory)`` pairs."""
  candidates = []
  if data_dir is not None and str(data_dir):
    candidates.append(("data_dir", pathlib.Path(data_dir)))
  env_dir = os.environ.get(ENV_DATA_DIR, "")
  if env_dir:
    candidates.append((f"${ENV_DATA_DIR}", pathlib.Path(env_dir)))
  for default_dir in DEFAULT_DATA_DIRS:
    candidates.append(("default", default_dir))
  return candidates


def find_data_dir(data_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
  """Finds the first directory that holds all four Fashion-MNIST IDX files.

  Search order: ``data_dir`` (if given and non-empty), then ``$HETPIPE_DATA_DIR`` (if set and non-empty), then
  :data:`DEFAULT_DATA_DIRS`. Each file may be gzipped (``train-images-idx3-ubyte.gz``) or uncompressed
  (``train-images-idx3-ubyte``).

  Args:
    data_dir: directory given by the user (e.g. ``--data_dir``), or None / ``""`` to skip it.

  Returns:
    The first searched directory that holds all four files.

  Raises:
    DataError: no searched directory holds all four files; the message lists every place searched, what was
      missing there, and how to get the files.
  """
  report = []
  for origin, directory in _candidate_dirs(data_dir):
    if not directory.is_dir():
      report.append(f"  {directory} ({origin}): no such directory")
      continue
    missing = [stem + "[.gz]" for stem in FILE_STEMS if _find_file(directory, stem) is None]
    if not missing:
      return directory
    report.append(f"  {directory} ({origin}): missing {', '.join(missing)}")
  raise DataError("Fashion-MNIST not found. Searched:\n" + "\n".join(report) +
                  f"\nNeeded files: {', '.join(s + '.gz' for s in FILE_STEMS)} (gzipped or uncompressed). "
                  f"To get them: {_GET_FILES_HINT}; or set ${ENV_DATA_DIR}.")


def _read_bytes(path: pathlib.Path) -> bytes:
  """Reads a file, decompressing it if its name ends in ``.gz``."""
  if path.suffix != ".gz":
    return path.read_bytes()
  try:
    with gzip.open(path, "rb") as f:
      return f.read()
  except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError.
    raise DataError(f"{path}: corrupt gzip file ({e}); {_REPLACE_FILE_HINT}.") from e


def _read_idx(path: pathlib.Path, magic: int) -> np.ndarray:
  """Reads one unsigned-byte IDX file and checks its magic number and size.

  Args:
    path: the IDX file (``.gz`` or uncompressed).
    magic: expected magic number, :data:`IMAGES_MAGIC` (3 dimensions) or :data:`LABELS_MAGIC` (1 dimension).

  Returns:
    uint8 array shaped as the header says: ``[n, rows, cols]`` for images, ``[n]`` for labels.

  Raises:
    DataError: corrupt gzip, wrong magic number, or a byte count that differs from the header's.
  """
  data = _read_bytes(path)
  if len(data) < 4:
    raise DataError(f"{path}: truncated file: {len(data)} bytes, expected at least a 4-byte IDX header; "
                    f"{_REPLACE_FILE_HINT}.")
  (found_magic,) = struct.unpack(">i", data[:4])
  if found_magic != magic:
    kind = "images" if magic == IMAGES_MAGIC else "labels"
    raise DataError(f"{path}: bad IDX magic number {found_magic}, expected {magic} ({kind} file); is this the "
                    f"right file? {_REPLACE_FILE_HINT}.")
  num_dims = magic & 0xFF
  header_bytes = 4 + 4 * num_dims
  if len(data) < header_bytes:
    raise DataError(f"{path}: truncated file: expected at least {header_bytes} header bytes, got {len(data)}; "
                    f"{_REPLACE_FILE_HINT}.")
  dims = struct.unpack(f">{num_dims}i", data[4:header_bytes])
  expected_bytes = header_bytes + int(np.prod(dims, dtype=np.int64))
  if len(data) != expected_bytes:
    problem = "truncated file" if len(data) < expected_bytes else "file longer than its header says"
    raise DataError(f"{path}: {problem}: expected {expected_bytes} bytes (header dims {list(dims)}), got "
                    f"{len(data)} bytes (uncompressed); {_REPLACE_FILE_HINT}.")
  return np.frombuffer(data, dtype=np.uint8, offset=header_bytes).reshape(dims)


def _load_split(directory: pathlib.Path, images_stem: str, labels_stem: str,
                expected_count: int | None) -> tuple[np.ndarray, np.ndarray]:
  """Loads and validates one split. Returns float32 ``[n, 28, 28, 1]`` images in [0, 1] and int32 ``[n]`` labels."""
  images_path = _find_file(directory, images_stem)
  labels_path = _find_file(directory, labels_stem)
  if images_path is None or labels_path is None:
    raise DataError(f"{directory}: missing {images_stem}[.gz] or {labels_stem}[.gz]; {_GET_FILES_HINT}.")
  images = _read_idx(images_path, IMAGES_MAGIC)
  labels = _read_idx(labels_path, LABELS_MAGIC)
  if images.shape[1:] != (IMAGE_HEIGHT, IMAGE_WIDTH):
    raise DataError(f"{images_path}: image size {images.shape[1]}x{images.shape[2]}, expected "
                    f"{IMAGE_HEIGHT}x{IMAGE_WIDTH}; this is not Fashion-MNIST. {_REPLACE_FILE_HINT}.")
  if images.shape[0] != labels.shape[0]:
    raise DataError(f"{images_path} holds {images.shape[0]} images but {labels_path} holds {labels.shape[0]} "
                    f"labels; the files come from different sets. {_REPLACE_FILE_HINT}.")
  if expected_count is not None and images.shape[0] != expected_count:
    raise DataError(f"{images_path}: {images.shape[0]} examples, expected {expected_count}; "
                    f"{_REPLACE_FILE_HINT}.")
  if labels.size and int(labels.max()) >= NUM_CLASSES:
    bad = int(np.argmax(labels >= NUM_CLASSES))
    raise DataError(f"{labels_path}: label {int(labels[bad])} at index {bad} is out of range 0..{NUM_CLASSES - 1}; "
                    f"{_REPLACE_FILE_HINT}.")
  images_f32 = (images.astype(np.float32) / np.float32(_PIXEL_MAX))[..., np.newaxis]
  return images_f32, labels.astype(np.int32)


def load_fashion_mnist(data_dir: str | os.PathLike[str] | None = None, *,
                       expected_counts: Sequence[int] | None = FASHION_MNIST_COUNTS) -> Dataset:
  """Loads and validates Fashion-MNIST from its four IDX files.

  Checks the IDX magic numbers (2051 images, 2049 labels), that each file's size matches its header, the
  image size (28x28), that images and labels count the same, the counts themselves and the label range 0..9.

  Args:
    data_dir: directory to look in first; see :func:`find_data_dir` for the search order.
    expected_counts: ``(num_train, num_test)`` to insist on, or None to accept any counts (small synthetic
      datasets in tests).

  Returns:
    A :class:`Dataset`; images float32 ``[n, 28, 28, 1]`` in [0, 1], labels int32 ``[n]``.

  Raises:
    DataError: the files are not found, or one is corrupt, truncated or inconsistent (the message names the
      file and the fix).
  """
  directory = find_data_dir(data_dir)
  train_count, test_count = (None, None) if expected_counts is None else expected_counts
  train_images, train_labels = _load_split(directory, TRAIN_IMAGES, TRAIN_LABELS, train_count)
  test_images, test_labels = _load_split(directory, TEST_IMAGES, TEST_LABELS, test_count)
  logging.info("[data] Fashion-MNIST from %s: %d train, %d test examples", directory, train_labels.shape[0],
               test_labels.shape[0])
  return Dataset(train_images, train_labels, test_images, test_labels, directory)


def iterate_eval_batches(images: np.ndarray, labels: np.ndarray,
                         batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Contiguous evaluation batches in order, including the last partial one (every example exactly once).

  Args:
    images: ``[n, 28, 28, 1]`` images.
    labels: ``[n]`` labels.
    batch_size: examples per batch; the last batch has ``n % batch_size`` examples if that is non-zero.

  Yields:
    ``(images[i:i + batch_size], labels[i:i + batch_size])`` for ``i = 0, batch_size, ...``.

  Raises:
    ValueError: ``batch_size < 1`` or images and labels differ in length (raised on the first ``next``).
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  if images.shape[0] != labels.shape[0]:
    raise ValueError(f"images ({images.shape[0]}) and labels ({labels.shape[0]}) differ in length")
  for start in range(0, images.shape[0], batch_size):
    yield images[start:start + batch_size], labels[start:start + batch_size]
