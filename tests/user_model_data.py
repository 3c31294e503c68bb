"""A user's own model and dataset, outside the package: loaded by ``--config.model=tests.user_model_data:make_spec``
and ``--config.dataset=tests.user_model_data:make_dataset`` (README, "Your own model and data").

The task: 12 float features, 3 classes; the class is the argmax of three fixed linear functions of the features (so a
linear model learns it). The bad factories below exist for the error tests.
"""

from __future__ import annotations

import flax.linen as nn
import numpy as np

from hetpipe_jax.data.dataset import ExampleDataset
from hetpipe_jax.models import ModelSpec
from hetpipe_jax.models.layers import Dense

NUM_FEATURES = 12
NUM_CLASSES = 3


def make_spec() -> ModelSpec:
  """12 -> 24 (tanh) -> 24 (tanh) -> 3: three layers, two cut points."""
  return ModelSpec("user_mlp", (Dense(24, nn.tanh), Dense(24, nn.tanh), Dense(NUM_CLASSES)), (NUM_FEATURES,),
                   NUM_CLASSES)


def _split(rng: np.random.Generator, n: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  x = rng.standard_normal((n, NUM_FEATURES)).astype(np.float32)
  return x, np.argmax(x @ w, axis=1).astype(np.int32)


def make_dataset(config) -> ExampleDataset:
  """768 training and 256 held-out examples, fixed by ``config.seed``."""
  rng = np.random.default_rng(1234 + config.seed)
  w = rng.standard_normal((NUM_FEATURES, NUM_CLASSES))
  x, y = _split(rng, 768, w)
  ex, ey = _split(rng, 256, w)
  return ExampleDataset(x, y, ex, ey, {"name": "user_linear_3class", "seed": int(config.seed)})


def not_a_spec():
  return {"layers": []}


def wrong_shape_dataset(config) -> ExampleDataset:
  d = make_dataset(config)
  return ExampleDataset(d.train_inputs[:, :11], d.train_targets, d.eval_inputs[:, :11], d.eval_targets)


def labels_out_of_range_dataset(config) -> ExampleDataset:
  d = make_dataset(config)
  return ExampleDataset(d.train_inputs, d.train_targets + 1, d.eval_inputs, d.eval_targets)


def spec_as_dataset(config):
  del config
  return make_spec()
