"""The dataset interface a user's factory returns (docs/usage.md, "Your own model and data"); re-exported by
:mod:`hetpipe_jax.data.dataset`, which loads and checks datasets, and built by :mod:`hetpipe_jax.data.text`.

Data layer: numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np


class ExampleCounts:
  """The interface's example counts, for any dataset class with its ``train_inputs`` and ``eval_inputs`` arrays."""

  @property
  def num_train(self) -> int:
    return int(self.train_inputs.shape[0])

  @property
  def num_eval(self) -> int:
    return int(self.eval_inputs.shape[0])


@dataclasses.dataclass(frozen=True)
class ExampleDataset(ExampleCounts):
  """A dataset as arrays (the interface a user factory returns).

  Attributes:
    train_inputs: ``[num_train, *example_shape]`` of the model's input dtype (float32 images, int32 tokens).
    train_targets: int32 ``[num_train, ...]``: class labels ``[num_train]`` or next tokens ``[num_train, seq]``.
    eval_inputs: ``[num_eval, *example_shape]``, held out: never trained on.
    eval_targets: int32 ``[num_eval, ...]``.
    description: JSON-serialisable facts about the data (source, counts, hashes), recorded in config.json as
      ``dataset_info``.
  """

  train_inputs: np.ndarray
  train_targets: np.ndarray
  eval_inputs: np.ndarray
  eval_targets: np.ndarray
  description: Mapping[str, Any] = dataclasses.field(default_factory=dict)
