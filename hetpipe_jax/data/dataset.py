"""The dataset interface every job trains on, and ``config.dataset``: ``fashion_mnist``, ``text`` or a user factory.

Numpy only. A dataset is four arrays: training inputs and targets, evaluation inputs and targets, whose example shape
and dtype match the model's (``ModelSpec.input_shape`` / ``input_dtype``). The job cuts the training examples into
deterministic per-VW shards and visits them in a seeded order (:mod:`hetpipe_jax.data.sharding`), and evaluates on the
whole evaluation split, which it never trains on.

A user dataset is ``--config.dataset=package.module:factory`` where ``factory(config)`` (``config``: the job's
config as given, read-only, :attr:`DataSettings.factory_config`) returns an :class:`ExampleDataset`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hetpipe_jax.data import fashion_mnist
from hetpipe_jax.data import text
from hetpipe_jax.data.example_dataset import ExampleDataset  # noqa: F401  (the interface users import from here)
from hetpipe_jax.data.fashion_mnist import DataError
from hetpipe_jax.user_code import load_factory

BUILTIN_DATASETS = ("fashion_mnist", "text")


class DatasetConfigError(DataError):
  """``config.dataset`` cannot be loaded or does not fit the model; the message names the setting and the fix."""


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """The job's data section (:class:`hetpipe_jax.jobs.job.Job` ``.data``).

  Attributes:
    dataset: ``config.dataset``: ``"fashion_mnist"``, ``"text"`` or ``"package.module:factory"``.
    data_dir: fashion_mnist: the IDX files' directory (``""``: the default); text: comma-separated files or
      directories.
    check_counts: fashion_mnist: require the real 60,000 / 10,000 examples.
    factory_config: what a user factory receives: the job's config as given, read-only (attribute access).
  """

  dataset: str
  data_dir: str
  check_counts: bool
  factory_config: Any = None


_FIX = "give 'fashion_mnist', 'text', or 'package.module:factory' where factory(config) returns an ExampleDataset"


def check_dataset_name(name: str) -> None:
  """Checks the form of ``config.dataset`` (nothing is imported).

  Raises:
    DatasetConfigError: neither a built-in name nor ``module:factory``.
  """
  if name in BUILTIN_DATASETS:
    return
  module_name, sep, attr = name.partition(":")
  if not sep or not module_name or not attr:
    raise DatasetConfigError(f"config.dataset={name!r} is unknown: {_FIX}")


def _load_user_dataset(name: str, factory_config: Any) -> Any:
  attr = name.partition(":")[2]
  factory = load_factory("config.dataset", name, _FIX, DatasetConfigError)
  try:
    dataset = factory(factory_config)
  except DataError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise DatasetConfigError(f"config.dataset={name!r}: {attr}(config) raised {type(e).__name__}: {e}") from None
  if not isinstance(dataset, ExampleDataset):
    raise DatasetConfigError(f"config.dataset={name!r}: {attr}(config) returned {type(dataset).__name__}, not a "
                             f"hetpipe_jax.data.dataset.ExampleDataset; {_FIX}")
  return dataset


def validate_dataset(dataset: Any, name: str, example_shape: tuple[int, ...], example_dtype: str,
                     num_classes: int) -> None:
  """Checks that the dataset fits the model: shapes, dtypes, counts and target range.

  Args:
    dataset: anything with ``train_inputs / train_targets / eval_inputs / eval_targets`` arrays.
    name: ``config.dataset`` (for messages).
    example_shape: the model's ``input_shape``; example_dtype: its ``input_dtype``.
    num_classes: targets must lie in ``[0, num_classes)``.

  Raises:
    DatasetConfigError: a wrong shape or dtype, mismatched counts, an empty split, a non-integer or out-of-range
      target; the message names ``config.dataset``, the array, what was found and what the model needs.
  """
  want_dtype = np.dtype(example_dtype)
  for split in ("train", "eval"):
    x, y = getattr(dataset, f"{split}_inputs"), getattr(dataset, f"{split}_targets")
    where = f"config.dataset={name!r}: {split}_inputs"
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
      raise DatasetConfigError(f"config.dataset={name!r}: {split}_inputs and {split}_targets must be numpy arrays")
    if x.ndim < 1 or tuple(x.shape[1:]) != tuple(example_shape):
      raise DatasetConfigError(f"{where} has shape {list(x.shape)}, but the model takes examples of shape "
                               f"{list(example_shape)} (so [n, {', '.join(map(str, example_shape))}]): make the "
                               "data match config.model, or the model match the data")
    if x.dtype != want_dtype:
      raise DatasetConfigError(f"{where} has dtype {x.dtype}, but the model takes {want_dtype}")
    if x.shape[0] < 1:
      raise DatasetConfigError(f"{where} is empty")
    if y.shape[:1] != x.shape[:1]:
      raise DatasetConfigError(f"config.dataset={name!r}: {split}_targets has {y.shape[0] if y.ndim else 0} "
                               f"examples but {split}_inputs has {x.shape[0]}")
    if not np.issubdtype(y.dtype, np.integer):
      raise DatasetConfigError(f"config.dataset={name!r}: {split}_targets has dtype {y.dtype}; targets are integer "
                               "class or token ids (int32)")
    if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
      raise DatasetConfigError(f"config.dataset={name!r}: {split}_targets range from {int(y.min())} to "
                               f"{int(y.max())}, outside the model's {num_classes} outputs [0, {num_classes})")


def load_dataset(data: DataSettings, example_shape: tuple[int, ...], example_dtype: str, num_classes: int) -> Any:
  """Loads and validates the dataset ``config.dataset`` names, for a model of the given example shape and dtype.

  ``fashion_mnist``: the IDX files (``data_dir``, ``check_counts``; :mod:`.fashion_mnist`).
  ``text``: byte-level language-model windows of ``example_shape[0]`` tokens from the files or directories in
  ``data_dir`` (default: the Debian package ``fortunes``; :mod:`.text`). ``module:factory``: a user's, called with
  ``data.factory_config``.

  Args:
    data: the job's data section.
    example_shape, example_dtype, num_classes: the model's ``input_shape``, ``input_dtype``, ``num_classes``.

  Returns:
    The dataset (:class:`ExampleDataset` or :class:`.fashion_mnist.Dataset`, both with the interface's arrays).

  Raises:
    DatasetConfigError: see :func:`check_dataset_name`, :func:`validate_dataset`; a user factory that fails.
    DataError: missing or corrupt files.
  """
  name = data.dataset
  check_dataset_name(name)
  if name == "fashion_mnist":
    dataset = fashion_mnist.load_fashion_mnist(data.data_dir or None,
                                               expected_counts=(60000, 10000) if data.check_counts else None)
  elif name == "text":
    if len(example_shape) != 1:
      raise DatasetConfigError(f"config.dataset='text' gives token sequences [n, seq_len], but config.model takes "
                               f"examples of shape {list(example_shape)}: use a language model (e.g. 'gpt_bytes')")
    dataset = text.load_text_dataset(text.parse_paths(data.data_dir), seq_len=example_shape[0])
  else:
    dataset = _load_user_dataset(name, data.factory_config)
  validate_dataset(dataset, name, tuple(example_shape), example_dtype, num_classes)
  return dataset


def dataset_description(dataset: Any) -> dict[str, Any]:
  """What config.json records about the data (``dataset_info``): counts plus the dataset's own description."""
  return {"num_train": int(dataset.num_train), "num_eval": int(dataset.eval_inputs.shape[0]),
          **dict(getattr(dataset, "description", {}) or {})}
