"""Per-virtual-worker shards and the seeded minibatch order (a pure function of seed, shard, minibatch).

Numpy only. The pipelined runtime and the sequential references both call :func:`minibatch_indices`, so
they see identical minibatches.
"""

from __future__ import annotations

from typing import Any
import zlib

import numpy as np

_SHARD_SALT = 0x5348  # Separates the sharding stream from the per-epoch minibatch streams.


def shard_indices(num_examples: int, num_shards: int, shard_id: int, seed: int) -> np.ndarray:
  """The training examples of one shard (one per virtual worker / data-parallel replica).

  A seed-determined permutation of ``range(num_examples)`` is cut into ``num_shards`` disjoint shards of
  ``num_examples // num_shards`` examples each; the remainder is dropped so every shard has the same size.

  Args:
    num_examples: size of the training set.
    num_shards: number of shards (e.g. virtual workers).
    shard_id: which shard, in ``[0, num_shards)``.
    seed: non-negative data seed; the same seed gives the same shards.

  Returns:
    int64 ``[num_examples // num_shards]`` example indices.

  Raises:
    ValueError: ``num_shards < 1``, ``shard_id`` out of range, ``seed < 0`` or fewer examples than shards.
  """
  if num_shards < 1:
    raise ValueError(f"num_shards must be >= 1, got {num_shards}")
  if not 0 <= shard_id < num_shards:
    raise ValueError(f"shard_id must be in [0, {num_shards}), got {shard_id}")
  if seed < 0:
    raise ValueError(f"seed must be >= 0, got {seed}")
  if num_examples < num_shards:
    raise ValueError(f"num_examples ({num_examples}) must be >= num_shards ({num_shards})")
  permutation = np.random.default_rng(np.random.SeedSequence([seed, _SHARD_SALT])).permutation(num_examples)
  shard_size = num_examples // num_shards
  return permutation[shard_id * shard_size:(shard_id + 1) * shard_size].astype(np.int64)


def batches_per_epoch(shard_size: int, batch_size: int) -> int:
  """Full minibatches per epoch of a shard (the last partial batch is dropped).

  Args:
    shard_size: examples in the shard.
    batch_size: examples per minibatch.

  Returns:
    ``shard_size // batch_size``, at least 1.

  Raises:
    ValueError: ``batch_size < 1`` or ``batch_size > shard_size``.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  if batch_size > shard_size:
    raise ValueError(f"batch_size ({batch_size}) is larger than the shard ({shard_size} examples)")
  return shard_size // batch_size


def _shard_key(shard: np.ndarray) -> int:
  """A shard-specific seed word: CRC-32 of the shard's indices (little-endian int64), stable across platforms."""
  return zlib.crc32(np.ascontiguousarray(shard, dtype="<i8").tobytes())


def _epoch_permutation(shard: np.ndarray, epoch: int, seed: int) -> np.ndarray:
  """The shard's examples in the order of one epoch, seeded by (seed, shard, epoch)."""
  rng = np.random.default_rng(np.random.SeedSequence([seed, _shard_key(shard), epoch]))
  return shard[rng.permutation(shard.shape[0])]


def _check_minibatch_args(shard: np.ndarray, minibatch_id: int, seed: int) -> None:
  if shard.ndim != 1:
    raise ValueError(f"shard must be a 1-D index array, got shape {shard.shape}")
  if minibatch_id < 0:
    raise ValueError(f"minibatch_id must be >= 0, got {minibatch_id}")
  if seed < 0:
    raise ValueError(f"seed must be >= 0, got {seed}")


def minibatch_indices(shard: np.ndarray, batch_size: int, minibatch_id: int, seed: int) -> np.ndarray:
  """The examples of global minibatch ``minibatch_id`` of a shard (a pure function of its arguments).

  Epoch ``e = minibatch_id // batches_per_epoch`` visits the shard in a permutation seeded by
  ``SeedSequence([seed, crc32(shard), e])``; minibatch ``minibatch_id`` is the
  ``minibatch_id % batches_per_epoch``-th run of ``batch_size`` examples of it. The last partial batch of each
  epoch is dropped, so within an epoch no example appears twice.

  Args:
    shard: int ``[shard_size]`` example indices, from :func:`shard_indices`.
    batch_size: examples per minibatch.
    minibatch_id: 0-based global minibatch number (HetPipe's minibatch p, counted across epochs).
    seed: non-negative data seed.

  Returns:
    int64 ``[batch_size]`` example indices (a subset of ``shard``).

  Raises:
    ValueError: ``shard`` is not 1-D, ``minibatch_id < 0``, ``seed < 0``, or ``batch_size`` not in
      ``[1, shard_size]``.
  """
  shard = np.asarray(shard)
  _check_minibatch_args(shard, minibatch_id, seed)
  per_epoch = batches_per_epoch(shard.shape[0], batch_size)
  epoch, position = divmod(minibatch_id, per_epoch)
  order = _epoch_permutation(shard, epoch, seed)
  return order[position * batch_size:(position + 1) * batch_size].astype(np.int64)


class ShardedMinibatches:
  """Training minibatches of one shard, addressed by global minibatch id.

  Same data as :func:`minibatch_indices` (it caches the current epoch's permutation, nothing more).

  Args:
    dataset: the loaded dataset (:mod:`hetpipe_jax.data.dataset` interface); only the training split is used.
    num_shards: number of shards (e.g. virtual workers).
    shard_id: this shard, in ``[0, num_shards)``.
    batch_size: examples per minibatch.
    seed: non-negative data seed.

  Raises:
    ValueError: invalid shard arguments (see :func:`shard_indices`) or ``batch_size`` not in
      ``[1, shard_size]``.
  """

  def __init__(self, dataset: Any, num_shards: int, shard_id: int, batch_size: int, seed: int):
    self._images = dataset.train_inputs
    self._labels = dataset.train_targets
    self.shard_id = shard_id
    self.batch_size = batch_size
    self.seed = seed
    self.shard = shard_indices(dataset.num_train, num_shards, shard_id, seed)
    self.num_batches_per_epoch = batches_per_epoch(self.shard.shape[0], batch_size)
    self._cached_epoch = -1
    self._cached_order = self.shard

  @property
  def shard_size(self) -> int:
    return int(self.shard.shape[0])

  def indices(self, minibatch_id: int) -> np.ndarray:
    """int64 ``[batch_size]`` example indices of minibatch ``minibatch_id``; equals :func:`minibatch_indices`."""
    _check_minibatch_args(self.shard, minibatch_id, self.seed)
    epoch, position = divmod(minibatch_id, self.num_batches_per_epoch)
    if epoch != self._cached_epoch:
      self._cached_order = _epoch_permutation(self.shard, epoch, self.seed)
      self._cached_epoch = epoch
    return self._cached_order[position * self.batch_size:(position + 1) * self.batch_size].copy()

  def get(self, minibatch_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Minibatch ``minibatch_id`` (0-based, counted across epochs).

    Args:
      minibatch_id: global minibatch number.

    Returns:
      ``(inputs, targets)``: e.g. float32 ``[batch_size, 28, 28, 1]`` images in [0, 1] and int32 ``[batch_size]``
      labels (Fashion-MNIST), or int32 ``[batch_size, seq]`` tokens and next tokens (text).

    Raises:
      ValueError: ``minibatch_id < 0``.
    """
    idx = self.indices(minibatch_id)
    return self._images[idx], self._labels[idx]

  def get_with_ids(self, minibatch_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`get` and the examples' indices into the training split (int64 ``[batch_size]``, in the order fed):
    what a VW records with each minibatch (``MinibatchRecord.example_ids``)."""
    idx = self.indices(minibatch_id)
    return self._images[idx], self._labels[idx], idx


class MicroBatches:
  """Micro-batch ``p`` of a minibatch source: minibatch ``p // M``, examples ``[(p % M) b, (p % M + 1) b)`` with
  ``b = batch_size / M`` (GPipe, 1F1B-flush, Horovod's gradient accumulation: the M micro-batches of a step are
  exactly its minibatch).

  Args:
    get: ``minibatch_id -> (images, labels)`` numpy arrays of ``batch_size`` examples.
    num_microbatches: M, dividing the batch size.

  Raises:
    ValueError: M < 1.
  """

  def __init__(self, get, num_microbatches: int):
    if num_microbatches < 1:
      raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    self._get = get
    self.num_microbatches = num_microbatches
    self._cached = (-1, None)

  def get(self, microbatch_id: int):
    """``(images, labels)`` of micro-batch ``microbatch_id`` (and its example ids, when ``get`` gives them).

    Raises:
      ValueError: the minibatch's size is not a multiple of M.
    """
    step, part = divmod(microbatch_id, self.num_microbatches)
    if self._cached[0] != step:
      self._cached = (step, self._get(step))
    arrays = self._cached[1]
    n = arrays[1].shape[0]
    if n % self.num_microbatches:
      raise ValueError(f"a minibatch of {n} examples does not split into {self.num_microbatches} micro-batches")
    b = n // self.num_microbatches
    return tuple(a[part * b:(part + 1) * b] for a in arrays)
