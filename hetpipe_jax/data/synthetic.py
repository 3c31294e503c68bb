"""Synthetic Fashion-MNIST-format IDX files for tests: small, real file format, easy to learn."""

from __future__ import annotations

import gzip
import os
import pathlib
import struct

import numpy as np

from hetpipe_jax.data import fashion_mnist

_BACKGROUND_NOISE_MAX = 48  # uint8 noise in [0, 48) everywhere.
_STRIPE_BASE = 120  # Class c draws its cross at brightness _STRIPE_BASE + _STRIPE_STEP * c.
_STRIPE_STEP = 13
_STRIPE_WIDTH = 2
_STRIPE_OFFSET = 4  # Class c's stripes start at row / column _STRIPE_OFFSET + _STRIPE_WIDTH * c.


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
  """Encodes a uint8 array as an IDX file (big-endian header, then the raw bytes).

  Args:
    array: uint8 ``[n]`` labels or ``[n, rows, cols]`` images.
    magic: magic number to write; default ``0x0800 | array.ndim`` (2049 labels, 2051 images). Tests pass a
      wrong one on purpose.

  Returns:
    The file contents (uncompressed).

  Raises:
    ValueError: ``array`` is not uint8.
  """
  array = np.asarray(array)
  if array.dtype != np.uint8:
    raise ValueError(f"array must be uint8, got {array.dtype}")
  magic = 0x0800 | array.ndim if magic is None else magic
  header = struct.pack(f">i{array.ndim}i", magic, *array.shape)
  return header + np.ascontiguousarray(array).tobytes()


def write_file(path: str | os.PathLike[str], contents: bytes) -> pathlib.Path:
  """Writes ``contents`` to ``path``, gzipping it (deterministically, mtime 0) if the name ends in ``.gz``."""
  path = pathlib.Path(path)
  if path.suffix == ".gz":
    contents = gzip.compress(contents, mtime=0)
  path.write_bytes(contents)
  return path


def synthetic_examples(num_examples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """Learnable synthetic examples: class c is a bright cross at a class-specific place and brightness.

  Class ``c`` has a horizontal and a vertical stripe, 2 pixels wide, starting at row / column ``4 + 2c``,
  brightness ``120 + 13c``, over uniform noise in [0, 48). Position separates classes for dense models,
  brightness for models that pool globally.

  Args:
    num_examples: how many examples.
    rng: random generator (labels are balanced, then shuffled; noise).

  Returns:
    ``(images, labels)``: uint8 ``[num_examples, 28, 28]`` and uint8 ``[num_examples]`` in 0..9.
  """
  labels = rng.permutation(np.arange(num_examples) % fashion_mnist.NUM_CLASSES).astype(np.uint8)
  images = rng.integers(0, _BACKGROUND_NOISE_MAX,
                        size=(num_examples, fashion_mnist.IMAGE_HEIGHT, fashion_mnist.IMAGE_WIDTH), dtype=np.int32)
  for c in range(fashion_mnist.NUM_CLASSES):
    members = labels == c
    lo = _STRIPE_OFFSET + _STRIPE_WIDTH * c
    brightness = _STRIPE_BASE + _STRIPE_STEP * c
    block = images[members]
    block[:, lo:lo + _STRIPE_WIDTH, :] += brightness
    block[:, :, lo:lo + _STRIPE_WIDTH] += brightness
    images[members] = block
  return np.clip(images, 0, 255).astype(np.uint8), labels


def write_synthetic_fashion_mnist(directory: str | os.PathLike[str], num_train: int = 512, num_test: int = 256,
                                  seed: int = 0, compress: bool = True) -> pathlib.Path:
  """Writes the four Fashion-MNIST IDX files with synthetic, learnable contents.

  Load them with ``fashion_mnist.load_fashion_mnist(directory, expected_counts=None)``.

  Args:
    directory: where to write; created if missing.
    num_train: training examples.
    num_test: test examples.
    seed: seed for labels and noise (same seed, same bytes).
    compress: write ``<stem>.gz`` files if True, uncompressed ``<stem>`` files otherwise.

  Returns:
    ``directory`` as a Path.
  """
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  suffix = ".gz" if compress else ""
  for images_stem, labels_stem, count in ((fashion_mnist.TRAIN_IMAGES, fashion_mnist.TRAIN_LABELS, num_train),
                                          (fashion_mnist.TEST_IMAGES, fashion_mnist.TEST_LABELS, num_test)):
    images, labels = synthetic_examples(count, rng)
    write_file(directory / (images_stem + suffix), idx_bytes(images))
    write_file(directory / (labels_stem + suffix), idx_bytes(labels))
  return directory
